"""Mixture of experts: the MoE layer (token dispatch), the router, the grouped experts and their grouped GEMMs."""
