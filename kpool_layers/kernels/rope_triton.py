"""Rotary position embedding in one Triton kernel per direction: the rotation of a tensor's rotary
channels and the copy of its other channels into one output, forward or backward
(:mod:`kpool_layers.mla.rope` routes bf16 CUDA tensors here).

Both directions compute, per row ``(i_s, i_b, i_n)`` of ``[s, b, n, *]`` views and rotary channel
``j < ROT`` (``ROT`` a power of two, ``H = ROT / 2``; ``R`` rounds an FP32 value to BF16, nearest
even, on the bits so that Triton's interpreter rounds as a GPU does)::

    src(j) = 2j if j < H else 2(j - H) + 1    with mla_interleaved (megatron's de-interleave), else j
    p(j)   = j xor 1                          with pairs (rotary_interleaved), else (j + H) mod ROT
    forward:  y[j]      = R( R(x[src(j)] cos[i_s, j]) + R(x[src(p(j))] sin[i_s, j]) )
    backward: y[src(j)] = R( R(g[j] cos[i_s, j])      + R(g[p(j)] sin[i_s, p(j)]) )

with ``sin`` carrying the sign of "rotate half" (:class:`kpool_layers.mla.rope.RotaryTables`).
These are the operations, in the same order and with the same roundings, that the torch form
``rot * cos + partner(rot) * sin`` and its autograd backward run (``p`` is an involution, so the
partner's backward reads ``p(j)`` as well): the results equal it bit for bit. The channels past
the rotary ones (``D_REST`` of them, the "rest" views) are copied unchanged. One program per
``BLOCK_R`` rows; no atomics, no host synchronisation (CUDA-graph safe).

Layouts: every view has unit stride in its last dimension and any strides in ``s, b, n`` (passed
per view); ``cos``/``sin`` are ``[s, ROT]`` contiguous in the rotated dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.mhc_mix_triton import _round

BLOCK_R = 32
"""Rows per program."""

BLOCK_C = 128
"""Rest channels copied per step of a program's loop."""

NUM_WARPS = 4
"""Warps per program."""


@triton.jit
def _deinterleaved(j, HALF: tl.constexpr, MLA_INTERLEAVED: tl.constexpr):
    """The input channel of de-interleaved channel ``j`` (``j`` itself without the de-interleave)."""
    if MLA_INTERLEAVED:
        return tl.where(j < HALF, 2 * j, 2 * (j - HALF) + 1)
    return j


@triton.jit
def _rope_kernel(x_ptr, xr_ptr, cos_ptr, sin_ptr, y_ptr, yr_ptr, rows, B, N, D_REST,
                 xs, xb, xn, xrs, xrb, xrn, ys, yb, yn, yrs, yrb, yrn,
                 ROT: tl.constexpr, BACKWARD: tl.constexpr, MLA_INTERLEAVED: tl.constexpr,
                 PAIRS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    HALF: tl.constexpr = ROT // 2
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    live = (r < rows)[:, None]
    i_n = r % N
    i_b = (r // N) % B
    i_s = r // (N * B)
    j = tl.arange(0, ROT)
    if PAIRS:
        p = j ^ 1
    else:
        p = (j + HALF) % ROT
    x_row = x_ptr + (i_s * xs + i_b * xb + i_n * xn)[:, None]
    y_row = y_ptr + (i_s * ys + i_b * yb + i_n * yn)[:, None]
    table = (i_s * ROT)[:, None]
    c = tl.load(cos_ptr + table + j[None, :], mask=live, other=0.0).to(tl.float32)
    if BACKWARD:
        a = tl.load(x_row + j[None, :], mask=live, other=0.0).to(tl.float32)
        ap = tl.load(x_row + p[None, :], mask=live, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + table + p[None, :], mask=live, other=0.0).to(tl.float32)
        dst = _deinterleaved(j, HALF, MLA_INTERLEAVED)
    else:
        a = tl.load(x_row + _deinterleaved(j, HALF, MLA_INTERLEAVED)[None, :], mask=live, other=0.0)
        ap = tl.load(x_row + _deinterleaved(p, HALF, MLA_INTERLEAVED)[None, :], mask=live, other=0.0)
        a, ap = a.to(tl.float32), ap.to(tl.float32)
        sn = tl.load(sin_ptr + table + j[None, :], mask=live, other=0.0).to(tl.float32)
        dst = j
    out = _round(_round(a * c, True) + _round(ap * sn, True), True)
    tl.store(y_row + dst[None, :], out.to(y_ptr.dtype.element_ty), mask=live)
    xr_row = xr_ptr + (i_s * xrs + i_b * xrb + i_n * xrn)[:, None]
    yr_row = yr_ptr + (i_s * yrs + i_b * yrb + i_n * yrn)[:, None]
    for c0 in range(0, D_REST, BLOCK_C):
        ch = c0 + tl.arange(0, BLOCK_C)
        m = live & (ch < D_REST)[None, :]
        tl.store(yr_row + ch[None, :], tl.load(xr_row + ch[None, :], mask=m, other=0.0), mask=m)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"rotary views need unit stride in the last dimension, got {t.stride()}")
    return t.stride(0), t.stride(1), t.stride(2)


def rope(x: torch.Tensor, x_rest: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
         y: torch.Tensor, y_rest: torch.Tensor | None, *, backward: bool, mla_interleaved: bool,
         pairs: bool) -> None:
    """Rotate ``x [s, b, n, ROT]`` into ``y`` (``backward``: the gradient ``g = x`` of a rotation
    into the rotated input's gradient ``y``) and copy ``x_rest [s, b, n, D]`` into ``y_rest``
    (None: no rest channels); ``cos``/``sin [s, ROT]`` contiguous. BF16 tensors (in FP32 the
    compiler may fuse a product into the sum, which the torch ops round separately). Views as the
    module docstring; ``y`` and ``y_rest`` may be views of one output."""
    s, b, n, rot = x.shape
    rows = s * b * n
    if rows == 0:
        return
    if rot & (rot - 1) or rot < 2:
        raise ValueError(f"rotary channels must be a power of two >= 2, got {rot}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the rotary kernel takes BF16 tensors, got {x.dtype}")
    rest = x_rest is not None and x_rest.shape[-1] > 0
    xr, yr = (x_rest, y_rest) if rest else (x, y)
    _rope_kernel[(triton.cdiv(rows, BLOCK_R),)](
        x, xr, cos, sin, y, yr, rows, b, n, xr.shape[-1] if rest else 0,
        *_strides(x), *_strides(xr), *_strides(y), *_strides(yr),
        ROT=rot, BACKWARD=backward, MLA_INTERLEAVED=mla_interleaved, PAIRS=pairs,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
