"""The butterfly Hadamard transform of :func:`kpool_layers.precision.hadamard.hadamard_transform` in one
Triton kernel per direction, with the same bits as the PyTorch butterfly (forward and autograd).

``hadamard_triton(x, scale)``: ``x [..., n]`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), fp32 /
bf16 / fp16, ``n`` a power of two in ``[2, MAX_N]``, any leading shape (flattened into rows, a
non-contiguous input is copied to a contiguous one first). Returns ``x``'s dtype and shape.

Arithmetic, that of the PyTorch butterfly op by op: a program loads ``ROWS`` rows as ``[ROWS, n]``
in FP32 (exact widening) and for ``h = 1, 2, .., n / 2`` views each row as ``[n / 2h, 2, h]`` and
replaces every pair ``(a, b)`` by ``(a + b, a - b)``, each an FP32 add rounded to nearest even to
``x``'s dtype (torch computes a bf16 / fp16 add in FP32 and rounds once: the same bits; nothing
to round for fp32), then multiplies by ``scale`` as FP32 (torch casts a Python scalar to the FP32
op-math type for all three dtypes) and rounds to the dtype. Launched with ``enable_fp_fusion=False``
so that no multiply and add are contracted into an FMA (the fp32 backward's ``g * scale`` followed
by the first stage would be).

Backward (the autograd of the butterfly, derived and checked bit for bit in
``tests/test_hadamard_triton.py``): ``g * scale`` rounded to the dtype, then the stages in reverse
order (``h = n / 2, .., 1``), each pair ``(g0, g1) -> (g0 + g1, g0 - g1)`` rounded. Autograd adds
the gradients of the two halves ``y[..., 0, :]`` and ``y[..., 1, :]`` of every stage's input into
a zero-filled tensor, which turns a ``-0.0`` into ``+0.0``; the backward does the same
(``where(v == 0, +0.0, v)``) so signed zeros agree too. It is the same kernel with ``REVERSE``.

Under Triton's interpreter FP32 -> BF16 casts truncate, so there (``EMULATE_BF16``, set from
``TRITON_INTERPRET``) bf16 values are widened and rounded with integer bit operations (round to
nearest even; NaN stays NaN); on the GPU they are the hardware conversions (``cvt.rn``).
"""

from __future__ import annotations

import math
import os
import struct

import torch
import triton
import triton.language as tl

MAX_N = 1024
"""Largest last dimension the kernel takes (one program holds ``ROWS x n`` FP32 values)."""

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the kernel computes in."""

BLOCK_ELEMENTS = 4096
"""Values per program: ``ROWS = max(1, BLOCK_ELEMENTS // n)`` rows."""

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (read, as by triton, when this module is imported)."""


@triton.jit
def _widen(v, KIND: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Loaded values (dtype of ``KIND``) -> FP32, exactly."""
    if KIND == 1 and EMULATE_BF16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _narrow(v, KIND: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """FP32 -> the dtype of ``KIND``, rounded to nearest even."""
    if KIND == 0:
        return v
    elif KIND == 1:
        if EMULATE_BF16:
            u = v.to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where(v != v, (u >> 16) | 0x40, r)  # NaN: a quiet NaN of the same sign
            return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v.to(tl.bfloat16)
    else:
        return v.to(tl.float16)


@triton.jit
def _round(v, KIND: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """FP32 values rounded to the dtype of ``KIND``, as FP32."""
    if KIND == 0:
        return v
    return _widen(_narrow(v, KIND, EMULATE_BF16), KIND, EMULATE_BF16)


@triton.jit
def _stage(v, ROWS: tl.constexpr, N: tl.constexpr, H: tl.constexpr, KIND: tl.constexpr,
           EMULATE_BF16: tl.constexpr, POSITIVE_ZERO: tl.constexpr):
    """One butterfly stage of ``v [ROWS, N]`` (FP32): rows as ``[N / 2H, 2, H]``, pairs
    ``(a, b) -> (a + b, a - b)`` rounded to the dtype."""
    w = tl.permute(tl.reshape(v, (ROWS * N // (2 * H), 2, H)), (0, 2, 1))  # [.., H, 2]
    a, b = tl.split(w)
    s = _round(a + b, KIND, EMULATE_BF16)
    d = _round(a - b, KIND, EMULATE_BF16)
    if POSITIVE_ZERO:
        s = tl.where(s == 0.0, 0.0, s)
        d = tl.where(d == 0.0, 0.0, d)
    return tl.reshape(tl.permute(tl.join(s, d), (0, 2, 1)), (ROWS, N))


@triton.jit
def _hadamard_kernel(
    x_ptr, out_ptr, M, scale,
    N: tl.constexpr, LOG_N: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr,
    REVERSE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    v = _widen(tl.load(x_ptr + offs, mask=mask, other=0.0), KIND, EMULATE_BF16)
    if REVERSE:
        v = _round(v * scale, KIND, EMULATE_BF16)
        for i in tl.static_range(LOG_N):
            v = _stage(v, ROWS, N, (N // 2) >> i, KIND, EMULATE_BF16, True)
        out = _narrow(v, KIND, EMULATE_BF16)
    else:
        for i in tl.static_range(LOG_N):
            v = _stage(v, ROWS, N, 1 << i, KIND, EMULATE_BF16, False)
        out = _narrow(v * scale, KIND, EMULATE_BF16)
    tl.store(out_ptr + offs, out, mask=mask)


def _fp32(scale: float) -> float:
    """``scale`` rounded to FP32 (nearest even), as torch casts a Python scalar to the FP32 op-math
    type; the kernel's FP32 argument then holds it exactly."""
    try:
        return struct.unpack("f", struct.pack("f", scale))[0]
    except OverflowError:
        return math.copysign(math.inf, scale)


def fits(x: torch.Tensor, low: int, high: int) -> bool:
    """Whether a row kernel of this module's kind takes ``x [..., n]``: a CUDA tensor (CPU under
    ``TRITON_INTERPRET=1``) of a dtype in :data:`DTYPES` with ``n`` a power of two in ``[low, high]``."""
    n = x.shape[-1] if x.dim() else 0
    on_device = x.is_cuda or (_INTERPRETED and x.device.type == "cpu")
    return on_device and x.dtype in DTYPES and low <= n <= high and n & (n - 1) == 0


def as_rows(x: torch.Tensor, kernel: str, low: int, high: int) -> torch.Tensor:
    """``x [..., n]`` as contiguous rows ``[M, n]`` for ``kernel`` (copied only if not contiguous);
    a ValueError naming what ``kernel`` needs where ``x`` does not :func:`fits`."""
    if not fits(x, low, high):
        raise ValueError(
            f"{kernel} needs a CUDA tensor (CPU only under TRITON_INTERPRET=1) of dtype in "
            f"{[str(d) for d in DTYPES]} with a power-of-two last dim in [{low}, {high}]; got "
            f"{x.device.type} {x.dtype} {list(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`hadamard_triton` takes ``x`` (device, dtype, last dimension)."""
    return fits(x, 2, MAX_N)


def _launch(x: torch.Tensor, scale: float, reverse: bool) -> torch.Tensor:
    """The kernel over ``x [..., n]`` (forward stages, or with ``reverse`` the backward's)."""
    x2 = as_rows(x, "hadamard_triton", 2, MAX_N)
    n = x2.shape[1]
    out = torch.empty_like(x2)
    m = x2.shape[0]
    if m:
        rows = max(1, BLOCK_ELEMENTS // n)
        _hadamard_kernel[(triton.cdiv(m, rows),)](
            x2, out, m, _fp32(scale), N=n, LOG_N=n.bit_length() - 1, ROWS=rows, KIND=_KIND[x.dtype],
            REVERSE=reverse, EMULATE_BF16=_INTERPRETED,
            num_warps=4, enable_fp_fusion=False)
    return out.view(x.shape)


class _Hadamard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return _launch(x, scale, reverse=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        return _launch(grad, ctx.scale, reverse=True), None


def hadamard_triton(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """:func:`kpool_layers.precision.hadamard.hadamard_transform` ``(x, scale)`` in one kernel (and one for
    its gradient): the same bits (module docstring)."""
    return _Hadamard.apply(x, float(scale))
