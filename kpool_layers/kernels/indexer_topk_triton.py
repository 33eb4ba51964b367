"""Fused lightning-indexer scoring and exact top-k selection in one Triton kernel.

:func:`range_topk_triton` returns exactly what :func:`kpool_layers.topk.chunked_range_topk` returns
(same layouts, see there) without ever holding a ``[t, n]`` score tensor:

    q [t, h, d] (bf16 / fp16 / fp32), keys [n, d], weights [t, h], lo, hi int64 [t]
    -> int64 [t, topk], best first, ties to the lower key index, -1 beyond the visible keys.

Each program owns ``BLOCK_T`` consecutive queries and walks the keys they can see in blocks of
``BLOCK_N``, scoring them on the tensor cores (``[BLOCK_T * h, d] @ [d, BLOCK_N]`` in FP32, ReLU,
weighted sum over heads). A score ``s`` is mapped to a 32-bit descending key ``v`` (order-reversing
image of the FP32 bits, ``-0.0`` folded into ``+0.0``: smaller ``v`` = larger score). Every query
must take its ``k`` smallest ``(v, index)`` pairs. A radix select narrows the ``k``-th ``v`` down,
8 bits per pass: each histogram pass rescores the keys and counts digit ``p`` of the keys whose
higher digits equal the digits chosen so far (the "bucket"). As soon as every query's bucket holds
at most ``CAP`` keys (before any pass when few keys are visible; for continuous scores expected
after two passes at 32K keys), one collecting pass writes the keys better than the bucket to the
output and the bucket's keys to a ``[t, CAP]`` scratch buffer, and the best ``rem`` of those are
ranked pairwise by ``(v, index)`` in registers. If buckets stay larger (massive ties), after four
passes all 32 bits are known and the final pass writes the better keys, then the tied ones in key
order.
Keys go out packed as int64 ``(v - 2^31) << 32 | index``; one row-wise sort of the ``[t, topk]``
result orders it by (score desc, index asc). Rescoring is cheaper than storing scores: a score costs
``2 h d`` FLOPs on the tensor cores and the keys stay in L2.

All passes run in one loop of one kernel, so every pass sees bit-identical scores; there are no
atomics across programs, so results are deterministic. Memory: ``O(t * (topk + CAP))``; the
result itself serves as the packed buffer and is sorted and decoded in place, 4096 rows at a time.
Scores are FP32 summed in a different order than the PyTorch reference, so keys whose scores lie
within FP32 rounding of the ``k``-th may swap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

_EMPTY = torch.iinfo(torch.int64).max  # packed value of an unfilled slot; sorts last
_RADIX_BITS = 8
_PASSES = 32 // _RADIX_BITS
_SORT_ROWS = 4096  # rows per sort of the packed buffer (bounds the sort's scratch)


@dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs of the kernel. Selections do not depend on them except through the FP32
    rounding of the head sum (its order follows the register layout); each config is
    deterministic."""

    block_n: int = 64  # keys per step
    block_m: int = 128  # query-head rows per tensor-core product (queries per program * heads)
    num_warps: int = 8
    num_stages: int = 2
    cand_cap: int = 256  # power of 2: candidates per query ranked in registers once they fit


DEFAULT_CONFIG = LaunchConfig()


@triton.jit
def _load_keys(k_ptr, start, stop, stride_kn, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Keys ``start .. start + BLOCK_N`` (those below ``stop``) transposed: [BLOCK_D, BLOCK_N]."""
    cols = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    offs = cols[None, :].to(tl.int64) * stride_kn + dims[:, None]
    return tl.load(k_ptr + offs, mask=(cols[None, :] < stop) & (dims[:, None] < D), other=0.0)


@triton.jit
def _range_topk_kernel(
    q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, cand_ptr,
    t, n, topk,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_wh,
    H: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAP: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr, PASSES: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """One program: queries ``pid * BLOCK_T ..``; writes packed keys into ``out [t, topk]``,
    using ``cand [t, CAP]`` as scratch."""
    NBINS: tl.constexpr = 1 << RADIX_BITS
    EMPTY: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    RANK_STEP: tl.constexpr = 8
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the last queries see the most keys: first
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < t
    lo = tl.maximum(tl.load(lo_ptr + rows, mask=row_ok, other=0), 0)
    hi = tl.minimum(tl.load(hi_ptr + rows, mask=row_ok, other=0), n)
    count = tl.maximum(hi - lo, 0)
    k_eff = tl.minimum(count, topk).to(tl.int32)  # keys each query selects
    seen = count > 0
    k_start = (tl.min(tl.where(seen, lo, n), axis=0) // BLOCK_N * BLOCK_N).to(tl.int32)
    k_stop = tl.max(tl.where(seen, hi, 0), axis=0).to(tl.int32)

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    rows64 = rows.to(tl.int64)
    q_offs = rows64[:, None, None] * stride_qt + heads[None, :, None] * stride_qh + dims[None, None, :]
    q_mask = row_ok[:, None, None] & (heads[None, :, None] < H) & (dims[None, None, :] < D)
    q = tl.reshape(tl.load(q_ptr + q_offs, mask=q_mask, other=0.0), (BLOCK_T * BLOCK_H, BLOCK_D))
    w_offs = rows64[:, None] * stride_wt + heads[None, :] * stride_wh
    w_mask = row_ok[:, None] & (heads[None, :] < H)
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H]

    bin_base = (tl.arange(0, BLOCK_T) * NBINS)[:, None]  # per-query histogram slice
    digits = tl.arange(0, NBINS)
    slots = tl.arange(0, CAP)
    out_row = out_ptr + rows64[:, None] * topk
    cand_row = cand_ptr + rows64[:, None] * CAP
    prefix = tl.zeros([BLOCK_T], dtype=tl.uint32)  # digits of the threshold found so far
    known = tl.zeros([BLOCK_T], dtype=tl.uint32)  # bit mask of those digits
    rem = k_eff  # keys still to take among those whose known digits equal the prefix
    bucket = count.to(tl.int32)  # number of those keys
    done = tl.zeros([], dtype=tl.int32)
    for p in range(0, PASSES + 1):  # p histogram passes are behind
        fits = tl.max(bucket, axis=0) <= CAP
        collect = (done == 0) & fits
        histogram = (done == 0) & (tl.max(bucket, axis=0) > CAP) & (p < PASSES)
        shift = 32 - RADIX_BITS * (p + 1)
        hist = tl.zeros([BLOCK_T * NBINS], dtype=tl.int32)
        n_better = k_eff - rem
        run_better = tl.zeros([BLOCK_T], dtype=tl.int32)
        run_same = tl.zeros([BLOCK_T], dtype=tl.int32)
        for start in range(k_start, tl.where(done == 0, k_stop, k_start), BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            kt = _load_keys(k_ptr, start, k_stop, stride_kn, D, BLOCK_D, BLOCK_N)
            logits = tl.dot(q, kt, input_precision=PRECISION)  # [BLOCK_T * BLOCK_H, BLOCK_N] FP32
            if RELU:
                logits = tl.maximum(logits, 0.0)
            logits = tl.reshape(logits, (BLOCK_T, BLOCK_H, BLOCK_N))
            score = tl.sum(logits * w[:, :, None], axis=1)  # [BLOCK_T, BLOCK_N]
            bits = score.to(tl.uint32, bitcast=True)
            bits = tl.where(bits == 0x80000000, 0, bits)  # -0.0 -> +0.0
            v = tl.where(bits >= 0x80000000, bits, bits ^ 0x7FFFFFFF)  # descending key
            vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]) & row_ok[:, None]
            same = vis & ((v & known[:, None]) == prefix[:, None])
            if histogram:
                slot = ((v >> shift) & (NBINS - 1)).to(tl.int32) + bin_base
                hist += tl.histogram(
                    tl.reshape(slot, (BLOCK_T * BLOCK_N,)),
                    BLOCK_T * NBINS,
                    mask=tl.reshape(same, (BLOCK_T * BLOCK_N,)),
                )
            else:  # keys better than the prefix go out; the prefix's own to scratch or out
                better = vis & ((v & known[:, None]) < prefix[:, None])
                high = (v ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)  # v - 2^31
                packed = (high << 32) | cols[None, :].to(tl.int64)
                pos = run_better[:, None] + tl.cumsum(better.to(tl.int32), axis=1) - 1
                tl.store(out_row + pos, packed, mask=better & (pos < k_eff[:, None]))
                pos = run_same[:, None] + tl.cumsum(same.to(tl.int32), axis=1) - 1
                if collect:
                    tl.store(cand_row + pos, packed, mask=same & (pos < CAP))
                else:  # all digits known: the first ``rem`` ties in key order
                    tl.store(out_row + n_better[:, None] + pos, packed, mask=same & (pos < rem[:, None]))
                run_better += tl.sum(better.to(tl.int32), axis=1)
                run_same += tl.sum(same.to(tl.int32), axis=1)
        if histogram:
            counts = tl.reshape(hist, (BLOCK_T, NBINS))
            below = tl.cumsum(counts, axis=1)  # keys with this digit or a better one
            digit = tl.sum((below < rem[:, None]).to(tl.int32), axis=1)  # digit of the k-th key
            rem -= tl.sum(tl.where(digits[None, :] < digit[:, None], counts, 0), axis=1)
            bucket = tl.sum(tl.where(digits[None, :] == digit[:, None], counts, 0), axis=1)
            prefix = prefix | (digit.to(tl.uint32) << shift)
            known = known | ((known * 0 + (NBINS - 1)) << shift)
        if collect:  # the best ``rem`` candidates by (v, index): rank them pairwise
            # (counts as written: they equal ``bucket`` and ``n_better``, as every pass computes
            # bit-identical scores; the masks above only keep writes inside their rows regardless)
            n_cand = tl.minimum(run_same, CAP)
            tl.debug_barrier()  # the candidates were stored by other threads of this program
            filled = (slots[None, :] < n_cand[:, None]) & row_ok[:, None]
            mine = tl.load(cand_row + slots[None, :], mask=filled, other=EMPTY)  # [BLOCK_T, CAP]
            rank = tl.zeros([BLOCK_T, CAP], dtype=tl.int32)
            for j in range(0, tl.max(n_cand, axis=0), RANK_STEP):
                js = j + tl.arange(0, RANK_STEP)
                mask = (js[None, :] < n_cand[:, None]) & row_ok[:, None]
                other = tl.load(cand_row + js[None, :], mask=mask, other=EMPTY)  # [BLOCK_T, RANK_STEP]
                rank += tl.sum((other[:, None, :] < mine[:, :, None]).to(tl.int32), axis=2)
            take = filled & (rank < (k_eff - run_better)[:, None])
            tl.store(out_row + run_better[:, None] + rank, mine, mask=take)
        done = tl.where(collect | (p == PASSES), 1, done)


def _block_t(block_h: int, block_m: int) -> int:
    """Queries per program: a tensor-core M of ``BLOCK_T * BLOCK_H`` of at least 16, ``block_m``
    where heads allow (at most 16 queries, so their key ranges stay close)."""
    return max(1, min(16, block_m // block_h))


def range_topk_triton(
    q: Tensor,
    keys: Tensor,
    weights: Tensor,
    lo: Tensor,
    hi: Tensor,
    *,
    topk: int,
    relu: bool,
    config: LaunchConfig = DEFAULT_CONFIG,
) -> Tensor:
    """Top-``topk`` keys of every query within ``[lo, hi)``, fused scoring + radix select.

    Args:
        q: [t, h, d] index queries, bf16 / fp16 / fp32 (last dim contiguous or copied).
        keys: [n, d] index keys (cast to q's promoted dtype).
        weights: [t, h] per-head weights (read as FP32).
        lo, hi: int [t] visible key range ``[lo, hi)`` of every query.
        topk: selected keys per query.
        relu: ReLU on ``q . k`` before weighting.
        config: launch parameters (benchmarks sweep them).

    Returns:
        int64 [t, topk]: key indices, best first, ties to the lower index, -1 = empty slot.
        Same contract as :func:`kpool_layers.topk.chunked_range_topk`; runs without grad.
    """
    t, h, d = q.shape
    n = keys.shape[0]
    if t == 0 or topk == 0 or n == 0:
        return torch.full((t, topk), -1, dtype=torch.long, device=q.device)
    dtype = torch.promote_types(q.dtype, keys.dtype)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"range_topk_triton scores bf16/fp16/fp32 inputs, got {dtype}")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("range_topk_triton runs on CUDA tensors (CPU only under TRITON_INTERPRET=1)")
    with torch.no_grad():
        q, keys = q.detach().to(dtype), keys.detach().to(dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        if keys.stride(1) != 1:
            keys = keys.contiguous()
        weights = weights.detach()
        lo, hi = lo.to(torch.long).contiguous(), hi.to(torch.long).contiguous()
        block_h = triton.next_power_of_2(h)
        block_t = _block_t(block_h, config.block_m)
        packed = torch.full((t, topk), _EMPTY, dtype=torch.long, device=q.device)  # the result
        cand = torch.empty((t, config.cand_cap), dtype=torch.long, device=q.device)
        _range_topk_kernel[(triton.cdiv(t, block_t),)](
            q, keys, weights, lo, hi, packed, cand,
            t, n, topk,
            q.stride(0), q.stride(1), keys.stride(0), weights.stride(0), weights.stride(1),
            H=h, D=d, BLOCK_T=block_t, BLOCK_H=block_h,
            BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=config.block_n, CAP=config.cand_cap,
            RELU=relu, PRECISION="ieee" if dtype == torch.float32 else "tf32",
            PASSES=_PASSES, RADIX_BITS=_RADIX_BITS,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        for start in range(0, t, _SORT_ROWS):  # (score desc, index asc); -1 for empty slots
            rows = packed[start:start + _SORT_ROWS]
            ordered = torch.sort(rows, dim=1).values
            rows.copy_(torch.where(ordered == _EMPTY, -1, ordered & 0xFFFFFFFF))
        return packed
