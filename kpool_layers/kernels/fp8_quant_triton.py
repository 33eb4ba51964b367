"""Fused FP8 (e4m3) quantization: amax, scale and cast of one operand in one Triton kernel (two for
the tensorwise recipe, whose scale needs the whole tensor's amax first).

:func:`quantize` has the contract and the numerics of :func:`kpool_layers.precision.fp8.quantize` (the
reference, used by the ``emulate`` backend) and returns the same bytes and scales:

* scale ``s`` of a tile with absolute maximum ``a``: ``r = max(a, 1e-4) / 448`` (IEEE division),
  ``ue8m0``: ``s = exp2(ceil(log2(r)))``, ``amax``: ``s = r``. On CUDA ``log2``/``exp2`` are
  libdevice's ``log2f``/``exp2f`` (what ``torch.log2``/``torch.exp2`` run on CUDA; the PTX
  approximations could round ``log2`` differently next to an integer). Under
  ``TRITON_INTERPRET=1`` (CPU tests) they are numpy's, compared against torch's CPU ones;
* ``q = e4m3(clamp(x / s, -448, 448))``: FP32 IEEE division, round to nearest even;
* tiles as :func:`kpool_layers.precision.fp8.quantize`: blockwise 1x128 (activation) / 128x128 (weight),
  rowwise 1xK, tensorwise MxK; partial edge tiles use the amax of their own elements.

Layouts: ``x [..., K]`` (activation; leading dims flattened into rows ``M``) or ``[N, K]``
(weight), any float dtype and any strides, loaded as FP32: a 2-D view such as a transpose
``g.t()`` (the FP8 wgrad's ``dy^T`` and ``x^T``) is read in place through its row and column
strides, with no contiguous copy first; returns ``q`` float8_e4m3fn of ``x``'s shape (row-major)
and ``scale`` FP32 ``[ceil(M / tile rows), ceil(K / tile cols)]``.

One kernel, four modes (``MODE``), over programs that each own ``BLOCK_M`` rows of one column
group (``GROUP`` columns, read in ``CHUNK``-wide pieces, twice: amax pass, cast pass):
``ROW`` one scale per row of the group (blockwise activation, rowwise), ``TILE`` one scale per
program (128x128 weight blocks), ``AMAX`` only the program's amax into a buffer, ``GLOBAL`` the
scale from the amax buffer (tensorwise: ``AMAX`` then ``GLOBAL``).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kpool_layers.precision import fp8_format

ROW, TILE, AMAX, GLOBAL = 0, 1, 2, 3


@triton.jit
def _scale(amax, UE8M0: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Dequantization scale(s) for absolute maxima ``amax`` (FP32, any shape)."""
    ratio = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if UE8M0:
        if LIBDEVICE:
            ratio = libdevice.exp2(tl.ceil(libdevice.log2(ratio)))
        else:
            ratio = tl.exp2(tl.ceil(tl.log2(ratio)))
    return ratio


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, amax_ptr, M, K, GROUP, n_groups, n_amax, stride_xm, stride_xk, stride_q,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, UE8M0: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    start = pid_g * GROUP
    end = tl.minimum(start + GROUP, K)
    if MODE == 3:  # GLOBAL: the tensor's amax from the per-program maxima of an AMAX launch
        amax = tl.zeros([CHUNK], dtype=tl.float32)
        for i in range(0, n_amax, CHUNK):
            idx = i + tl.arange(0, CHUNK)
            amax = tl.maximum(amax, tl.load(amax_ptr + idx, mask=idx < n_amax, other=0.0))
        scale = _scale(tl.max(amax, axis=0), UE8M0, LIBDEVICE)
        if pid_m == 0:
            tl.store(s_ptr, scale)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(start, end, CHUNK):
            cols = c + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols < end)[None, :]
            v = tl.load(x_rows + cols.to(tl.int64)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        if MODE == 2:  # AMAX
            tl.store(amax_ptr + pid_m, tl.max(amax, axis=0))
        elif MODE == 1:  # TILE
            scale = _scale(tl.max(amax, axis=0), UE8M0, LIBDEVICE)
            tl.store(s_ptr + pid_m * n_groups + pid_g, scale)
        else:  # ROW
            scale = _scale(amax, UE8M0, LIBDEVICE)
            tl.store(s_ptr + rows * n_groups + pid_g, scale, mask=row_ok)
            scale = scale[:, None]
    if MODE != 2:
        for c in range(start, end, CHUNK):
            cols = c + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols < end)[None, :]
            v = tl.load(x_rows + cols.to(tl.int64)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
            tl.store(q_rows + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize(
    x: torch.Tensor,
    recipe: fp8_format.Recipe,
    operand: fp8_format.Operand,
    scale_format: fp8_format.ScaleFormat = "ue8m0",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kpool_layers.precision.fp8.quantize` in one fused kernel (two for ``tensorwise``) on a CUDA
    tensor (or under ``TRITON_INTERPRET=1``): same ``(q, scale)`` bytes and values.

    ``out_dtype=torch.float32`` returns ``clamp(x / s, -448, 448)`` before the e4m3 rounding
    (the CPU tests: Triton's interpreter rounds FP8 conversions half away from zero and flushes
    e4m3 subnormals, the GPU's ``cvt.rn.satfinite`` rounds to nearest even as torch does)."""
    if operand == "weight" and x.dim() != 2:
        raise ValueError(f"weight operand must be 2-D [N, K], got shape {tuple(x.shape)}")
    if scale_format not in fp8_format.SCALE_FORMATS:
        raise ValueError(f"scale_format={scale_format!r} is not supported; allowed: {list(fp8_format.SCALE_FORMATS)}")
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    tr, tc = fp8_format.tile_shape(recipe, operand, m, k)
    if x.numel() == 0:  # no rows or no columns: no element reads the scales (ones, as fp8.quantize)
        return (torch.empty(x.shape, dtype=out_dtype, device=x.device),
                torch.ones((triton.cdiv(m, tr), triton.cdiv(k, tc)), dtype=torch.float32, device=x.device))
    x2 = x.reshape(m, k)  # a view where the strides allow one (any 2-D x), else a copy
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    n_groups = triton.cdiv(k, tc)
    scale = torch.empty((triton.cdiv(m, tr), n_groups), dtype=torch.float32, device=x.device)
    ue8m0 = scale_format == "ue8m0"
    libdevice_math = os.environ.get("TRITON_INTERPRET") != "1"
    if recipe == "tensorwise":
        block_m = 16
        grid = (triton.cdiv(m, block_m), 1)
        chunk = min(triton.next_power_of_2(k), 512)
        amax = torch.empty(grid[0], dtype=torch.float32, device=x.device)
        for mode in (AMAX, GLOBAL):
            _quantize_kernel[grid](x2, q, scale, amax, m, k, k, 1, grid[0], x2.stride(0), x2.stride(1), q.stride(0),
                                   MODE=mode, BLOCK_M=block_m, CHUNK=chunk, UE8M0=ue8m0, LIBDEVICE=libdevice_math, num_warps=4)
    elif tr == fp8_format.BLOCK:  # blockwise weight: one scale per 128x128 block
        _quantize_kernel[(scale.shape[0], n_groups)](
            x2, q, scale, scale, m, k, fp8_format.BLOCK, n_groups, 0, x2.stride(0), x2.stride(1), q.stride(0),
            MODE=TILE, BLOCK_M=fp8_format.BLOCK, CHUNK=fp8_format.BLOCK, UE8M0=ue8m0, LIBDEVICE=libdevice_math, num_warps=8)
    else:  # one scale per row of each group: blockwise activation (1x128), rowwise (1xK)
        chunk = min(triton.next_power_of_2(tc), 512)
        block_m = max(1, 4096 // chunk)
        _quantize_kernel[(triton.cdiv(m, block_m), n_groups)](
            x2, q, scale, scale, m, k, tc, n_groups, 0, x2.stride(0), x2.stride(1), q.stride(0),
            MODE=ROW, BLOCK_M=block_m, CHUNK=chunk, UE8M0=ue8m0, LIBDEVICE=libdevice_math, num_warps=4)
    return q.reshape(x.shape), scale
