"""Deterministic Triton sparse absorbed-MLA attention over contiguous key blocks with a bit mask of
the selected keys: the layout for dense selections (top-k width close to the sequence length).

Same function, layouts and masking rules as :func:`kpool_layers.kernels.sparse_mla_triton.
sparse_mla_triton` (which dispatches here, see :func:`dense_pays`): ``query [s_q, b, n, d_k]``,
``latent_kv [s_kv, b, 1, d_k]`` (first ``v_channels`` = value), ``topk_indices [b, s_q, W]``,
``key_start [s_q]`` / ``query_pos [s_q]`` or None; a slot counts only if
``key_start[i] <= key <= query_pos[i]``; valid keys of a row are unique.

Why: the gather kernels do the work of one query token's heads per selected key; with few heads
(the 16-head proxy) a gathered 1.15 KB key row feeds 16 rows of a dot, and the latent-key gradient
round-trips a ``[tokens, W, d_k]`` partial buffer. When a query selects a large share of its
causal prefix, computing every key of the prefix and masking the unselected ones does more FLOPs
but as dense GEMMs.

Kernels and steps:
  1. mask, grid ``(b*s_q, slot blocks)``: ``bits [b, s_q, ceil(s_kv/32)]`` int32, bit ``k % 32`` of
     word ``k // 32`` set for each valid selected key ``k`` (``atomic_or``: order-free, exact); the
     bits hold causality and ``key_start`` too;
  2. forward, per batch row and query chunk (at least ``QUERY_CHUNKS`` chunks; the fp32 ``S`` and
     ``P`` together at most ``S_BUFFER_BYTES``), rows ``(token, head)`` token-major: GEMM
     ``S = Q K^T`` ``[tokens * n, keys]`` in fp32 over all ``d_k`` channels; a softmax kernel, grid
     ``(tokens, head blocks)``, takes the max and sum of each row's selected scores over the key
     blocks of ``[key_start, query_pos]`` (online, fp32, base 2), writes ``lse2 [s_q, b, n]``
     (``+inf`` for an empty row) exactly as the gather forward does (its slot-probability kernel
     and the backward read it), then ``P = exp2(S scale log2(e) - lse2)`` in the input dtype
     (zeros where unselected); GEMM ``O = P V`` on the value channels, into the output. An empty
     row has ``P = 0``, so ``O = 0``;
  3. backward, per batch row and query chunk (at least ``QUERY_CHUNKS`` chunks; ``P`` and ``dS``
     together at most ``DS_BUFFER_BYTES``): ``delta = rowsum(dO * O)`` (one kernel for all rows,
     shared with the gather layout); a tile kernel recomputes ``S = Q K^T`` and ``dP = dO V^T``
     and writes the chunk's ``P`` and ``dS = P (dP - delta) scale`` ``[tokens * n, keys]`` in the
     input dtype (zeros where unselected); then GEMMs: ``dQ = dS K``, ``dKV += dS^T Q`` and, on
     the value channels, ``dKV += P^T dO``, accumulated in fp32 over the chunks (cuBLAS with fp32
     output on CUDA).
The keys of a chunk end at its last query (the whole row with ``query_pos``). The forward launches
3 kernels per chunk (2 GEMMs and the softmax kernel; a copy more for ``b > 1``). No float atomics:
outputs and gradients are bit-identical from run to run (the cuBLAS GEMMs of fixed shapes
included). Memory: the bit mask (``b * s_q * s_kv / 8`` bytes), the forward's fp32 ``S`` and ``P``
of its largest chunk (``tokens * n * keys * (4 + 2)`` bytes for bf16, allocated once per call), the
backward's chunk ``P`` and ``dS``, and an fp32 ``[b, s_kv, d_k]`` key-gradient accumulator.

Numerics as the gather kernels (fp32 scores, softmax and accumulation; the products' ``P`` and
``dS`` operands rounded to the input dtype; fp32 inputs use exact fp32 products), except that the
forward rounds the normalized ``P`` (not per-block unnormalized probabilities) before one ``P V``
product, and each key's gradient is summed in fp32 without rounding per (query, slot) partials to
the input dtype first. On CUDA the bf16/fp16 ``O = P V`` and ``dQ = dS K`` are cuBLAS GEMMs with
an input-dtype output: fp32 accumulation, but split-K partials may be reduced in the input dtype
where ``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` (default on)
allow it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.accumulate import accumulate_matmul
from kpool_layers.kernels.mla_tiles_triton import (
    LOG2E, output_delta, pow2, selected_slots, visible_range)

DENSE_HEAD_KEYS_PER_SLOT = 256
""":func:`dense_pays` needs ``s_kv * heads <= DENSE_HEAD_KEYS_PER_SLOT * W``."""

DENSE_KEYS_PER_SLOT = 16
""":func:`dense_pays` needs ``s_kv <= DENSE_KEYS_PER_SLOT * W``."""

S_BUFFER_BYTES = 1 << 29
"""Upper bound of the forward's fp32 ``S`` and ``P`` buffers of a query chunk together."""

DS_BUFFER_BYTES = 1 << 28
"""Upper bound of the backward's ``P`` and ``dS`` buffers of a query chunk together. 256 MiB
against 512: the same time or less at 4K and 8K (64 heads), 3% more at 16 heads and 16K, and
360 MiB less peak at 4K (docs/benchmarks.md, "Sparse MLA attention")."""

QUERY_CHUNKS = 4
"""The forward and the backward split the queries into at least this many chunks (the keys a chunk
sees end at its last query: fewer zero columns above the causal diagonal)."""

CHUNK_ALIGN = 64
"""Query chunks of at least this many tokens are a multiple of it long, shorter ones of at least
``ROW_ALIGN`` tokens a multiple of that, so a chunk's key count (its last query + 1, the leading
dimension of ``S``, ``P`` and ``dS``) is too unless the chunk ends the sequence. cuBLAS runs its
sm90 kernels only on 16-byte-aligned rows; with an odd key count it falls back to sm75 ones (GLM-5's
forward at 4K on an H200: 100 TFLOP/s with 341-token chunks, 242 with 320-token ones;
docs/benchmarks.md, "Sparse MLA attention")."""

ROW_ALIGN = 8
"""The fewest keys whose 16-bit row is 16 bytes: the alignment of chunks shorter than
``CHUNK_ALIGN`` (64 heads from about 22K keys at ``S_BUFFER_BYTES``)."""


def dense_pays(s_kv: int, width: int, heads: int) -> bool:
    """Whether the contiguous-block layout is the faster one for ``s_kv`` keys, ``width`` slots and
    ``heads`` query heads: its work grows with the causal prefix (``~s_kv / 2`` keys per query),
    the gather kernels' with ``width`` but with a per-key cost that heads amortize, while the
    dense chunks shrink with ``s_kv * heads`` (``S_BUFFER_BYTES``). The bounds
    ``DENSE_KEYS_PER_SLOT`` and ``DENSE_HEAD_KEYS_PER_SLOT`` are the crossovers measured at 16
    heads (H200) and 64 heads (H100): docs/kernels.md and docs/benchmarks.md, "Sparse MLA
    attention"."""
    return (s_kv <= DENSE_KEYS_PER_SLOT * width
            and s_kv * heads <= DENSE_HEAD_KEYS_PER_SLOT * width)


@triton.jit
def _mask_kernel(IDX, KSTART, QPOS, BITS, S, W, NW, si_b, si_s, BW: tl.constexpr,
                 HAS_KSTART: tl.constexpr, HAS_QPOS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    bi = t // S
    i = t % S
    slots = tl.program_id(1) * BW + tl.arange(0, BW)
    keys, valid = selected_slots(IDX, KSTART, QPOS, bi, i, slots, W, si_b, si_s, HAS_KSTART,
                                 HAS_QPOS)
    bit = tl.full([BW], 1, tl.int32) << (keys & 31).to(tl.int32)
    tl.atomic_or(BITS + t * NW + (keys >> 5), bit, mask=valid)


@triton.jit
def _selected(BITS, row_word, keys, mask):
    """Whether the row whose ``BITS`` words start at ``row_word`` selected ``keys`` (shapes
    broadcast); False where ``mask`` is False."""
    words = tl.load(BITS + row_word + (keys >> 5), mask=mask, other=0)
    return ((words >> (keys & 31).to(tl.int32)) & 1) != 0


@triton.jit
def _softmax_kernel(SC, P, BITS, KSTART, QPOS, LSE, t0, bi, S, B, N, NW, L, scale_log2,
                    BH: tl.constexpr, BN: tl.constexpr, HAS_KSTART: tl.constexpr,
                    HAS_QPOS: tl.constexpr):
    """``P`` and ``lse2`` of ``BH`` heads of token ``t0 + program_id(0)`` of a query chunk from its
    fp32 scores ``SC [rows, L]`` (rows = (token - t0) * N + head, keys ``[0, L)``). Pass 1: online
    max and sum over the key blocks of ``[key_start, query_pos]`` (selected keys only, base 2);
    pass 2: ``P = exp2(S * scale_log2 - lse2)`` in ``P``'s dtype on every key, 0 where
    unselected."""
    tok = t0 + tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < N
    rows = ((tok - t0) * N + heads).to(tl.int64) * L
    word = (bi * S + tok).to(tl.int64) * NW
    lo, hi = visible_range(KSTART, QPOS, tok, HAS_KSTART, HAS_QPOS)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    for n0 in range((lo // BN) * BN, hi + 1, BN):
        keys = n0 + tl.arange(0, BN)
        sel = hmask[:, None] & _selected(BITS, word, keys, keys < L)[None, :]
        sc = tl.load(SC + rows[:, None] + keys[None, :], mask=sel, other=0.0)
        sc = tl.where(sel, sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_ref) + tl.sum(tl.exp2(sc - m_ref[:, None]), 1)
        m = m_new
    nonempty = l > 0.0
    lse2 = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("inf"))
    tl.store(LSE + (tok * B + bi) * N + heads, lse2, mask=hmask)
    for n0 in range(0, L, BN):  # unselected keys (the bits hold causality and key_start): zeros
        keys = n0 + tl.arange(0, BN)
        kmask = keys < L
        sel = hmask[:, None] & _selected(BITS, word, keys, kmask)[None, :]
        sc = tl.load(SC + rows[:, None] + keys[None, :], mask=sel, other=0.0)
        p = tl.where(sel, tl.exp2(sc * scale_log2 - lse2[:, None]), 0.0)
        tl.store(P + rows[:, None] + keys[None, :], p.to(P.dtype.element_ty),
                 mask=hmask[:, None] & kmask[None, :])


@triton.jit
def _ds_kernel(Q, KV, DO, BITS, LSE, DELTA, P, DS, t0, bi, S, S_KV, B, N, NW, R, L, scale,
               scale_log2, sq_s, sq_b, sq_h, skv_s, skv_b, sdo_s, sdo_b, sdo_h,
               V: tl.constexpr, T: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """One ``[BM, BN]`` tile of ``P`` and ``dS`` (input dtype) of a query chunk: rows ``r`` are
    (token ``t0 + r // N``, head ``r % N``) of batch row ``bi``, columns are keys ``[0, L)``.
    Recomputes ``S = Q K^T`` and ``dP = dO V^T`` over channel blocks of ``BC``; tiles without a
    selected key are written as zeros."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < R
    kmask = keys < L
    tok = t0 + rows // N
    head = rows % N
    sel = _selected(BITS, ((bi * S + tok).to(tl.int64) * NW)[:, None], keys[None, :],
                    rmask[:, None] & (keys < S_KV)[None, :])
    p_out = tl.zeros([BM, BN], P.dtype.element_ty)
    ds_out = tl.zeros([BM, BN], P.dtype.element_ty)
    if tl.max(tl.max(sel.to(tl.int32), 1), 0) > 0:
        q_rows = Q + bi * sq_b + tok.to(tl.int64) * sq_s + head * sq_h
        do_rows = DO + bi * sdo_b + tok.to(tl.int64) * sdo_s + head * sdo_h
        k_rows = KV + bi * skv_b + keys.to(tl.int64) * skv_s
        sc = tl.zeros([BM, BN], tl.float32)
        dp = tl.zeros([BM, BN], tl.float32)
        for c0 in range(0, V, BC):
            c = c0 + tl.arange(0, BC)
            cmask = c < V
            q = tl.load(q_rows[:, None] + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            do = tl.load(do_rows[:, None] + c[None, :], mask=rmask[:, None] & cmask[None, :],
                         other=0.0)
            k = tl.load(k_rows[:, None] + c[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
            sc += tl.dot(q, tl.trans(k), input_precision=PREC)
            dp += tl.dot(do, tl.trans(k), input_precision=PREC)
        if T > 0:
            ct = V + tl.arange(0, BT)
            tmask = ct < V + T
            qt = tl.load(q_rows[:, None] + ct[None, :], mask=rmask[:, None] & tmask[None, :],
                         other=0.0)
            kt = tl.load(k_rows[:, None] + ct[None, :], mask=kmask[:, None] & tmask[None, :],
                         other=0.0)
            sc += tl.dot(qt, tl.trans(kt), input_precision=PREC)
        stat = (tok * B + bi) * N + head
        lse2 = tl.load(LSE + stat, mask=rmask, other=float("inf"))
        delta = tl.load(DELTA + stat, mask=rmask, other=0.0)
        p = tl.where(sel, tl.exp2(sc * scale_log2 - lse2[:, None]), 0.0)
        p_out = p.to(P.dtype.element_ty)
        ds_out = (p * (dp - delta[:, None]) * scale).to(P.dtype.element_ty)
    offs = rows.to(tl.int64)[:, None] * L + keys[None, :]
    mask = rmask[:, None] & kmask[None, :]
    tl.store(P + offs, p_out, mask=mask)
    tl.store(DS + offs, ds_out, mask=mask)


CONFIGS = {
    "softmax": dict(BH=16, BN=256, num_warps=4),
    "ds": dict(BM=64, BN=256, BC=64, num_warps=8, num_stages=3),
}
"""Rows (heads of one query token, ``softmax``; query tokens x heads, ``ds``), key block and
(``ds``) channel block per kernel. ``ds``: the fastest of the sweep at 16 and 64 heads and 4K on
an H100 (``scripts/bench/sparse_mla_triton_check.py --sweep-only``; docs/benchmarks.md).
``softmax``: key blocks of 128 were 3-4% faster at 4K in that sweep, but the forward took 21.95
against 18.2 ms at 8K (64 heads) and 22.45 against 18.0 ms at 16K (16 heads) with them (two runs
on H100s). The bits of the results depend on them, so a fixed table (no autotuning) keeps runs
reproducible across processes."""


def _query_chunks(s: int, s_kv: int, query_pos: torch.Tensor | None, per_token: int, budget: int
                  ) -> Iterator[tuple[int, int, int]]:
    """``(t0, t1, keys)`` of the query chunks ``[t0, t1)``: at least ``QUERY_CHUNKS`` of them, and
    at most ``budget`` bytes of buffers at ``per_token`` bytes per query; a chunk sees the keys
    ``[0, keys)``: up to its last query (query ``i`` sees keys ``<= i``), all with ``query_pos``.
    Chunks are rounded down to a multiple of ``CHUNK_ALIGN``, or of ``ROW_ALIGN`` below it."""
    chunk = max(1, min(triton.cdiv(s, QUERY_CHUNKS), budget // per_token))
    align = CHUNK_ALIGN if chunk >= CHUNK_ALIGN else ROW_ALIGN
    if chunk >= align:
        chunk -= chunk % align
    for t0 in range(0, s, chunk):
        t1 = min(s, t0 + chunk)
        yield t0, t1, s_kv if query_pos is not None else t1


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` (2-D) with fp32 accumulation, rounded once to ``out``'s dtype: cuBLAS on
    CUDA (an fp32 ``out`` of bf16/fp16 operands through ``out_dtype``), exact fp32 products
    elsewhere."""
    if not a.is_cuda:
        out.copy_(a.float() @ b.float())
    elif out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        torch.mm(a, b, out_dtype=out.dtype, out=out)


def _mm_rows(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`_mm` into ``out [tokens, n, c]`` (a chunk's rows of one batch row of an
    ``[s, b, n, c]`` tensor): in place when they are contiguous (``b == 1``), else through a
    temporary and one copy."""
    if out.is_contiguous():
        _mm(a, b, out.view(a.size(0), b.size(1)))
    else:
        rows = out.new_empty(a.size(0), b.size(1))
        _mm(a, b, rows)
        out.copy_(rows.view(out.shape))


def selection_bits(topk_indices: torch.Tensor, key_start: torch.Tensor | None,
                   query_pos: torch.Tensor | None, s_kv: int) -> torch.Tensor:
    """int32 ``[b, s_q, ceil(s_kv / 32)]``: bit ``k % 32`` of word ``k // 32`` of row ``(b, i)``
    is set iff slot key ``k`` of that row is valid (``key_start[i] <= k <= query_pos[i]``)."""
    b, s, w = topk_indices.shape
    nw = triton.cdiv(s_kv, 32)
    bits = torch.zeros(b, s, nw, dtype=torch.int32, device=topk_indices.device)
    bw = min(1024, pow2(w))
    _mask_kernel[(b * s, triton.cdiv(w, bw))](
        topk_indices, key_start if key_start is not None else topk_indices,
        query_pos if query_pos is not None else topk_indices, bits, s, w, nw,
        *topk_indices.stride()[:2], BW=bw, HAS_KSTART=key_start is not None,
        HAS_QPOS=query_pos is not None)
    return bits


def dense_forward(query: torch.Tensor, latent_kv: torch.Tensor, bits: torch.Tensor,
                  key_start: torch.Tensor | None, query_pos: torch.Tensor | None,
                  softmax_scale: float, v_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [s_q, b, n, v_channels], lse2 fp32 [s_q, b, n])`` of contiguous inputs, per batch row
    and query chunk: ``S = Q K^T`` (fp32), a kernel writes ``lse2`` and ``P`` (input dtype, zeros
    where unselected), then ``O = P V``."""
    s, b, n, d = query.shape
    s_kv, v = latent_kv.size(0), v_channels
    out = query.new_empty(s, b, n, v)
    lse2 = torch.empty(s, b, n, dtype=torch.float32, device=query.device)
    cfg = dict(CONFIGS["softmax"])
    cfg["BH"] = min(cfg["BH"], triton.next_power_of_2(n))
    chunks = list(_query_chunks(s, s_kv, query_pos, n * s_kv * (4 + query.element_size()),
                                S_BUFFER_BYTES))
    size = max((t1 - t0) * n * keys for t0, t1, keys in chunks)
    score_buf = torch.empty(size, dtype=torch.float32, device=query.device)
    prob_buf = torch.empty(size, dtype=query.dtype, device=query.device)
    for bi in range(b):
        for t0, t1, keys in chunks:
            r = (t1 - t0) * n
            sc, p = score_buf[:r * keys].view(r, keys), prob_buf[:r * keys].view(r, keys)
            k_c = latent_kv[:keys, bi, 0]
            _mm(query[t0:t1, bi].reshape(r, d), k_c.t(), sc)
            _softmax_kernel[(t1 - t0, triton.cdiv(n, cfg["BH"]))](
                sc, p, bits, key_start if key_start is not None else bits,
                query_pos if query_pos is not None else bits, lse2, t0, bi, s, b, n,
                bits.size(-1), keys, softmax_scale * LOG2E, HAS_KSTART=key_start is not None,
                HAS_QPOS=query_pos is not None, **cfg)
            _mm_rows(p, k_c[:, :v], out[t0:t1, bi])
    return out, lse2


def dense_backward(query: torch.Tensor, latent_kv: torch.Tensor, bits: torch.Tensor,
                  query_pos: torch.Tensor | None, out: torch.Tensor, lse2: torch.Tensor,
                  grad_out: torch.Tensor, softmax_scale: float, v_channels: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_query [s_q, b, n, d_k], grad_kv [s_kv, b, 1, d_k])`` in the input dtype, per query
    chunk: a kernel writes the chunk's ``P`` and ``dS`` ``[tokens * n, keys]`` (input dtype, as
    the products use them), then GEMMs: ``dQ = dS K``, ``dKV += dS^T Q`` and, on the value
    channels, ``+= P^T dO`` (fp32 accumulation over chunks)."""
    s, b, n, d = query.shape
    s_kv, v = latent_kv.size(0), v_channels
    do = grad_out.contiguous()
    delta = output_delta(do, out)
    grad_query = torch.empty_like(query)
    grad_kv = torch.zeros(b, s_kv, d, dtype=torch.float32, device=query.device)
    cfg = dict(CONFIGS["ds"])
    if query.dtype == torch.float32:
        cfg.update(BM=16, BN=16, BC=16, num_stages=1)
    chunks = list(_query_chunks(s, s_kv, query_pos, n * s_kv * 2 * query.element_size(),
                                DS_BUFFER_BYTES))
    for bi in range(b):
        for t0, t1, keys in chunks:
            r = (t1 - t0) * n
            p = torch.empty(r, keys, dtype=query.dtype, device=query.device)
            ds = torch.empty_like(p)
            _ds_kernel[(triton.cdiv(r, cfg["BM"]), triton.cdiv(keys, cfg["BN"]))](
                query, latent_kv, do, bits, lse2, delta, p, ds, t0, bi, s, s_kv, b, n,
                bits.size(-1), r, keys, softmax_scale, softmax_scale * LOG2E,
                *query.stride()[:3], *latent_kv.stride()[:2], *do.stride()[:3], V=v, T=d - v,
                BT=pow2(d - v), PREC="ieee" if query.dtype == torch.float32 else "tf32", **cfg)
            q_c = query[t0:t1, bi].reshape(r, d)
            k_c = latent_kv[:keys, bi, 0]
            _mm_rows(ds, k_c, grad_query[t0:t1, bi])
            accumulate_matmul(grad_kv[bi, :keys], ds.t(), q_c)
            accumulate_matmul(grad_kv[bi, :keys, :v], p.t(), do[t0:t1, bi].reshape(r, v))
    return grad_query, grad_kv.transpose(0, 1).unsqueeze(2).to(latent_kv.dtype)
