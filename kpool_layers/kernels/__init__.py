"""Triton kernels for the attention layers (imported on demand; needs triton)."""
