"""The mHC gates, from the block's projection ``z`` to ``pre``, ``post`` and the mixing matrix, in one
Triton kernel forward and two backward.

:func:`gates` computes what :func:`kpool_layers.hyper_connections.mhc.torch_gates` computes with
torch ops (the affine maps, sigmoids, the row softmax and ``2 * iters - 1`` Sinkhorn normalisations:
about ``6 * iters + 12`` kernels forward and twice as many backward per block):

* ``z [..., W]`` FP32, ``W = (2 + N) N``, split as ``[pre | post | comb]`` columns (``N``, ``N``,
  ``N * N``); ``base [W]`` and ``scale [3]`` in any float dtype, used in FP32 (CUDA, or CPU under
  ``TRITON_INTERPRET=1``; ``1 <= N <= MAX_N``; any leading shape, a non-contiguous ``z`` is copied)::

      y     = z * scale[group] + base                     (group 0, 1, 2 for pre, post, comb)
      pre   = sigmoid(y_pre) + eps                        [..., N]
      post  = 2 sigmoid(y_post)                           [..., N]
      comb  = Sinkhorn(softmax(y_comb, rows) + eps)       [..., N, N]

  Sinkhorn: ``K = 2 * iters - 1`` normalisations, step ``t`` dividing every entry by the sum of its
  column (even ``t``) or of its row (odd ``t``) plus ``eps`` (IEEE division). All FP32.

Layout: a program holds ``BLOCK`` tokens: their mixing matrices as ``[BLOCK, NP, NP]`` FP32
registers and their gates as ``[BLOCK, NP]``, ``NP`` the power of two ``>= N``; padded entries are 0
and stay 0 (their rows and columns sum to 0 and ``0 / (0 + eps) = 0``). Sums over ``N`` entries are
Triton's tree reductions, so results differ from torch's in the last bits; the tests bound both
against a float64 reference.

Backward (no saved intermediates, only ``z``): for ``t = K - 1 .. 0`` the input ``x`` of step ``t``
is recomputed from ``c`` (``t`` steps, ``K^2 / 2`` in all: registers, no memory traffic), and the
gradient passes through ``x / (S + eps)`` as ``dx = (dx' - sum(dx' * x')) / (S + eps)`` (sums over
the step's axis; padded entries kept at 0), then through the softmax as ``dl = p * (dc - sum_row(dc
* p))``; the sigmoids' as ``dy = dg * (1 - s) * s`` (``2 dpost`` for ``post``). Then ``dz = dy *
scale[group]``, and per program the token sums of ``dy`` and ``dy * z`` per column (FP32 partial
sums, ``[programs, 2, W]``), which a second kernel adds in program order into ``d base`` and, summed
per group, ``d scale``, each rounded once to its parameter's dtype. Every token is one program's and
every sum has a fixed order: results are bit-identical run to run.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kpool_layers.kernels.mhc_mix_triton import _round

MAX_N = 8
"""Largest ``N`` the kernels take (a program holds ``BLOCK x NP x NP`` FP32 values)."""

BLOCK_ENTRIES = 1024
WARPS = 4
"""Forward programs: ``BLOCK = BLOCK_ENTRIES // NP^2`` tokens (64 of 4 x 4), ``WARPS`` warps."""
BACKWARD_BLOCK_ENTRIES = 128
BACKWARD_WARPS = 1
"""Backward programs, likewise. A token is computed by one program whatever the block, so these
four (the Sinkhorn kernels' fastest of ``scripts/bench/mhc_tune.py``'s sweep on an H100,
docs/results/mhc_tune_h100.json) change the speed and, through the backward's partial sums, the
order in which ``d base`` and ``d scale`` add tokens; never the result of a rerun."""

FINISH_WARPS = 4
"""Warps of the kernel that adds the backward's partial sums (one program)."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (read, as by triton, when this module is imported)."""

_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """``exp`` in FP32: libdevice's ``expf`` on CUDA (what torch's softmax and sigmoid run), numpy's in
    the interpreter."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _sigmoid(x, LIBDEVICE: tl.constexpr):
    """``1 / (1 + exp(-x))`` in FP32 (torch's order), IEEE division."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, LIBDEVICE))


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
def _tokens(M, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tokens ``[BLOCK]`` (int64) and their mask, and ``arange(NP)``."""
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return tok.to(tl.int64), tok < M, tl.arange(0, NP)


@triton.jit
def _gate_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, GROUP: tl.constexpr, N: tl.constexpr):
    """``z [BLOCK, NP]`` of gate ``GROUP`` (0: pre, 1: post), its mask, ``y = z * scale + base``
    (0 where masked) and the scale."""
    W: tl.constexpr = (2 + N) * N
    mask = live[:, None] & (n < N)[None, :]
    z = tl.load(z_ptr + tok[:, None] * W + GROUP * N + n[None, :], mask=mask, other=0.0)
    b = tl.load(base_ptr + GROUP * N + n, mask=n < N, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + GROUP).to(tl.float32)
    return z, mask, tl.where(mask, z * s + b[None, :], 0.0), s


@triton.jit
def _comb_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, N: tl.constexpr):
    """``z [BLOCK, NP, NP]`` of the mixing logits (row-major ``N x N`` after the gates), the valid
    entries, the mask, ``y = z * scale[2] + base`` and the scale."""
    W: tl.constexpr = (2 + N) * N
    entry = n[:, None] * N + n[None, :]  # [NP, NP]
    valid = ((n < N)[:, None] & (n < N)[None, :])[None, :, :]
    mask = live[:, None, None] & valid
    z = tl.load(z_ptr + tok[:, None, None] * W + 2 * N + entry[None, :, :], mask=mask, other=0.0)
    b = tl.load(base_ptr + 2 * N + entry, mask=(n < N)[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + 2).to(tl.float32)
    return z, valid, mask, z * s + b[None, :, :], s


@triton.jit
def _forward_kernel(z_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, M, eps, ITERS: tl.constexpr,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    tok, live, n = _tokens(M, N, NP, BLOCK)
    gate_offs = tok[:, None] * N + n[None, :]
    _, mask, y, _ = _gate_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, 0, N)
    tl.store(pre_ptr + gate_offs, _sigmoid(y, LIBDEVICE) + eps, mask=mask)
    _, mask, y, _ = _gate_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, 1, N)
    tl.store(post_ptr + gate_offs, 2.0 * _sigmoid(y, LIBDEVICE), mask=mask)
    _, valid, mask, logits, _ = _comb_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, N)
    _, c = _softmax_plus_eps(logits, mask, eps, LIBDEVICE)
    x = _steps(c, eps, 2 * ITERS - 1)
    tl.store(comb_ptr + tok[:, None, None] * (N * N) + (n[:, None] * N + n[None, :])[None, :, :], x, mask=mask)


@triton.jit
def _gate_backward(z_ptr, base_ptr, scale_ptr, g_ptr, dz_ptr, part_ptr, tok, live, n, TWICE: tl.constexpr,
                   GROUP: tl.constexpr, N: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``dz`` of gate ``GROUP`` and its columns' partial sums of ``dy`` and ``dy * z``."""
    W: tl.constexpr = (2 + N) * N
    z, mask, y, s = _gate_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, GROUP, N)
    sig = _sigmoid(y, LIBDEVICE)
    g = tl.load(g_ptr + tok[:, None] * N + n[None, :], mask=mask, other=0.0)
    if TWICE:
        g = 2.0 * g
    dy = tl.where(mask, g * (1.0 - sig) * sig, 0.0)
    tl.store(dz_ptr + tok[:, None] * W + GROUP * N + n[None, :], dy * s, mask=mask)
    part = part_ptr + tl.program_id(0).to(tl.int64) * (2 * W) + GROUP * N + n
    tl.store(part, tl.sum(dy, axis=0), mask=n < N)
    tl.store(part + W, tl.sum(dy * z, axis=0), mask=n < N)


@triton.jit
def _backward_kernel(z_ptr, base_ptr, scale_ptr, dpre_ptr, dpost_ptr, dcomb_ptr, dz_ptr, part_ptr, M, eps,
                     ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    W: tl.constexpr = (2 + N) * N
    tok, live, n = _tokens(M, N, NP, BLOCK)
    _gate_backward(z_ptr, base_ptr, scale_ptr, dpre_ptr, dz_ptr, part_ptr, tok, live, n, False, 0, N, LIBDEVICE)
    _gate_backward(z_ptr, base_ptr, scale_ptr, dpost_ptr, dz_ptr, part_ptr, tok, live, n, True, 1, N, LIBDEVICE)
    z, valid, mask, logits, s = _comb_inputs(z_ptr, base_ptr, scale_ptr, tok, live, n, N)
    p, c = _softmax_plus_eps(logits, mask, eps, LIBDEVICE)
    entry = (n[:, None] * N + n[None, :])[None, :, :]
    dy = tl.load(dcomb_ptr + tok[:, None, None] * (N * N) + entry, mask=mask, other=0.0)
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
    dl = tl.where(mask, p * (dy - tl.expand_dims(tl.sum(dy * p, axis=2), 2)), 0.0)
    tl.store(dz_ptr + tok[:, None, None] * W + 2 * N + entry, dl * s, mask=mask)
    part = part_ptr + tl.program_id(0).to(tl.int64) * (2 * W) + 2 * N + (n[:, None] * N + n[None, :])
    square = (n < N)[:, None] & (n < N)[None, :]
    tl.store(part, tl.sum(dl, axis=0), mask=square)
    tl.store(part + W, tl.sum(dl * z, axis=0), mask=square)


@triton.jit
def _finish_kernel(part_ptr, dbase_ptr, dscale_ptr, P, N: tl.constexpr, WP: tl.constexpr,
                   BASE_BF16: tl.constexpr, SCALE_BF16: tl.constexpr):
    """``d base[j] = R(sum_p part[p, 0, j])`` and ``d scale[g] = R(sum over group g's columns of
    sum_p part[p, 1, j])``, the programs added in order (one program)."""
    W: tl.constexpr = (2 + N) * N
    j = tl.arange(0, WP)
    acc_b = tl.zeros([WP], dtype=tl.float32)
    acc_s = tl.zeros([WP], dtype=tl.float32)
    for p in range(P):
        row = part_ptr + p * (2 * W) + j
        acc_b += tl.load(row, mask=j < W, other=0.0)
        acc_s += tl.load(row + W, mask=j < W, other=0.0)
    tl.store(dbase_ptr + j, _round(acc_b, BASE_BF16).to(dbase_ptr.dtype.element_ty), mask=j < W)
    group = tl.where(j < N, 0, tl.where(j < 2 * N, 1, 2))
    for g in tl.static_range(3):
        total = tl.sum(tl.where((group == g) & (j < W), acc_s, 0.0), axis=0)
        tl.store(dscale_ptr + g, _round(total, SCALE_BF16).to(dscale_ptr.dtype.element_ty))


def _on_device(*tensors: torch.Tensor) -> bool:
    return all(x.is_cuda for x in tensors) or (_INTERPRETED and all(x.device.type == "cpu" for x in tensors))


def supports(z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int) -> bool:
    """Whether :func:`gates` takes these tensors: FP32 ``z [..., (2 + n) n]``, ``base [(2 + n) n]`` and
    ``scale [3]`` in a float dtype, ``1 <= n <= MAX_N``, on a CUDA device (on the CPU only under
    ``TRITON_INTERPRET=1``)."""
    w = (2 + n) * n
    return (_on_device(z, base, scale) and 1 <= n <= MAX_N and z.dtype == torch.float32 and z.dim() >= 1
            and z.shape[-1] == w and tuple(base.shape) == (w,) and tuple(scale.shape) == (3,)
            and base.dtype in _PARAM_DTYPES and scale.dtype in _PARAM_DTYPES)


def _block(n: int, entries: int) -> int:
    return max(1, entries // triton.next_power_of_2(n) ** 2)


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lead, w = z.shape[:-1], z.shape[-1]
        m = math.prod(lead)
        flat, b, s = z.reshape(m, w).contiguous(), base.contiguous(), scale.contiguous()
        pre = torch.empty(m, n, dtype=torch.float32, device=z.device)
        post, comb = torch.empty_like(pre), torch.empty(m, n, n, dtype=torch.float32, device=z.device)
        if m:
            block = _block(n, BLOCK_ENTRIES)
            _forward_kernel[(triton.cdiv(m, block),)](
                flat, b, s, pre, post, comb, m, eps, ITERS=iters, N=n, NP=triton.next_power_of_2(n), BLOCK=block,
                LIBDEVICE=not _INTERPRETED, num_warps=WARPS)
        ctx.save_for_backward(flat, b, s)
        ctx.n, ctx.iters, ctx.eps, ctx.lead = n, iters, eps, lead
        return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dpre: torch.Tensor, dpost: torch.Tensor, dcomb: torch.Tensor):  # noqa: ANN205
        flat, b, s = ctx.saved_tensors
        (m, w), n = flat.shape, ctx.n
        dz = torch.empty_like(flat)
        dbase, dscale = torch.empty_like(b), torch.empty_like(s)
        block = _block(n, BACKWARD_BLOCK_ENTRIES)
        programs = triton.cdiv(m, block)
        part = torch.empty(programs, 2, w, dtype=torch.float32, device=flat.device)
        if m:
            _backward_kernel[(programs,)](
                flat, b, s, dpre.reshape(m, n).float().contiguous(), dpost.reshape(m, n).float().contiguous(),
                dcomb.reshape(m, n, n).float().contiguous(), dz, part, m, ctx.eps, ITERS=ctx.iters, N=n,
                NP=triton.next_power_of_2(n), BLOCK=block, LIBDEVICE=not _INTERPRETED, num_warps=BACKWARD_WARPS)
        _finish_kernel[(1,)](part, dbase, dscale, programs, N=n, WP=triton.next_power_of_2(w),
                             BASE_BF16=b.dtype == torch.bfloat16, SCALE_BF16=s.dtype == torch.bfloat16,
                             num_warps=FINISH_WARPS)
        return dz.view(*ctx.lead, w), dbase, dscale, None, None, None


def gates(z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [..., n], post [..., n], comb [..., n, n])`` FP32 from ``z [..., (2 + n) n]`` (module
    docstring), differentiable in ``z``, ``base`` and ``scale``; refused (``ValueError`` naming the
    tensors) for what :func:`supports` does not take."""
    if iters < 1:
        raise ValueError(f"iters={iters} is not allowed; allowed: >= 1")
    if not supports(z, base, scale, n):
        got = ", ".join(f"{name} {x.dtype} {list(x.shape)} on {x.device.type}"
                        for name, x in (("z", z), ("base", base), ("scale", scale)))
        raise ValueError(f"mhc_gates_triton needs FP32 z [..., (2 + N) N], base [(2 + N) N] and scale [3] with "
                         f"1 <= N <= {MAX_N} on a CUDA device (CPU only under TRITON_INTERPRET=1); got N={n}, {got}")
    return _Gates.apply(z, base, scale, int(n), int(iters), float(eps))
