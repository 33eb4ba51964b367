"""``acc += a @ b`` into an fp32 accumulator without rounding the product to the operands' dtype
(the sparse-MLA dense backward's key gradient, megatron's fused weight-gradient accumulation)."""

from __future__ import annotations

import torch


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc [m, n]`` (``a [m, k]``, ``b [k, n]``) with fp32
    accumulation and no rounding of the product to ``a``'s dtype: one cuBLAS GEMM accumulating into
    ``acc`` (beta = 1, fp32 output of bf16/fp16 operands) on CUDA, exact fp32 products added into
    ``acc`` elsewhere (torch has no CPU kernel for ``addmm`` with ``out_dtype``)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a.float() @ b.float()
