"""Lightning-indexer scoring and exact top-k selection in two Triton kernels.

:func:`range_topk_triton` returns what :func:`kpool_layers.dsa.topk.chunked_range_topk` returns (same
layouts, see there):

    q [t, h, d] (bf16 / fp16 / fp32), keys [n, d], weights [t, h], lo, hi int64 [t]
    -> int64 [t, topk], best first, ties to the lower key index, -1 beyond the visible keys.

Queries are processed in chunks of ``R`` rows; per chunk two kernels run:

1. Scoring, grid ``(key blocks of BLOCK_N, query blocks of BLOCK_T)``. A program whose key block
   lies outside every one of its queries' visible ranges ``[lo, hi)`` returns at once (about half
   the grid when causal). The others load their key tile ``[BLOCK_N, d]`` once and loop over the
   heads: ``acc[BLOCK_T, BLOCK_N] += w[t, h] * act(q[t, h, :] . key[j, :])`` on the tensor cores,
   one ``[BLOCK_T, d] @ [d, BLOCK_N]`` product per head accumulated element-wise in FP32, heads in
   order. The score ``s`` is stored as a 32-bit descending key ``v`` (the order-reversing image of
   its FP32 bits, ``-0.0`` folded into ``+0.0``: smaller ``v`` = larger score) into the score
   buffer ``int32 [R, n']`` (``v`` bit-cast; row = query of the chunk, column = key index, ``n'`` =
   ``n`` rounded up to 16). Entries of skipped blocks stay unwritten: the selection reads only
   ``[lo, hi)``. The head sum starts from ``+0.0``, so a ``-0.0`` score does not arise; the fold
   is kept as a guard.
2. Selection, one query row per program: an exact radix select of the
   ``k = min(topk, count)`` smallest ``v`` among a row's ``count`` visible keys, reading the row
   from the buffer in blocks of ``select_block`` keys. Each histogram pass counts digit ``p``
   (``radix_bits`` wide, most significant first) of the keys whose higher digits equal the prefix
   found so far (the "bucket") and picks the digit of the ``k``-th key. The passes stop as soon as
   the bucket holds exactly the ``rem`` keys still needed (before any pass when ``count <= topk``;
   with random GLM-shaped inputs at 4K-32K keys mostly after 3 passes of 8 bits, 2-3 of 11 bits, in
   a CPU simulation of the select) or all 32 bits are known (exact ties). One final pass writes
   the indices of the keys below the bucket and of the bucket's first ``rem`` keys (ties to the
   lower index) into the ``[t, topk]`` result in ascending key order, a running count of the
   taken keys giving each its slot; slots beyond ``k`` stay -1. No sort follows.

Memory: the score buffer ``int32 [R, n']`` stays within ``LaunchConfig.score_buffer_bytes``
(default ``SCORE_BUFFER_BYTES`` = 512 MiB: ``R`` = 32768 rows at 4K keys, 4096 at 32K; ``R`` a
multiple of ``block_t`` where the bound allows, at least one row); besides it only the
``[t, topk]`` int64 result. No host synchronisation: the grids depend on ``t``, ``n`` and the
config only.

Determinism: every score is written once by one program (its FP32 sum runs over the heads in
order), histograms are integer counts inside one program, and there are no atomics across
programs: reruns are bit-identical. Scores are FP32 sums in a different order than the PyTorch
reference's, so keys whose scores lie within FP32 rounding of the ``k``-th may swap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

SCORE_BUFFER_BYTES = 512 * 2**20  # bound of the int32 [rows, n] score buffer of one query chunk


@dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs. Selections can depend on them only through the FP32 rounding of the
    ``q . key`` products (the head sum runs in head order in every config); each config is
    deterministic.

    The defaults were chosen for Hopper (a 64-row tile is one warpgroup's wgmma M, 128 keys keep
    the FP32 accumulator at 64 registers per thread with 4 warps, 3 stages pipeline the per-head
    query tiles) and kept after a sweep on an H200 at s = 4096
    (``scripts/bench/indexer_topk_triton_check.py``; docs/indexer_topk_triton.md)."""

    block_t: int = 64  # scoring: queries per program (tensor-core M), power of 2 >= 16
    block_n: int = 128  # scoring: keys per program (tensor-core N), power of 2 >= 16
    num_warps: int = 4  # scoring
    num_stages: int = 3  # scoring: pipeline depth of the head loop
    select_block: int = 1024  # selection: keys per step, power of 2 <= 32768
    select_warps: int = 4  # selection
    radix_bits: int = 8  # selection: digit width, 1 .. 16 (ceil(32 / radix_bits) passes at most)
    score_buffer_bytes: int = SCORE_BUFFER_BYTES  # bound of one query chunk's score buffer


DEFAULT_CONFIG = LaunchConfig()


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, buf_ptr,
    row0, rows, n,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_wh, stride_buf,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (key block, query block): descending keys ``v`` of the block's scores into
    ``buf[query - row0, key]``; returns at once when none of its queries sees the key block."""
    j0 = tl.program_id(0) * BLOCK_N
    local = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # rows of the chunk
    row_ok = local < rows
    qrow = (row0 + local).to(tl.int64)
    lo = tl.maximum(tl.load(lo_ptr + qrow, mask=row_ok, other=0), 0).to(tl.int32)
    hi = tl.minimum(tl.load(hi_ptr + qrow, mask=row_ok, other=0), n).to(tl.int32)
    needed = row_ok & (lo < hi) & (lo < j0 + BLOCK_N) & (hi > j0)
    if tl.max(needed.to(tl.int32), axis=0) == 0:
        return

    cols = j0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kt = tl.load(k_ptr + cols[None, :].to(tl.int64) * stride_kn + dims[:, None],
                 mask=(cols[None, :] < n) & (dims[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
    q_ptrs = q_ptr + qrow[:, None] * stride_qt + dims[None, :]
    q_mask = row_ok[:, None] & (dims[None, :] < D)
    w_ptrs = w_ptr + qrow * stride_wt
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for h in range(H):  # the head sum is element-wise in the accumulator's layout
        qh = tl.load(q_ptrs + h * stride_qh, mask=q_mask, other=0.0)  # [BLOCK_T, BLOCK_D]
        wh = tl.load(w_ptrs + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
        logits = tl.dot(qh, kt, input_precision=PRECISION)
        if RELU:
            logits = tl.maximum(logits, 0.0)
        acc += wh[:, None] * logits

    bits = acc.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)  # -0.0 -> +0.0
    v = tl.where(bits >= 0x80000000, bits, bits ^ 0x7FFFFFFF)  # descending key
    offs = local[:, None].to(tl.int64) * stride_buf + cols[None, :]
    tl.store(buf_ptr + offs, v.to(tl.int32, bitcast=True), mask=row_ok[:, None] & (cols[None, :] < n))


@triton.jit
def _select_kernel(
    buf_ptr, lo_ptr, hi_ptr, out_ptr,
    row0, n, topk, stride_buf,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, PASSES: tl.constexpr,
):
    """Program ``r``: for query ``row0 + r``, the indices of the ``min(topk, count)`` smallest
    ``(v, index)`` of ``buf[r, lo:hi]``, in ascending order into ``out[row0 + r, :]``. One row per
    program, every tensor 1-D (docs/indexer_topk_triton.md, "Why one row per program")."""
    NBINS: tl.constexpr = 1 << RADIX_BITS
    local = tl.program_id(0)
    row = (row0 + local).to(tl.int64)
    lo = tl.maximum(tl.load(lo_ptr + row), 0).to(tl.int32)
    hi = tl.minimum(tl.load(hi_ptr + row), n).to(tl.int32)
    count = tl.maximum(hi - lo, 0)
    k = tl.minimum(count, topk)
    first = lo // BLOCK * BLOCK  # aligned block starts
    buf_row = buf_ptr + local.to(tl.int64) * stride_buf
    bins = tl.arange(0, NBINS)

    prefix = tl.zeros([], dtype=tl.uint32)  # digits of the k-th key found so far
    known = tl.zeros([], dtype=tl.uint32)  # bit mask of those digits
    rem = k  # keys still to take from the bucket (the keys whose known digits equal the prefix)
    bucket = count  # size of the bucket
    for p in tl.static_range(PASSES):
        top = 32 - RADIX_BITS * p  # constexpr: bits [shift, top) are this pass's digit
        shift = top - RADIX_BITS if top > RADIX_BITS else 0
        digit_mask = (1 << (top - shift)) - 1
        if bucket > rem:  # else the bucket is exactly what is still needed: take it whole
            hist = tl.zeros([NBINS], dtype=tl.int32)
            for start in range(first, hi, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                vis = (cols >= lo) & (cols < hi)
                v = tl.load(buf_row + cols, mask=vis, other=0).to(tl.uint32, bitcast=True)
                same = vis & ((v & known) == prefix)
                hist += tl.histogram(((v >> shift) & digit_mask).to(tl.int32), NBINS, mask=same)
            below = tl.cumsum(hist, axis=0)  # keys of the bucket with this digit or a better one
            digit = tl.sum((below < rem).to(tl.int32), axis=0)  # digit of the k-th key
            at = bins == digit
            rem -= tl.sum(tl.where(at, below - hist, 0), axis=0)
            bucket = tl.sum(tl.where(at, hist, 0), axis=0)
            prefix = prefix | (digit.to(tl.uint32) << shift)
            known = known | tl.full([], digit_mask << shift, tl.uint32)

    # every key below the bucket (k - rem of them) and the bucket's first rem, in key order
    out_row = out_ptr + row * topk
    run_taken = tl.zeros([], dtype=tl.int32)
    run_tied = tl.zeros([], dtype=tl.int32)
    for start in range(first, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        vis = (cols >= lo) & (cols < hi)
        v = tl.load(buf_row + cols, mask=vis, other=0).to(tl.uint32, bitcast=True)
        better = vis & ((v & known) < prefix)
        tied = (vis & ((v & known) == prefix)).to(tl.int32)
        take = better | ((tied != 0) & (run_tied + tl.cumsum(tied, axis=0) <= rem))
        slot = run_taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, cols.to(tl.int64), mask=take)
        run_tied += tl.sum(tied, axis=0)
        run_taken += tl.sum(take.to(tl.int32), axis=0)


def buffer_width(n: int) -> int:
    """Row stride of the score buffer: ``n`` rounded up to 16 keys (64-byte aligned rows)."""
    return triton.cdiv(n, 16) * 16


def chunk_rows(n: int, config: LaunchConfig) -> int:
    """Query rows per chunk: the most whose ``int32 [rows, buffer_width(n)]`` score buffer fits
    ``config.score_buffer_bytes``, a multiple of ``block_t`` where possible, at least one."""
    rows = max(1, config.score_buffer_bytes // (4 * buffer_width(n)))
    return rows // config.block_t * config.block_t if rows >= config.block_t else rows


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
    """Top-``topk`` keys of every query within ``[lo, hi)``: scoring kernel, then radix select.

    Args:
        q: [t, h, d] index queries, bf16 / fp16 / fp32 (last dim contiguous or copied).
        keys: [n, d] index keys (cast to q's promoted dtype).
        weights: [t, h] per-head weights (read as FP32).
        lo, hi: int [t] visible key range ``[lo, hi)`` of every query.
        topk: selected keys per query.
        relu: ReLU on ``q . k`` before weighting.
        config: launch parameters (benchmarks sweep them).

    Returns:
        int64 [t, topk]: the selected key indices in ascending order (ties to the lower index),
        then -1 for the empty slots.
        Same contract as :func:`kpool_layers.dsa.topk.chunked_range_topk`; runs without grad.
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
    if not 1 <= config.radix_bits <= 16 or config.select_block > 2**15:
        raise ValueError(f"radix_bits must lie in 1 .. 16 and select_block <= 2^15, got {config}")
    with torch.no_grad():
        q, keys = q.detach().to(dtype), keys.detach().to(dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        if keys.stride(1) != 1:
            keys = keys.contiguous()
        weights = weights.detach()
        lo, hi = lo.to(torch.long).contiguous(), hi.to(torch.long).contiguous()
        out = torch.full((t, topk), -1, dtype=torch.long, device=q.device)
        rows = min(chunk_rows(n, config), t)
        stride_buf = buffer_width(n)
        buf = torch.empty((rows, stride_buf), dtype=torch.int32, device=q.device)
        for row0 in range(0, t, rows):
            chunk = min(rows, t - row0)
            grid = (triton.cdiv(n, config.block_n), triton.cdiv(chunk, config.block_t))
            _score_kernel[grid](
                q, keys, weights, lo, hi, buf,
                row0, chunk, n,
                q.stride(0), q.stride(1), keys.stride(0), weights.stride(0), weights.stride(1), stride_buf,
                H=h, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                BLOCK_T=config.block_t, BLOCK_N=config.block_n,
                RELU=relu, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
            _select_kernel[(chunk,)](
                buf, lo, hi, out,
                row0, n, topk, stride_buf,
                BLOCK=config.select_block, RADIX_BITS=config.radix_bits,
                PASSES=triton.cdiv(32, config.radix_bits),
                num_warps=config.select_warps,
            )
        return out
