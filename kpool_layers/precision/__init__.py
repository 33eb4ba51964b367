"""Numerics of every linear: the precision policy and its roles, FP8 quantization and GEMMs, the Hadamard transform, the role-tagged linears and the cached FP8 weights."""
