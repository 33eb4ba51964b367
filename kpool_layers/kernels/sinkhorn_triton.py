"""The mHC mixing matrix (row softmax, then Sinkhorn) in one Triton kernel forward and one backward.

:func:`mixing_matrix` computes what :func:`kpool_layers.hyper_connections.mhc.torch_mixing_matrix`
computes with ``6 * iters`` torch ops forward and about twice as many backward:

* ``logits [..., N, N]`` FP32 (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``1 <= N <= MAX_N``,
  any leading shape (flattened into matrices; a non-contiguous input is copied first);
* ``c = softmax(logits, rows) + eps`` (``exp(l - row max) / row sum``);
* ``K = 2 * iters - 1`` normalisations of ``c``: step ``t`` divides every entry by the sum of its
  column (even ``t``) or of its row (odd ``t``) plus ``eps`` (IEEE division). Returns the
  ``[..., N, N]`` FP32 result.

Layout: a program holds ``BLOCK`` matrices as ``[BLOCK, NP, NP]`` FP32 registers, ``NP`` the
power of two ``>= N``; padded entries are 0 and stay 0 (their rows and columns sum to 0 and
``0 / (0 + eps) = 0``). Sums over 4 entries are Triton's tree reductions, so the result differs from
torch's in the last bits; the tests bound both against a float64 reference.

Backward (no saved intermediates, only the logits): for ``t = K - 1 .. 0`` the input ``x`` of step
``t`` is recomputed from ``c`` (``t`` steps, ``K^2 / 2`` in all: registers, no memory traffic), and
the gradient passes through ``y = x / (S + eps)`` as ``dx = (dy - sum(dy * y)) / (S + eps)`` (sums
over the step's axis; padded entries kept at 0), then through the softmax as ``dl = p * (dc - sum_row(dc * p))``. Every
matrix is computed by one program in a fixed order: results are bit-identical run to run.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_N = 8
"""Largest ``N`` the kernel takes (a program holds ``BLOCK x NP x NP`` FP32 values)."""

BLOCK_ENTRIES = 1024
WARPS = 4
"""Forward programs: ``BLOCK = BLOCK_ENTRIES // NP^2`` matrices (64 of 4 x 4), ``WARPS`` warps."""
BACKWARD_BLOCK_ENTRIES = 128
BACKWARD_WARPS = 1
"""Backward programs, likewise. A matrix is computed by one program whatever the block, so these
four (the fastest of ``scripts/bench/mhc_tune.py``'s sweep on an H100,
docs/results/mhc_tune_h100.json; the forward's within 3% of each other) change the speed, never the
result."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (read, as by triton, when this module is imported)."""


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """``exp`` in FP32: libdevice's ``expf`` on CUDA (what torch's softmax runs), numpy's in the
    interpreter."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _divisor(x, eps, AXIS: tl.constexpr):
    """The sums of ``x [BLOCK, NP, NP]`` over ``AXIS`` (1: columns, 2: rows) plus ``eps``, kept
    as a size-1 axis."""
    return tl.expand_dims(tl.sum(x, axis=AXIS), AXIS) + eps


@triton.jit
def _normalise(x, eps, AXIS: tl.constexpr):
    """``x`` divided by :func:`_divisor` (IEEE division)."""
    return tl.math.div_rn(x, _divisor(x, eps, AXIS))


@triton.jit
def _softmax_plus_eps(logits, valid, eps, LIBDEVICE: tl.constexpr):
    """Row softmax of ``logits [BLOCK, NP, NP]`` over its valid entries, ``p`` and ``p + eps``
    (0 at padded entries)."""
    l = tl.where(valid, logits, float("-inf"))
    m = tl.max(l, axis=2)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padded row: every entry masked
    e = tl.where(valid, _exp(l - tl.expand_dims(m, 2), LIBDEVICE), 0.0)
    s = tl.sum(e, axis=2)
    p = tl.math.div_rn(e, tl.expand_dims(tl.where(s == 0.0, 1.0, s), 2))
    return p, tl.where(valid, p + eps, 0.0)


@triton.jit
def _steps(c, eps, count):
    """``count`` normalisations of ``c`` from step 0 (column, row, column, ...)."""
    x = c
    if count > 0:
        x = _normalise(x, eps, 1)
        for _ in range((count - 1) // 2):
            x = _normalise(x, eps, 2)
            x = _normalise(x, eps, 1)
        if (count - 1) % 2 == 1:
            x = _normalise(x, eps, 2)
    return x


@triton.jit
def _offsets(M, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets ``[BLOCK, NP, NP]`` into ``[M, N, N]`` of this program's matrices, and their mask."""
    mats = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.arange(0, NP)
    cols = tl.arange(0, NP)
    offs = (mats.to(tl.int64)[:, None, None] * (N * N) + rows[None, :, None] * N + cols[None, None, :])
    valid = (rows < N)[None, :, None] & (cols < N)[None, None, :]
    mask = (mats < M)[:, None, None] & valid
    return offs, valid, mask


@triton.jit
def _forward_kernel(logits_ptr, out_ptr, M, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    offs, valid, mask = _offsets(M, N, NP, BLOCK)
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0)
    _, c = _softmax_plus_eps(logits, valid & mask, eps, LIBDEVICE)
    x = _steps(c, eps, 2 * ITERS - 1)
    tl.store(out_ptr + offs, x, mask=mask)


@triton.jit
def _backward_kernel(logits_ptr, grad_ptr, out_ptr, M, eps, ITERS: tl.constexpr, N: tl.constexpr,
                     NP: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    offs, valid, mask = _offsets(M, N, NP, BLOCK)
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0)
    p, c = _softmax_plus_eps(logits, valid & mask, eps, LIBDEVICE)
    dy = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    for i in range(2 * ITERS - 1):
        t = 2 * ITERS - 2 - i
        x = _steps(c, eps, t)
        if t % 2 == 0:  # columns: divisors [BLOCK, 1, NP]
            d_col = _divisor(x, eps, 1)
            y_col = tl.math.div_rn(x, d_col)
            dy = tl.math.div_rn(dy - tl.expand_dims(tl.sum(dy * y_col, axis=1), 1), d_col)
        else:  # rows: divisors [BLOCK, NP, 1]
            d_row = _divisor(x, eps, 2)
            y_row = tl.math.div_rn(x, d_row)
            dy = tl.math.div_rn(dy - tl.expand_dims(tl.sum(dy * y_row, axis=2), 2), d_row)
        dy = tl.where(valid, dy, 0.0)  # padded entries: no gradient (the sums' term would reach them)
    dl = p * (dy - tl.expand_dims(tl.sum(dy * p, axis=2), 2))
    tl.store(out_ptr + offs, dl, mask=mask)


def supports(logits: torch.Tensor) -> bool:
    """Whether :func:`mixing_matrix` takes ``logits``: FP32 ``[..., N, N]`` with ``1 <= N <=
    MAX_N``, on a CUDA device (on the CPU only under ``TRITON_INTERPRET=1``)."""
    on_device = logits.is_cuda or (_INTERPRETED and logits.device.type == "cpu")
    return (on_device and logits.dtype == torch.float32 and logits.dim() >= 2
            and logits.shape[-1] == logits.shape[-2] and 1 <= logits.shape[-1] <= MAX_N)


def _launch(kernel: triton.JITFunction, logits: torch.Tensor, iters: int, eps: float,
            grad: torch.Tensor | None = None) -> torch.Tensor:
    """``kernel`` over the matrices of ``logits [..., N, N]`` (and ``grad``, same shape)."""
    if not supports(logits):
        raise ValueError(f"sinkhorn_triton needs FP32 [..., N, N] logits with 1 <= N <= {MAX_N} on a CUDA "
                         f"device (CPU only under TRITON_INTERPRET=1); got {logits.device.type} {logits.dtype} "
                         f"{list(logits.shape)}")
    n = logits.shape[-1]
    np_ = triton.next_power_of_2(n)
    entries, warps = (BLOCK_ENTRIES, WARPS) if grad is None else (BACKWARD_BLOCK_ENTRIES, BACKWARD_WARPS)
    block = max(1, entries // (np_ * np_))
    flat = logits.reshape(-1, n, n).contiguous()
    out = torch.empty_like(flat)
    m = flat.shape[0]
    if m:
        extra = () if grad is None else (grad.reshape(-1, n, n).contiguous(),)
        kernel[(triton.cdiv(m, block),)](flat, *extra, out, m, float(eps), ITERS=iters, N=n, NP=np_, BLOCK=block,
                                         LIBDEVICE=not _INTERPRETED, num_warps=warps)
    return out.view(logits.shape)


class _MixingMatrix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        return _launch(_forward_kernel, logits, iters, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        (logits,) = ctx.saved_tensors
        return _launch(_backward_kernel, logits, ctx.iters, ctx.eps, grad), None, None


def mixing_matrix(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn (``iters`` iterations, ``eps``) of ``softmax(logits, rows) + eps`` for FP32
    ``logits [..., N, N]``, differentiable (module docstring)."""
    if iters < 1:
        raise ValueError(f"iters={iters} is not allowed; allowed: >= 1")
    return _MixingMatrix.apply(logits, int(iters), float(eps))
