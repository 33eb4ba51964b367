"""Fused FP8 (e4m3) dequantization: ``float32(q) * scale`` and the rounding to the output dtype of
one operand in one Triton kernel (the straight-through backward of the FP8 linears).

:func:`dequantize` has the contract of :func:`kpool_layers.precision.fp8.dequantize` (the reference, eager:
an FP32 copy, a multiply by the tile-expanded scales and a cast, each one kernel or more) and
returns the same bits: every element is ``float32(q) * s`` (exact widening, one IEEE FP32
multiply) rounded once to ``out_dtype`` (round to nearest even, torch's ``.to`` and Triton's
conversion on the GPU; Triton's interpreter truncates FP32 -> BF16, so the CPU tests run
``out_dtype=torch.float32``).

Layouts: ``q [..., K]`` float8_e4m3fn (leading dims flattened into rows ``M``; ``[N, K]`` for a
weight) and ``scale`` FP32 ``[ceil(M / tile rows), ceil(K / tile cols)]`` as
:func:`kpool_layers.precision.fp8.quantize` returns them: blockwise 1x128 (activation) / 128x128 (weight),
rowwise 1xK (``[M, 1]``), tensorwise MxK (``[1, 1]``); returns ``out_dtype`` with ``q``'s shape.

Programs own ``BLOCK_M`` rows of one ``BLOCK_K = 128``-column block, which is one blockwise scale
column, so each program loads one scale per row: row ``r`` reads ``scale[r // ROW_TILE, pid_k]``
through strides that are 0 along a scale dimension of size 1 (rowwise and tensorwise columns,
tensorwise rows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kpool_layers.precision import fp8_format

BLOCK_M = 32
"""Rows per program."""

OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Output dtypes the kernel stores."""


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, M, K, stride_q, stride_out, stride_s_row, stride_s_col,
    ROW_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    scale = tl.load(s_ptr + (rows // ROW_TILE) * stride_s_row + pid_k * stride_s_col, mask=row_ok, other=0.0)
    rows64 = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + rows64 * stride_q + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = q * scale[:, None]
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    recipe: fp8_format.Recipe,
    operand: fp8_format.Operand,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`kpool_layers.precision.fp8.dequantize` ``(q, scale, recipe, operand, out_dtype)`` in one kernel
    on a CUDA tensor (or under ``TRITON_INTERPRET=1``): the same bits (module docstring)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; allowed: {list(OUT_DTYPES)}")
    k = q.shape[-1]
    m = math.prod(q.shape[:-1])
    q2 = q.reshape(m, k)
    tr, tc = fp8_format.tile_shape(recipe, operand, m, k)
    expected = (triton.cdiv(m, tr), triton.cdiv(k, tc))
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(f"scale must be FP32 {list(expected)} for a {recipe} {operand} of shape "
                         f"{tuple(q.shape)}, got {scale.dtype} {list(scale.shape)}")
    out = torch.empty((m, k), dtype=out_dtype, device=q.device)
    if out.numel() == 0:
        return out.reshape(q.shape)
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    rows_scaled, cols_scaled = scale.shape[0] > 1, scale.shape[1] > 1  # cols_scaled: blockwise, tc = 128
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, fp8_format.BLOCK))
    _dequantize_kernel[grid](
        q2, scale, out, m, k, q2.stride(0), out.stride(0),
        scale.stride(0) if rows_scaled else 0, scale.stride(1) if cols_scaled else 0,
        ROW_TILE=tr if rows_scaled else 1, BLOCK_M=BLOCK_M, BLOCK_K=fp8_format.BLOCK, num_warps=4)
    return out.reshape(q.shape)
