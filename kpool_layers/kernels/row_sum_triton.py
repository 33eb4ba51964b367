"""Sums of gathered rows in a fixed order, in one Triton kernel: the routed experts' combine and the
backward of their token permutation (:mod:`kpool_layers.moe.permute`).

:func:`gather_row_sum` computes, for ``rows [R, H]`` and ``index [T, K]`` (int64, every entry in
``[0, R)``)::

    out[t] = R( rows[index[t, 0]] + rows[index[t, 1]] + ... + rows[index[t, K - 1]] )   out [T, H]

in FP32, left to right (``k`` ascending), rounded once (``R``) to the rows' dtype (BF16 rounding on
the bits, :func:`kpool_layers.kernels.mhc_mix_triton._round`, so Triton's interpreter rounds as a
GPU does). Each output row is written by exactly one program and no atomics are used: results are
bit-identical run to run and equal the torch form of the same order,
:func:`kpool_layers.moe.permute.torch_row_sum`, bit for bit. One program per ``(token, BLOCK_H
channels)``: reads ``K`` rows of the block and writes one (the kernel moves ``(K + 1) H`` elements
per token and holds no FP32 copy of the rows in memory).

Layouts: ``rows [R, H]`` row-major (a non-contiguous input is copied first), ``index [T, K]``
row-major int64, ``out [T, H]`` contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.mhc_mix_triton import _round

BLOCK_H = 1024
"""Channels per program (fewer for narrower rows: the next power of two)."""


@triton.jit
def _gather_row_sum_kernel(rows_ptr, index_ptr, out_ptr, H, K: tl.constexpr, BF16: tl.constexpr,
                           BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = c < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(index_ptr + t * K + k)
        acc += tl.load(rows_ptr + r * H + c, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + c, _round(acc, BF16).to(out_ptr.dtype.element_ty), mask=live)


def gather_row_sum(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows [R, H]`` (BF16, FP16 or FP32), ``index [T, K]`` int64 -> ``[T, H]`` in ``rows``' dtype
    (module docstring). ``K >= 1``; ``T = 0`` or ``H = 0`` give an empty result."""
    if index.dim() != 2 or index.shape[1] < 1 or index.dtype != torch.int64:
        raise ValueError(f"index must be int64 [T, K >= 1], got {index.dtype} {tuple(index.shape)}")
    rows = rows.contiguous()
    t, k = index.shape
    h = rows.shape[1]
    out = torch.empty(t, h, dtype=rows.dtype, device=rows.device)
    if t == 0 or h == 0:
        return out
    block = min(BLOCK_H, triton.next_power_of_2(h))
    _gather_row_sum_kernel[(t, triton.cdiv(h, block))](
        rows, index.contiguous(), out, h, K=k, BF16=rows.dtype == torch.bfloat16, BLOCK=block,
        num_warps=4 if block >= 512 else 1)
    return out
