"""The mHC block's input side in Triton kernels: the normalised projection of the streams (one kernel
forward, two backward) and the pre-weighted stream sum (one kernel each way).

:func:`norm_project` and :func:`pre_sum` compute what
:class:`kpool_layers.hyper_connections.mhc.HyperConnection` computes with torch ops (an FP32 copy of
the streams, four elementwise passes for the RMS norm, an FP32 matmul with ``W = (2 + N) N`` outputs,
an FP32 broadcast product and a sum; about twice as many passes backward), reading the streams once
per kernel and writing no FP32 copy of them:

* ``x [T, K]`` the streams flattened (``K = N h``), BF16 or FP32; ``fn [W, K]`` in any float dtype,
  used in FP32::

      norm_project:  r = rsqrt(sum_k x_k^2 / K + eps),  z = r (x @ fn^T)          z [T, W] FP32
      d x = r (dz @ fn) - x r^2 (sum_w dz_w z_w) / K     (rounded once to x's dtype)
      d fn = sum_t (r_t dz_t) x_t^T                      (rounded once to fn's dtype)

  transformers multiplies ``x`` by ``r`` before the matmul; ``r`` is a per-token scalar, so this
  is the same product in another order of FP32 roundings;
* ``pre [T, N]`` FP32, ``s [T, N, h]`` the streams::

      pre_sum:  out[c] = R(sum_n pre_n s_n[c])                                out [T, h] in s's dtype
      d s_n[c] = R(pre_n g[c]),  d pre_n = sum_c g[c] s_n[c]   (FP32)

  ``R``: rounding to the streams' dtype where the torch ops round.

Rounding to BF16 is done on the bits (:func:`kpool_layers.kernels.mhc_mix_triton._round`), so
Triton's interpreter rounds as a GPU does. Sums run in a fixed order (the ``K`` and channel sums
chunk after chunk inside one program, the token sum of ``d fn`` likewise in the one program that
owns its columns): results are bit-identical run to run. The products ``x @ fn^T``, ``dz @ fn`` and
``da^T @ x`` are ``tl.dot`` in IEEE FP32. Against the torch ops they agree within the bounds of
``tests/test_mhc_pre_triton.py``, not bit for bit.

Layouts: row-major ``[T, K]`` (= ``[T, N, h]``), ``[W, K]``, ``[T, W]``, ``[T, N]``, ``[T, h]`` (a
non-contiguous input is copied first).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.mhc_mix_triton import _round

MAX_N = 8
"""Largest stream count the kernels take."""

BLOCK_T = 16
BLOCK_K = 64
BLOCK_H = 128

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (read, as by triton, when this module is imported)."""

_DTYPES = (torch.bfloat16, torch.float32)
_FN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _norm_proj_forward(x_ptr, fn_ptr, z_ptr, rstd_ptr, T, K, W, eps,
                       WP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    w = tl.arange(0, WP)
    t64 = t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, WP], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + w[:, None] * K + k[None, :], mask=(w < W)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
        acc += tl.dot(x, tl.trans(f), input_precision="ieee")
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    tw = (t < T)[:, None] & (w < W)[None, :]
    tl.store(z_ptr + t64[:, None] * W + w[None, :], acc * rstd[:, None], mask=tw)
    tl.store(rstd_ptr + t64, rstd, mask=t < T)


@triton.jit
def _norm_proj_backward_x(x_ptr, fn_ptr, z_ptr, rstd_ptr, dz_ptr, dx_ptr, T, K, W,
                          BF16: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    w = tl.arange(0, WP)
    t64 = t.to(tl.int64)
    tw = (t < T)[:, None] & (w < W)[None, :]
    dz = tl.load(dz_ptr + t64[:, None] * W + w[None, :], mask=tw, other=0.0)
    z = tl.load(z_ptr + t64[:, None] * W + w[None, :], mask=tw, other=0.0)
    rstd = tl.load(rstd_ptr + t64, mask=t < T, other=0.0)
    da = dz * rstd[:, None]
    coef = rstd * rstd * tl.sum(dz * z, axis=1) / K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        tk = (t < T)[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=tk, other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + w[:, None] * K + k[None, :], mask=(w < W)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        dx = tl.dot(da, f, input_precision="ieee") - x * coef[:, None]
        tl.store(dx_ptr + t64[:, None] * K + k[None, :], _round(dx, BF16).to(dx_ptr.dtype.element_ty), mask=tk)


@triton.jit
def _norm_proj_backward_fn(x_ptr, rstd_ptr, dz_ptr, dfn_ptr, T, K, W,
                           BF16: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.arange(0, WP)
    acc = tl.zeros([WP, BLOCK_K], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t64 = t.to(tl.int64)
        dz = tl.load(dz_ptr + t64[:, None] * W + w[None, :], mask=(t < T)[:, None] & (w < W)[None, :], other=0.0)
        rstd = tl.load(rstd_ptr + t64, mask=t < T, other=0.0)
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(dz * rstd[:, None]), x, input_precision="ieee")
    tl.store(dfn_ptr + w[:, None] * K + k[None, :], _round(acc, BF16).to(dfn_ptr.dtype.element_ty),
             mask=(w < W)[:, None] & (k < K)[None, :])


@triton.jit
def _pre_sum_forward(pre_ptr, s_ptr, out_ptr, T, H, N: tl.constexpr, BF16: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t64 = t.to(tl.int64)
    tc = (t < T)[:, None] & (c < H)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for n in tl.static_range(N):
        p = tl.load(pre_ptr + t64 * N + n, mask=t < T, other=0.0)
        s = tl.load(s_ptr + (t64[:, None] * N + n) * H + c[None, :], mask=tc, other=0.0).to(tl.float32)
        acc += p[:, None] * s
    tl.store(out_ptr + t64[:, None] * H + c[None, :], _round(acc, BF16).to(out_ptr.dtype.element_ty), mask=tc)


@triton.jit
def _pre_sum_backward(pre_ptr, s_ptr, g_ptr, d_pre_ptr, d_s_ptr, T, H, N: tl.constexpr, NP: tl.constexpr,
                      BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tl.arange(0, NP)
    t64 = t.to(tl.int64)
    d_pre = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        tc = (t < T)[:, None] & (c < H)[None, :]
        g = tl.load(g_ptr + t64[:, None] * H + c[None, :], mask=tc, other=0.0).to(tl.float32)
        for n in tl.static_range(N):
            p = tl.load(pre_ptr + t64 * N + n, mask=t < T, other=0.0)
            rows = (t64[:, None] * N + n) * H + c[None, :]
            tl.store(d_s_ptr + rows, _round(p[:, None] * g, BF16).to(d_s_ptr.dtype.element_ty), mask=tc)
            s = tl.load(s_ptr + rows, mask=tc, other=0.0).to(tl.float32)
            d_pre += tl.where((m == n)[None, :], tl.sum(g * s, axis=1)[:, None], 0.0)
    tl.store(d_pre_ptr + t64[:, None] * N + m[None, :], d_pre, mask=(t < T)[:, None] & (m < N)[None, :])


def _on_device(*tensors: torch.Tensor) -> bool:
    return all(x.is_cuda for x in tensors) or (_INTERPRETED and all(x.device.type == "cpu" for x in tensors))


def supports_norm_project(streams: torch.Tensor, fn: torch.Tensor) -> bool:
    """Whether :func:`norm_project` takes these tensors: CUDA (CPU only under ``TRITON_INTERPRET=1``),
    BF16 or FP32 ``streams [..., N, h]`` with ``1 <= N <= MAX_N``, ``fn [(2 + N) N, N h]`` in a float
    dtype."""
    if not _on_device(streams, fn) or streams.dim() < 2 or fn.dim() != 2:
        return False
    n, h = streams.shape[-2:]
    return (streams.dtype in _DTYPES and fn.dtype in _FN_DTYPES and 1 <= n <= MAX_N
            and tuple(fn.shape) == ((2 + n) * n, n * h))


def supports_pre_sum(pre: torch.Tensor, streams: torch.Tensor) -> bool:
    """Whether :func:`pre_sum` takes these tensors: CUDA (CPU only under ``TRITON_INTERPRET=1``), FP32
    ``pre [..., N]``, BF16 or FP32 ``streams [..., N, h]`` with ``1 <= N <= MAX_N``."""
    if not _on_device(pre, streams) or streams.dim() < 2:
        return False
    n = streams.shape[-2]
    return (pre.dtype == torch.float32 and streams.dtype in _DTYPES and 1 <= n <= MAX_N
            and pre.shape == streams.shape[:-1])


def _refuse(what: str, **tensors: torch.Tensor) -> None:
    got = ", ".join(f"{name} {x.dtype} {list(x.shape)} on {x.device.type}" for name, x in tensors.items())
    raise ValueError(f"mhc_pre_triton.{what} needs BF16 or FP32 streams [..., N, h] with 1 <= N <= {MAX_N}, "
                     f"matching shapes, on a CUDA device (CPU only under TRITON_INTERPRET=1); got {got}")


def _wp(w: int) -> int:
    """The padded projection width: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(w))


class _NormProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
        n, h = streams.shape[-2:]
        t, k, w = math.prod(streams.shape[:-2]), n * h, fn.shape[0]
        x, f = streams.reshape(t, k).contiguous(), fn.contiguous()
        z = torch.empty(t, w, dtype=torch.float32, device=streams.device)
        rstd = torch.empty(t, dtype=torch.float32, device=streams.device)
        if t:
            _norm_proj_forward[(triton.cdiv(t, BLOCK_T),)](x, f, z, rstd, t, k, w, eps, WP=_wp(w),
                                                          BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, num_warps=4)
        ctx.save_for_backward(x, f, z, rstd)
        ctx.streams_shape = streams.shape
        return z.view(*streams.shape[:-2], w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz: torch.Tensor):  # noqa: ANN205
        x, f, z, rstd = ctx.saved_tensors
        (t, k), w = x.shape, f.shape[0]
        dz = dz.reshape(t, w).float().contiguous()
        dx, dfn = torch.empty_like(x), torch.empty_like(f)
        meta = {"WP": _wp(w), "BLOCK_T": BLOCK_T, "BLOCK_K": BLOCK_K}
        if t:
            _norm_proj_backward_x[(triton.cdiv(t, BLOCK_T),)](x, f, z, rstd, dz, dx, t, k, w,
                                                              BF16=x.dtype == torch.bfloat16, **meta, num_warps=4)
        if k:
            _norm_proj_backward_fn[(triton.cdiv(k, BLOCK_K),)](x, rstd, dz, dfn, t, k, w,
                                                               BF16=f.dtype == torch.bfloat16, **meta, num_warps=4)
        return dx.view(ctx.streams_shape), dfn, None


class _PreSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        n, h = streams.shape[-2:]
        t = math.prod(streams.shape[:-2])
        p, s = pre.reshape(t, n).contiguous(), streams.reshape(t, n, h).contiguous()
        out = torch.empty(t, h, dtype=streams.dtype, device=streams.device)
        if t and h:
            _pre_sum_forward[(triton.cdiv(t, BLOCK_T), triton.cdiv(h, BLOCK_H))](
                p, s, out, t, h, N=n, BF16=s.dtype == torch.bfloat16, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=4)
        ctx.save_for_backward(p, s)
        ctx.shapes = (pre.shape, streams.shape)
        return out.view(*streams.shape[:-2], h)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        p, s = ctx.saved_tensors
        t, n, h = s.shape
        d_pre, d_s = torch.empty_like(p), torch.empty_like(s)
        if t and h:
            _pre_sum_backward[(triton.cdiv(t, BLOCK_T),)](
                p, s, grad.reshape(t, h).to(s.dtype).contiguous(), d_pre, d_s, t, h, N=n,
                NP=triton.next_power_of_2(n), BF16=s.dtype == torch.bfloat16, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H,
                num_warps=4)
        else:  # no tokens or no channels: the channel sums are empty
            d_pre.zero_()
        pre_shape, streams_shape = ctx.shapes
        return d_pre.view(pre_shape), d_s.view(streams_shape)


def norm_project(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``z [..., W]`` FP32 = ``rsqrt(mean(x^2) + eps) (x @ fn^T)`` with ``x`` the streams
    ``[..., N, h]`` flattened to ``N h`` (module docstring), differentiable in ``streams`` and ``fn``;
    refused (``ValueError`` naming the tensors) for what :func:`supports_norm_project` does not take."""
    if not supports_norm_project(streams, fn):
        _refuse("norm_project", streams=streams, fn=fn)
    return _NormProject.apply(streams, fn, eps)


def pre_sum(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_n pre_n streams_n`` -> ``[..., h]`` in the streams' dtype (module docstring),
    differentiable in both; refused (``ValueError`` naming the tensors) for what
    :func:`supports_pre_sum` does not take."""
    if not supports_pre_sum(pre, streams):
        _refuse("pre_sum", pre=pre, streams=streams)
    return _PreSum.apply(pre, streams)
