"""The mHC stream mixing after a block, ``post (x) block_output + comb^T @ streams``, in one Triton
kernel forward and one backward.

:func:`mix_streams` computes what :func:`kpool_layers.hyper_connections.mhc.torch_mix_streams`
computes with a broadcast multiply, a batched matmul with ``K = N`` (cuBLAS runs it in small-tile
kernels: 0.63 ms a call at 4,096 tokens of ``N = 4`` streams of 2,048 on an H200) and an add:

* ``post [..., N]`` and ``comb [..., N, N]`` FP32, ``block_output [..., h]`` and ``streams
  [..., N, h]`` in one dtype ``d``, BF16 or FP32 (CUDA, or CPU under ``TRITON_INTERPRET=1``),
  the leading dims equal and flattened into ``T`` tokens, ``1 <= N <= MAX_N``;
* forward, per token, output stream ``m`` and channel ``c``, with ``p = R(post)`` and ``C = R(comb)``
  (``R``: round to ``d``, as the torch path's ``.to(d)``)::

      out[m, c] = R( R(p[m] * bo[c]) + R(sum_n C[n, m] * s[n, c]) )

  products and sums in FP32, rounded where the torch ops round (the product, the matmul's result,
  their sum);
* backward, from ``g = d out [..., N, h]`` in ``d``::

      d bo[c]   = R(sum_m R(p[m] * g[m, c]))        d post[m] = R(sum_c R(g[m, c] * bo[c]))
      d s[n, c] = R(sum_m C[n, m] * g[m, c])        d comb[n, m] = R(sum_c g[m, c] * s[n, c])

  ``d post`` and ``d comb`` returned in FP32 (the values of ``d``, as the torch path's cast).

Rounding to BF16 is done on the bits (round to nearest, ties to even), so Triton's interpreter,
whose conversion truncates, rounds as the GPU does; the CPU tests then differ from a GPU only in
the order of the FP32 sums (and the GPU's fused multiply-adds). Sums over ``n``/``m`` run in
ascending order; sums over the channels run per ``BLOCK_H`` chunk (a tree), chunk after chunk,
each token's in one program: results are bit-identical run to run. The torch ops sum in another
order, so the two agree within the bounds of ``tests/test_mhc_mix_triton.py``, not bit for bit.

Layouts: row-major ``[T, N]``, ``[T, N, N]``, ``[T, h]``, ``[T, N, h]`` (a non-contiguous input is
copied first). Forward programs own ``BLOCK_T`` tokens x ``BLOCK_H`` channels; backward programs
own ``BACKWARD_BLOCK_T`` tokens and walk all channels, so the channel sums need no second pass.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

MAX_N = 8
"""Largest stream count the kernels take (a program holds ``BLOCK_T x NP x BLOCK_H`` FP32)."""

BLOCK_T = 8
BLOCK_H = 128
WARPS = 4
"""Forward programs: ``BLOCK_T`` tokens x ``BLOCK_H`` channels, ``WARPS`` warps."""
BACKWARD_BLOCK_T = 2
BACKWARD_BLOCK_H = 256
BACKWARD_WARPS = 2
"""Backward programs: ``BACKWARD_BLOCK_T`` tokens, all channels in ``BACKWARD_BLOCK_H`` chunks (the
order of the channel sums), ``BACKWARD_WARPS`` warps. All six: the fastest of
``scripts/bench/mhc_tune.py``'s sweep on an H100 (docs/results/mhc_tune_h100.json; the forward's
shapes all within 2% of each other)."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels (read, as by triton, when this module is imported)."""

_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _round(x, BF16: tl.constexpr):
    """FP32 ``x`` rounded to BF16 (nearest, ties to even) and back to FP32, on the bits; FP32
    unchanged. Finite values only (the operands of a training step)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _forward_kernel(post_ptr, comb_ptr, bo_ptr, s_ptr, out_ptr, T, H,
                    N: tl.constexpr, NP: tl.constexpr, BF16: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = tl.arange(0, NP)
    t64 = t.to(tl.int64)
    tm = (t < T)[:, None] & (m < N)[None, :]
    tc = (t < T)[:, None] & (c < H)[None, :]
    p = _round(tl.load(post_ptr + t64[:, None] * N + m[None, :], mask=tm, other=0.0), BF16)
    bo = tl.load(bo_ptr + t64[:, None] * H + c[None, :], mask=tc, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_T, NP, BLOCK_H], dtype=tl.float32)
    for n in tl.static_range(N):
        comb_n = _round(tl.load(comb_ptr + t64[:, None] * (N * N) + n * N + m[None, :], mask=tm, other=0.0), BF16)
        s_n = tl.load(s_ptr + (t64[:, None] * N + n) * H + c[None, :], mask=tc, other=0.0).to(tl.float32)
        acc += comb_n[:, :, None] * s_n[:, None, :]
    out = _round(_round(p[:, :, None] * bo[:, None, :], BF16) + _round(acc, BF16), BF16)
    rows = (t64[:, None] * N + m[None, :])[:, :, None] * H + c[None, None, :]
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=tm[:, :, None] & (c < H)[None, None, :])


@triton.jit
def _backward_kernel(post_ptr, comb_ptr, bo_ptr, s_ptr, g_ptr, d_post_ptr, d_comb_ptr, d_bo_ptr, d_s_ptr, T, H,
                     N: tl.constexpr, NP: tl.constexpr, BF16: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tl.arange(0, NP)
    t64 = t.to(tl.int64)
    tm = (t < T)[:, None] & (m < N)[None, :]
    p = _round(tl.load(post_ptr + t64[:, None] * N + m[None, :], mask=tm, other=0.0), BF16)
    d_post = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    d_comb = tl.zeros([BLOCK_T, NP, NP], dtype=tl.float32)  # [token, n, m]
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        tc = (t < T)[:, None] & (c < H)[None, :]
        g_rows = (t64[:, None] * N + m[None, :])[:, :, None] * H + c[None, None, :]
        g = tl.load(g_ptr + g_rows, mask=tm[:, :, None] & (c < H)[None, None, :], other=0.0).to(tl.float32)
        bo = tl.load(bo_ptr + t64[:, None] * H + c[None, :], mask=tc, other=0.0).to(tl.float32)
        d_bo = _round(tl.sum(_round(p[:, :, None] * g, BF16), axis=1), BF16)
        tl.store(d_bo_ptr + t64[:, None] * H + c[None, :], d_bo.to(d_bo_ptr.dtype.element_ty), mask=tc)
        d_post += tl.sum(_round(g * bo[:, None, :], BF16), axis=2)
        for n in tl.static_range(N):
            comb_n = _round(tl.load(comb_ptr + t64[:, None] * (N * N) + n * N + m[None, :], mask=tm, other=0.0), BF16)
            d_s = _round(tl.sum(comb_n[:, :, None] * g, axis=1), BF16)
            tl.store(d_s_ptr + (t64[:, None] * N + n) * H + c[None, :], d_s.to(d_s_ptr.dtype.element_ty), mask=tc)
            s_n = tl.load(s_ptr + (t64[:, None] * N + n) * H + c[None, :], mask=tc, other=0.0).to(tl.float32)
            row_n = tl.sum(g * s_n[:, None, :], axis=2)  # [token, m]
            d_comb += tl.where((m == n)[None, :, None], row_n[:, None, :], 0.0)
    tl.store(d_post_ptr + t64[:, None] * N + m[None, :], _round(d_post, BF16), mask=tm)
    nm = m[:, None] * N + m[None, :]
    tl.store(d_comb_ptr + t64[:, None, None] * (N * N) + nm[None, :, :], _round(d_comb, BF16),
             mask=(t < T)[:, None, None] & ((m < N)[:, None] & (m < N)[None, :])[None, :, :])


def supports(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor, streams: torch.Tensor) -> bool:
    """Whether :func:`mix_streams` takes these tensors (module docstring): on a CUDA device (on the
    CPU only under ``TRITON_INTERPRET=1``), FP32 ``post``/``comb``, BF16 or FP32 ``block_output``
    and ``streams`` of one dtype, ``streams [..., N, h]`` with ``1 <= N <= MAX_N`` and the other
    shapes to match."""
    tensors = (post, comb, block_output, streams)
    on_device = all(x.is_cuda for x in tensors) or (_INTERPRETED and all(x.device.type == "cpu" for x in tensors))
    if not on_device or streams.dim() < 2 or post.dtype != torch.float32 or comb.dtype != torch.float32:
        return False
    n, h = streams.shape[-2:]
    lead = streams.shape[:-2]
    return (streams.dtype in _DTYPES and block_output.dtype == streams.dtype and 1 <= n <= MAX_N
            and post.shape == (*lead, n) and comb.shape == (*lead, n, n) and block_output.shape == (*lead, h))


def _check(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor, streams: torch.Tensor) -> None:
    if not supports(post, comb, block_output, streams):
        raise ValueError(
            f"mhc_mix_triton needs FP32 post [..., N] and comb [..., N, N], block_output [..., h] and streams "
            f"[..., N, h] of one dtype in {[str(d) for d in _DTYPES]}, 1 <= N <= {MAX_N}, on a CUDA device (CPU "
            f"only under TRITON_INTERPRET=1); got post {post.dtype} {list(post.shape)}, comb {comb.dtype} "
            f"{list(comb.shape)}, block_output {block_output.dtype} {list(block_output.shape)}, streams "
            f"{streams.dtype} {list(streams.shape)} on {streams.device.type}")


def _flat(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor,
          streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands as contiguous ``[T, N]``, ``[T, N, N]``, ``[T, h]``, ``[T, N, h]``."""
    n, h = streams.shape[-2:]
    t = math.prod(streams.shape[:-2])
    return (post.reshape(t, n).contiguous(), comb.reshape(t, n, n).contiguous(),
            block_output.reshape(t, h).contiguous(), streams.reshape(t, n, h).contiguous())


def _meta(streams: torch.Tensor) -> dict[str, object]:
    n = streams.shape[-2]
    return {"N": n, "NP": triton.next_power_of_2(n), "BF16": streams.dtype == torch.bfloat16}


class _MixStreams(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor,
                streams: torch.Tensor) -> torch.Tensor:
        flat = _flat(post, comb, block_output, streams)
        ctx.save_for_backward(*flat)
        ctx.shapes = (post.shape, comb.shape, block_output.shape)
        t, n, h = flat[3].shape
        out = torch.empty_like(flat[3])
        if t and h:
            _forward_kernel[(triton.cdiv(t, BLOCK_T), triton.cdiv(h, BLOCK_H))](
                *flat, out, t, h, **_meta(streams), BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=WARPS)
        return out.view(streams.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        post, comb, block_output, streams = ctx.saved_tensors
        t, n, h = streams.shape
        d_post, d_comb = torch.empty_like(post), torch.empty_like(comb)
        d_bo, d_s = torch.empty_like(block_output), torch.empty_like(streams)
        if t and h:
            _backward_kernel[(triton.cdiv(t, BACKWARD_BLOCK_T),)](
                post, comb, block_output, streams, grad.reshape(t, n, h).to(streams.dtype).contiguous(),
                d_post, d_comb, d_bo, d_s, t, h, **_meta(streams), BLOCK_T=BACKWARD_BLOCK_T,
                BLOCK_H=BACKWARD_BLOCK_H, num_warps=BACKWARD_WARPS)
        else:  # no tokens or no channels: nothing to launch; the channel sums are empty
            d_post.zero_()
            d_comb.zero_()
        post_shape, comb_shape, bo_shape = ctx.shapes
        return (d_post.view(post_shape), d_comb.view(comb_shape), d_bo.view(bo_shape),
                d_s.view(*bo_shape[:-1], n, h))


def mix_streams(post: torch.Tensor, comb: torch.Tensor, block_output: torch.Tensor,
                streams: torch.Tensor) -> torch.Tensor:
    """``post (x) block_output + comb^T @ streams`` -> ``[..., N, h]`` in the streams' dtype,
    differentiable in all four operands (module docstring); refused (``ValueError`` naming the
    tensors) for what :func:`supports` does not take."""
    _check(post, comb, block_output, streams)
    return _MixStreams.apply(post, comb, block_output, streams)
