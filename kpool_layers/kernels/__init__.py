"""Fused GPU kernels (Triton) for the DSA attention stack."""
