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
causal prefix, visiting every key of the prefix in contiguous blocks and masking the unselected
ones does more FLOPs but on full tensor-core tiles with coalesced loads, and the latent-key
gradient is summed by the program that owns a key block (no partial buffer, no sort).

Kernels:
  1. mask, grid ``(b*s_q, slot blocks)``: ``bits [b, s_q, ceil(s_kv/32)]`` int32, bit ``k % 32`` of
     word ``k // 32`` set for each valid selected key ``k`` (``atomic_or``: order-free, exact);
  2. forward, grid ``(b * query blocks, head blocks)``: a program owns ``BQ`` query tokens x ``BH``
     heads as ``BM = BQ * BH`` rows (several tokens share the key tiles: MQA), loops over the key
     blocks of ``[min key_start, max query_pos]`` of its tokens, skips blocks without a selected key,
     online softmax in fp32 (base 2); writes ``O`` and ``lse2 [s_q, b, n]`` (``+inf`` for an empty
     row) exactly as the gather forward does, so its slot-probability kernel reads them;
  3. dQ, same grid and loop: ``delta = rowsum(dO * O)``, recomputed ``P``, ``dQ = dS K``;
  4. dKV, grid ``(b * key blocks, splits)``: a program owns ``BN`` keys and sums, over the query
     rows of its split in a fixed order, ``dS^T Q (+ P^T dO on the value channels)``; with one
     split it writes ``dKV`` in the input dtype, else fp32 partials that are summed over the splits
     (a fixed-order ``sum``). The split count depends on shapes only (:func:`_dkv_splits`).
No float atomics: outputs and gradients are bit-identical from run to run. Memory: the bit mask
(``b * s_q * s_kv / 8`` bytes) and, with splits, ``splits * b * s_kv * d_k`` fp32.

Numerics as the gather kernels (fp32 softmax and accumulation, P and dS rounded to the input dtype
before their products; fp32 inputs use exact fp32 dots), except that each key's gradient is summed
in fp32 without rounding per (query, slot) partials to the input dtype first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.mla_tiles_triton import LOG2E, load_rows, load_value_rows, pow2, scores

DENSE_HEAD_KEYS_PER_SLOT = 64
""":func:`dense_pays` while ``s_kv * heads <= DENSE_HEAD_KEYS_PER_SLOT * W``."""

DKV_TARGET_PROGRAMS = 512
"""The dKV kernel splits the query rows until it has about this many programs (shapes only)."""


def dense_pays(s_kv: int, width: int, heads: int) -> bool:
    """Whether the contiguous-block layout is the faster one for ``s_kv`` keys, ``width`` slots and
    ``heads`` query heads: its work grows with the causal prefix (``~s_kv / 2`` keys per query),
    the gather kernels' with ``width`` but with a per-key cost that heads amortize. Measured on an
    H200 (docs/benchmarks.md, bf16, top-2048, fwd + bwd): 16 heads dense / gather 0.44 at 4K,
    0.74 at 8K, 1.43 at 16K; 64 heads 1.06 at 4K, 1.78 at 8K; hence ``s_kv * heads <= 64 * W``."""
    return s_kv * heads <= DENSE_HEAD_KEYS_PER_SLOT * width


@triton.jit
def _mask_kernel(IDX, KSTART, QPOS, BITS, S, W, NW, si_b, si_s, BW: tl.constexpr,
                 HAS_KSTART: tl.constexpr, HAS_QPOS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    bi = t // S
    i = t % S
    slots = tl.program_id(1) * BW + tl.arange(0, BW)
    keys = tl.load(IDX + bi * si_b + i * si_s + slots, mask=slots < W, other=-1).to(tl.int64)
    if HAS_KSTART:
        lowest = tl.load(KSTART + i).to(tl.int64)
    else:
        lowest = 0
    if HAS_QPOS:
        highest = tl.load(QPOS + i).to(tl.int64)
    else:
        highest = i
    valid = (keys >= lowest) & (keys <= highest) & (slots < W)
    keys = tl.where(valid, keys, 0)
    bit = tl.full([BW], 1, tl.int32) << (keys & 31).to(tl.int32)
    tl.atomic_or(BITS + t * NW + (keys >> 5), bit, mask=valid)


@triton.jit
def _row_block(pid_q, pid_h, S, N, BQ: tl.constexpr, BH: tl.constexpr):
    """Token and head of each of the ``BQ * BH`` rows of a query block (token-major) and their
    masks."""
    r = tl.arange(0, BQ * BH)
    tok = pid_q * BQ + r // BH
    head = pid_h * BH + r % BH
    return tok, head, tok < S, (tok < S) & (head < N)


@triton.jit
def _key_span(KSTART, QPOS, q0, S, BQ: tl.constexpr, BN: tl.constexpr,
              HAS_KSTART: tl.constexpr, HAS_QPOS: tl.constexpr):
    """First key block start and last key (inclusive) any token of ``[q0, q0 + BQ)`` may see."""
    toks = tl.minimum(q0 + tl.arange(0, BQ), S - 1)  # past the end: repeat the last token
    if HAS_KSTART:
        lo = tl.min(tl.load(KSTART + toks).to(tl.int64), 0)
    else:
        lo = (q0 * 0).to(tl.int64)
    if HAS_QPOS:
        hi = tl.max(tl.load(QPOS + toks).to(tl.int64), 0)
    else:
        hi = tl.max(toks, 0).to(tl.int64)
    return (lo // BN) * BN, hi


@triton.jit
def _selected(BITS, row_word, keys, rmask, S_KV):
    """``[rows, keys]`` whether row (its ``BITS`` word offset ``row_word``) selected ``keys``."""
    kmask = keys < S_KV
    words = tl.load(BITS + row_word[:, None] + (keys >> 5)[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0)
    return ((words >> (keys & 31).to(tl.int32)[None, :]) & 1) != 0


@triton.jit
def _fwd_kernel(Q, KV, BITS, KSTART, QPOS, O, LSE, S, S_KV, B, N, NW, scale_log2,
                sq_s, sq_b, sq_h, skv_s, skv_b, so_s, so_b, so_h,
                V: tl.constexpr, T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                BQ: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, HAS_KSTART: tl.constexpr,
                HAS_QPOS: tl.constexpr, PREC: tl.constexpr):
    bi = tl.program_id(0) % B
    pid_q = tl.program_id(0) // B
    tok, head, tmask, rmask = _row_block(pid_q, tl.program_id(1), S, N, BQ, BH)
    q, qt = load_rows(Q + bi * sq_b, tok * sq_s + head * sq_h, rmask, V, T, BV, BT)
    row_word = (bi * S + tok).to(tl.int64) * NW
    n_lo, hi = _key_span(KSTART, QPOS, pid_q * BQ, S, BQ, BN, HAS_KSTART, HAS_QPOS)
    m = tl.full([BQ * BH], float("-inf"), tl.float32)
    l = tl.zeros([BQ * BH], tl.float32)
    acc = tl.zeros([BQ * BH, BV], tl.float32)
    for n0 in range(n_lo, hi + 1, BN):
        keys = n0 + tl.arange(0, BN)
        sel = _selected(BITS, row_word, keys, rmask, S_KV)
        if tl.max(tl.max(sel.to(tl.int32), 1), 0) > 0:
            k, kt = load_rows(KV + bi * skv_b, keys * skv_s, keys < S_KV, V, T, BV, BT)
            sc = tl.where(sel, scores(q, qt, k, kt, T, PREC) * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(sc - m_ref[:, None])
            alpha = tl.exp2(m - m_ref)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PREC)
            m = m_new
    nonempty = l > 0.0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]
    cv = tl.arange(0, BV)
    tl.store(O + tok[:, None] * so_s + bi * so_b + head[:, None] * so_h + cv[None, :],
             out.to(O.dtype.element_ty), mask=rmask[:, None] & (cv[None, :] < V))
    lse2 = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("inf"))
    tl.store(LSE + (tok * B + bi) * N + head, lse2, mask=rmask)


@triton.jit
def _dq_kernel(Q, KV, DO, O, BITS, KSTART, QPOS, LSE, DELTA, DQ, S, S_KV, B, N, NW, scale,
               scale_log2, sq_s, sq_b, sq_h, skv_s, skv_b, sdo_s, sdo_b, sdo_h, so_s, so_b, so_h,
               V: tl.constexpr, T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
               BQ: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, HAS_KSTART: tl.constexpr,
               HAS_QPOS: tl.constexpr, PREC: tl.constexpr):
    bi = tl.program_id(0) % B
    pid_q = tl.program_id(0) // B
    tok, head, tmask, rmask = _row_block(pid_q, tl.program_id(1), S, N, BQ, BH)
    q, qt = load_rows(Q + bi * sq_b, tok * sq_s + head * sq_h, rmask, V, T, BV, BT)
    do = load_value_rows(DO + bi * sdo_b, tok * sdo_s + head * sdo_h, rmask, V, BV)
    o = load_value_rows(O + bi * so_b, tok * so_s + head * so_h, rmask, V, BV)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    stat = (tok * B + bi) * N + head
    tl.store(DELTA + stat, delta, mask=rmask)
    lse2 = tl.load(LSE + stat, mask=rmask, other=float("inf"))
    row_word = (bi * S + tok).to(tl.int64) * NW
    n_lo, hi = _key_span(KSTART, QPOS, pid_q * BQ, S, BQ, BN, HAS_KSTART, HAS_QPOS)
    dq = tl.zeros([BQ * BH, BV], tl.float32)
    dqt = tl.zeros([BQ * BH, BT], tl.float32)
    for n0 in range(n_lo, hi + 1, BN):
        keys = n0 + tl.arange(0, BN)
        sel = _selected(BITS, row_word, keys, rmask, S_KV)
        if tl.max(tl.max(sel.to(tl.int32), 1), 0) > 0:
            k, kt = load_rows(KV + bi * skv_b, keys * skv_s, keys < S_KV, V, T, BV, BT)
            p = tl.where(sel, tl.exp2(scores(q, qt, k, kt, T, PREC) * scale_log2 - lse2[:, None]),
                         0.0)
            dp = tl.dot(do, tl.trans(k), input_precision=PREC)
            ds = (p * (dp - delta[:, None]) * scale).to(k.dtype)
            dq += tl.dot(ds, k, input_precision=PREC)
            if T > 0:
                dqt += tl.dot(ds, kt, input_precision=PREC)
    cv = tl.arange(0, BV)
    ct = tl.arange(0, BT)
    base = DQ + tok[:, None] * sq_s + bi * sq_b + head[:, None] * sq_h
    tl.store(base + cv[None, :], dq.to(DQ.dtype.element_ty),
             mask=rmask[:, None] & (cv[None, :] < V))
    tl.store(base + V + ct[None, :], dqt.to(DQ.dtype.element_ty),
             mask=rmask[:, None] & (ct[None, :] < T))


@triton.jit
def _dkv_kernel(Q, KV, DO, BITS, LSE, DELTA, OUT, S, S_KV, B, N, NW, rows_per_split, scale,
                scale_log2, sq_s, sq_b, sq_h, skv_s, skv_b, sdo_s, sdo_b, sdo_h,
                so_split, so_s, so_b,
                V: tl.constexpr, T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                BQ: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, CAUSAL_ROWS: tl.constexpr,
                PREC: tl.constexpr):
    bi = tl.program_id(0) % B
    n0 = (tl.program_id(0) // B) * BN
    split = tl.program_id(1)
    keys = n0 + tl.arange(0, BN)
    kmask = keys < S_KV
    k, kt = load_rows(KV + bi * skv_b, keys * skv_s, kmask, V, T, BV, BT)
    t_lo = split * rows_per_split
    t_hi = tl.minimum(t_lo + rows_per_split, S)
    if CAUSAL_ROWS:  # query i sees keys <= i: rows before the block select none of its keys
        t_lo = tl.maximum(t_lo, (n0 // BQ) * BQ)
    dk = tl.zeros([BN, BV], tl.float32)
    dkt = tl.zeros([BN, BT], tl.float32)
    r = tl.arange(0, BQ * BH)
    for t0 in range(t_lo, t_hi, BQ):
        tok = t0 + r // BH
        tmask = tok < t_hi
        row_word = (bi * S + tok).to(tl.int64) * NW
        sel_t = tl.trans(_selected(BITS, row_word, keys, tmask, S_KV))  # [BN, BM]
        if tl.max(tl.max(sel_t.to(tl.int32), 1), 0) > 0:
            for h0 in range(0, N, BH):
                head = h0 + r % BH
                rmask = tmask & (head < N)
                q, qt = load_rows(Q + bi * sq_b, tok * sq_s + head * sq_h, rmask, V, T, BV, BT)
                do = load_value_rows(DO + bi * sdo_b, tok * sdo_s + head * sdo_h, rmask, V, BV)
                stat = (tok * B + bi) * N + head
                lse2 = tl.load(LSE + stat, mask=rmask, other=float("inf"))
                delta = tl.load(DELTA + stat, mask=rmask, other=0.0)
                p_t = tl.exp2(scores(k, kt, q, qt, T, PREC) * scale_log2 - lse2[None, :])
                p_t = tl.where(sel_t & rmask[None, :], p_t, 0.0)
                dp_t = tl.dot(k, tl.trans(do), input_precision=PREC)
                ds_t = (p_t * (dp_t - delta[None, :]) * scale).to(q.dtype)
                dk += tl.dot(ds_t, q, input_precision=PREC)
                dk += tl.dot(p_t.to(q.dtype), do, input_precision=PREC)
                if T > 0:
                    dkt += tl.dot(ds_t, qt, input_precision=PREC)
    cv = tl.arange(0, BV)
    ct = tl.arange(0, BT)
    base = OUT + split * so_split + keys[:, None] * so_s + bi * so_b
    tl.store(base + cv[None, :], dk.to(OUT.dtype.element_ty),
             mask=kmask[:, None] & (cv[None, :] < V))
    tl.store(base + V + ct[None, :], dkt.to(OUT.dtype.element_ty),
             mask=kmask[:, None] & (ct[None, :] < T))


CONFIGS = {
    "fwd": dict(BM=64, BN=64, num_warps=8, num_stages=1),
    "dq": dict(BM=32, BN=64, num_warps=8, num_stages=1),
    "dkv": dict(BM=32, BN=32, num_warps=8, num_stages=1),
}
"""Rows (query tokens x heads) and key block per kernel; the bits of the results depend on them,
so a fixed table (no autotuning) keeps runs reproducible across processes."""


def _meta(kernel: str, n: int, v: int, tail: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch arguments: ``BH`` = heads per row block (all of them when they fit),
    ``BQ`` = tokens per row block, value/tail blocks, dot precision (exact fp32 for fp32)."""
    cfg = dict(CONFIGS[kernel])
    rows, bn = cfg.pop("BM"), cfg.pop("BN")
    if dtype == torch.float32:  # fp32 dots run on CUDA cores: small tiles
        rows, bn = 16, 16
    bh = min(pow2(n), rows)
    return dict(cfg, BQ=max(1, rows // bh), BH=bh, BN=bn, V=v, T=tail, BV=pow2(v), BT=pow2(tail),
                PREC="ieee" if dtype == torch.float32 else "tf32")


def _dkv_splits(b: int, s_q: int, s_kv: int, bn: int, bq: int) -> tuple[int, int]:
    """(splits, query rows per split) of the dKV kernel: about ``DKV_TARGET_PROGRAMS`` programs."""
    blocks = b * triton.cdiv(s_kv, bn)
    splits = max(1, min(triton.cdiv(DKV_TARGET_PROGRAMS, blocks), triton.cdiv(s_q, 4 * bq)))
    rows = triton.cdiv(triton.cdiv(s_q, splits), bq) * bq
    return triton.cdiv(s_q, rows), rows


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
    """``(out [s_q, b, n, v_channels], lse2 fp32 [s_q, b, n])`` of contiguous inputs."""
    s, b, n, d = query.shape
    s_kv = latent_kv.size(0)
    out = query.new_empty(s, b, n, v_channels)
    lse2 = torch.empty(s, b, n, dtype=torch.float32, device=query.device)
    meta = _meta("fwd", n, v_channels, d - v_channels, query.dtype)
    _fwd_kernel[(b * triton.cdiv(s, meta["BQ"]), triton.cdiv(n, meta["BH"]))](
        query, latent_kv, bits, key_start if key_start is not None else bits,
        query_pos if query_pos is not None else bits, out, lse2, s, s_kv, b, n, bits.size(-1),
        softmax_scale * LOG2E, *query.stride()[:3], *latent_kv.stride()[:2], *out.stride()[:3],
        HAS_KSTART=key_start is not None, HAS_QPOS=query_pos is not None, **meta)
    return out, lse2


def dense_backward(query: torch.Tensor, latent_kv: torch.Tensor, bits: torch.Tensor,
                   key_start: torch.Tensor | None, query_pos: torch.Tensor | None,
                   out: torch.Tensor, lse2: torch.Tensor, grad_out: torch.Tensor,
                   softmax_scale: float, v_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_query [s_q, b, n, d_k], grad_kv [s_kv, b, 1, d_k])`` in the input dtype."""
    s, b, n, d = query.shape
    s_kv = latent_kv.size(0)
    v, nw = v_channels, bits.size(-1)
    do = grad_out.contiguous()
    delta = torch.empty(s, b, n, dtype=torch.float32, device=query.device)
    grad_query = torch.empty_like(query)
    meta = _meta("dq", n, v, d - v, query.dtype)
    _dq_kernel[(b * triton.cdiv(s, meta["BQ"]), triton.cdiv(n, meta["BH"]))](
        query, latent_kv, do, out, bits, key_start if key_start is not None else bits,
        query_pos if query_pos is not None else bits, lse2, delta, grad_query, s, s_kv, b, n, nw,
        softmax_scale, softmax_scale * LOG2E, *query.stride()[:3], *latent_kv.stride()[:2],
        *do.stride()[:3], *out.stride()[:3], HAS_KSTART=key_start is not None,
        HAS_QPOS=query_pos is not None, **meta)
    meta = _meta("dkv", n, v, d - v, query.dtype)
    splits, rows = _dkv_splits(b, s, s_kv, meta["BN"], meta["BQ"])
    if splits == 1:
        target = torch.empty_like(latent_kv)
        strides = (0, *target.stride()[:2])
    else:
        target = torch.empty(splits, s_kv, b, d, dtype=torch.float32, device=query.device)
        strides = target.stride()[:3]
    _dkv_kernel[(b * triton.cdiv(s_kv, meta["BN"]), splits)](
        query, latent_kv, do, bits, lse2, delta, target, s, s_kv, b, n, nw, rows, softmax_scale,
        softmax_scale * LOG2E, *query.stride()[:3], *latent_kv.stride()[:2], *do.stride()[:3],
        *strides, CAUSAL_ROWS=query_pos is None, **meta)
    if splits == 1:
        return grad_query, target
    return grad_query, target.sum(0).unsqueeze(2).to(latent_kv.dtype)
