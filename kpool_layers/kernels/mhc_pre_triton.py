"""The mHC block's input side in Triton kernels: the normalised projection of the streams (a split
sum and its finish forward, two kernels and a finish backward) and the pre-weighted stream sum (one
kernel each way).

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
Triton's interpreter rounds as a GPU does. Sums run in a fixed order: the ``K`` sums of ``z`` in
chunks of ``TILES["proj_forward"].chunk`` columns, one program per chunk (tile after tile inside
it), whose FP32 partial sums a second kernel adds in chunk order; the token sum of ``d fn`` the
same way in chunks of tokens; the channel sums tile after tile inside one program. Results are
bit-identical run to run (they depend on the shapes and :data:`TILES`, not on the GPU). The products ``x @ fn^T``, ``dz @ fn`` and
``da^T @ x`` are ``tl.dot`` in IEEE FP32. Against the torch ops they agree within the bounds of
``tests/test_mhc_pre_triton.py``, not bit for bit.

Layouts: row-major ``[T, K]`` (= ``[T, N, h]``), ``[W, K]``, ``[T, W]``, ``[T, N]``, ``[T, h]`` (a
non-contiguous input is copied first).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.mhc_mix_triton import _round

MAX_N = 8
"""Largest stream count the kernels take."""

BLOCK_T = 16
BLOCK_H = 128
"""Tokens and channels per program of the pre-weighted sum."""


@dataclass(frozen=True)
class Tiles:
    """How one norm-projection kernel is launched: ``block_t`` tokens by ``block_k`` columns of
    ``K`` per tile, ``chunk`` the columns (forward) or tokens (``d fn``) one program sums over
    before it writes a partial sum (rounded up to whole tiles; ``0``: all of them, no partial
    sums), and ``warps`` per program. The chunking fixes the order of every sum, so results depend
    on the shapes and these tiles, never on the GPU or on timing."""

    block_t: int
    block_k: int
    chunk: int
    warps: int


TILES = {"proj_forward": Tiles(block_t=64, block_k=128, chunk=2048, warps=8),
         "proj_backward_x": Tiles(block_t=16, block_k=256, chunk=0, warps=4),
         "proj_backward_fn": Tiles(block_t=16, block_k=128, chunk=512, warps=4)}
"""The launches of the three norm-projection kernels: the fastest of ``scripts/bench/mhc_tune.py``'s
sweep on an H100 at 4,096 tokens of 4 streams of 4,096 and 2,048 (docs/results/mhc_tune_h100.json)."""

FINISH_BLOCK = 1024
"""Elements per program of the kernels that add partial sums."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (read, as by triton, when this module is imported)."""

_DTYPES = (torch.bfloat16, torch.float32)
_FN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _norm_proj_forward(x_ptr, fn_ptr, z_ptr, rstd_ptr, part_ptr, sq_ptr, T, K, W, CHUNK, eps, ONE: tl.constexpr,
                       WP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(i, s)``: tokens ``i BLOCK_T ..`` over the ``s``-th ``CHUNK`` of ``K``. One chunk
    (``ONE``): ``z`` and ``rstd``; else the chunk's partial products ``part [S, T, W]`` and sums
    of squares ``sq [S, T]``, which :func:`_norm_proj_finish` adds."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.program_id(1)
    w = tl.arange(0, WP)
    t64 = t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, WP], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_lo = s * CHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + w[:, None] * K + k[None, :], mask=(w < W)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
        acc += tl.dot(x, tl.trans(f), input_precision="ieee")
    tw = (t < T)[:, None] & (w < W)[None, :]
    if ONE:
        rstd = 1.0 / tl.sqrt(squares / K + eps)
        tl.store(z_ptr + t64[:, None] * W + w[None, :], acc * rstd[:, None], mask=tw)
        tl.store(rstd_ptr + t64, rstd, mask=t < T)
    else:
        row = s.to(tl.int64) * T + t64
        tl.store(part_ptr + row[:, None] * W + w[None, :], acc, mask=tw)
        tl.store(sq_ptr + row, squares, mask=t < T)


@triton.jit
def _norm_proj_finish(part_ptr, sq_ptr, z_ptr, rstd_ptr, T, K, W, S, eps,
                      WP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``z`` and ``rstd`` from the ``S`` chunks' partial sums, added in chunk order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    w = tl.arange(0, WP)
    t64 = t.to(tl.int64)
    tw = (t < T)[:, None] & (w < W)[None, :]
    acc = tl.zeros([BLOCK_T, WP], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s in range(S):
        row = s * T + t64
        acc += tl.load(part_ptr + row[:, None] * W + w[None, :], mask=tw, other=0.0)
        squares += tl.load(sq_ptr + row, mask=t < T, other=0.0)
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    tl.store(z_ptr + t64[:, None] * W + w[None, :], acc * rstd[:, None], mask=tw)
    tl.store(rstd_ptr + t64, rstd, mask=t < T)


@triton.jit
def _norm_proj_backward_x(x_ptr, fn_ptr, z_ptr, rstd_ptr, dz_ptr, dx_ptr, T, K, W,
                          BF16: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(i, j)``: ``d x`` of tokens ``i BLOCK_T ..`` and columns ``j BLOCK_K ..``."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.arange(0, WP)
    t64 = t.to(tl.int64)
    tw = (t < T)[:, None] & (w < W)[None, :]
    dz = tl.load(dz_ptr + t64[:, None] * W + w[None, :], mask=tw, other=0.0)
    z = tl.load(z_ptr + t64[:, None] * W + w[None, :], mask=tw, other=0.0)
    rstd = tl.load(rstd_ptr + t64, mask=t < T, other=0.0)
    da = dz * rstd[:, None]
    coef = rstd * rstd * tl.sum(dz * z, axis=1) / K
    tk = (t < T)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=tk, other=0.0).to(tl.float32)
    f = tl.load(fn_ptr + w[:, None] * K + k[None, :], mask=(w < W)[:, None] & (k < K)[None, :],
                other=0.0).to(tl.float32)
    dx = tl.dot(da, f, input_precision="ieee") - x * coef[:, None]
    tl.store(dx_ptr + t64[:, None] * K + k[None, :], _round(dx, BF16).to(dx_ptr.dtype.element_ty), mask=tk)


@triton.jit
def _norm_proj_backward_fn(x_ptr, rstd_ptr, dz_ptr, dfn_ptr, part_ptr, T, K, W, CHUNK, ONE: tl.constexpr,
                           BF16: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(j, s)``: columns ``j BLOCK_K ..`` of ``d fn`` summed over the ``s``-th ``CHUNK`` of
    tokens. One chunk (``ONE``): ``d fn``; else the partial sums ``part [S, W, K]``, which
    :func:`_sum_parts` adds."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    s = tl.program_id(1)
    w = tl.arange(0, WP)
    acc = tl.zeros([WP, BLOCK_K], dtype=tl.float32)
    t_lo = s * CHUNK
    for t0 in range(t_lo, tl.minimum(t_lo + CHUNK, T), BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t64 = t.to(tl.int64)
        dz = tl.load(dz_ptr + t64[:, None] * W + w[None, :], mask=(t < T)[:, None] & (w < W)[None, :], other=0.0)
        rstd = tl.load(rstd_ptr + t64, mask=t < T, other=0.0)
        x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(dz * rstd[:, None]), x, input_precision="ieee")
    wk = (w < W)[:, None] & (k < K)[None, :]
    if ONE:
        tl.store(dfn_ptr + w[:, None] * K + k[None, :], _round(acc, BF16).to(dfn_ptr.dtype.element_ty), mask=wk)
    else:
        tl.store(part_ptr + (s.to(tl.int64) * W + w[:, None]) * K + k[None, :], acc, mask=wk)


@triton.jit
def _sum_parts(part_ptr, out_ptr, S, M, BF16: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = R(sum_s part[s, i])`` over ``part [S, M]`` FP32, added in ``s`` order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + s * M + i.to(tl.int64), mask=i < M, other=0.0)
    tl.store(out_ptr + i, _round(acc, BF16).to(out_ptr.dtype.element_ty), mask=i < M)


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


def _chunks(total: int, tiles: Tiles, block: int) -> tuple[int, int]:
    """``(chunk, count)``: ``tiles.chunk`` rounded up to whole ``block``s (all of ``total`` when 0),
    and how many chunks cover ``total`` (at least 1)."""
    if tiles.chunk <= 0 or tiles.chunk >= total:
        return max(total, 1), 1
    chunk = triton.cdiv(tiles.chunk, block) * block
    return chunk, triton.cdiv(total, chunk)


class _NormProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
        n, h = streams.shape[-2:]
        t, k, w = math.prod(streams.shape[:-2]), n * h, fn.shape[0]
        x, f = streams.reshape(t, k).contiguous(), fn.contiguous()
        z = torch.empty(t, w, dtype=torch.float32, device=streams.device)
        rstd = torch.empty(t, dtype=torch.float32, device=streams.device)
        if t:
            tiles = TILES["proj_forward"]
            chunk, count = _chunks(k, tiles, tiles.block_k)
            part, sq = z, rstd  # one chunk: the kernel writes z and rstd, no partial sums
            if count > 1:
                part = torch.empty(count, t, w, dtype=torch.float32, device=streams.device)
                sq = torch.empty(count, t, dtype=torch.float32, device=streams.device)
            _norm_proj_forward[(triton.cdiv(t, tiles.block_t), count)](
                x, f, z, rstd, part, sq, t, k, w, chunk, eps, ONE=count == 1, WP=_wp(w), BLOCK_T=tiles.block_t,
                BLOCK_K=tiles.block_k, num_warps=tiles.warps)
            if count > 1:
                _norm_proj_finish[(triton.cdiv(t, BLOCK_T),)](part, sq, z, rstd, t, k, w, count, eps, WP=_wp(w),
                                                             BLOCK_T=BLOCK_T, num_warps=4)
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
        if t and k:
            tiles = TILES["proj_backward_x"]
            _norm_proj_backward_x[(triton.cdiv(t, tiles.block_t), triton.cdiv(k, tiles.block_k))](
                x, f, z, rstd, dz, dx, t, k, w, BF16=x.dtype == torch.bfloat16, WP=_wp(w), BLOCK_T=tiles.block_t,
                BLOCK_K=tiles.block_k, num_warps=tiles.warps)
        if k:
            tiles = TILES["proj_backward_fn"]
            chunk, count = _chunks(t, tiles, tiles.block_t)
            part = torch.empty(count, w, k, dtype=torch.float32, device=x.device) if count > 1 else dz
            bf16 = f.dtype == torch.bfloat16
            _norm_proj_backward_fn[(triton.cdiv(k, tiles.block_k), count)](
                x, rstd, dz, dfn, part, t, k, w, chunk, ONE=count == 1, BF16=bf16, WP=_wp(w),
                BLOCK_T=tiles.block_t, BLOCK_K=tiles.block_k, num_warps=tiles.warps)
            if count > 1:
                _sum_parts[(triton.cdiv(w * k, FINISH_BLOCK),)](part, dfn, count, w * k, BF16=bf16,
                                                                BLOCK=FINISH_BLOCK, num_warps=4)
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
