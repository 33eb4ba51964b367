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
ones does more FLOPs but on full tensor-core tiles, and the backward becomes dense GEMMs.

Kernels and steps:
  1. mask, grid ``(b*s_q, slot blocks)``: ``bits [b, s_q, ceil(s_kv/32)]`` int32, bit ``k % 32`` of
     word ``k // 32`` set for each valid selected key ``k`` (``atomic_or``: order-free, exact);
  2. forward, grid ``(b * query blocks, head blocks)``: a program owns ``BQ`` query tokens x ``BH``
     heads as ``BM = BQ * BH`` rows (several tokens share the key tiles: MQA), loops over the key
     blocks of ``[min key_start, max query_pos]`` of its tokens, skips blocks without a selected key,
     online softmax in fp32 (base 2); writes ``O`` and ``lse2 [s_q, b, n]`` (``+inf`` for an empty
     row) exactly as the gather forward does, so its slot-probability kernel reads them;
  3. backward, per batch row and query chunk (at least ``QUERY_CHUNKS`` chunks; ``P`` and ``dS``
     together at most ``DS_BUFFER_BYTES``): ``delta = rowsum(dO * O)`` (one kernel for all rows);
     a tile kernel recomputes ``S = Q K^T`` and ``dP = dO V^T`` and writes the chunk's
     ``P`` and ``dS = P (dP - delta) scale`` ``[tokens * n, keys]`` in the input dtype (zeros where
     unselected); then GEMMs: ``dQ = dS K``, ``dKV += dS^T Q`` and, on the value channels,
     ``dKV += P^T dO``, accumulated in fp32 over the chunks (cuBLAS with fp32 output on CUDA).
     The keys of a chunk end at its last query (the whole row with ``query_pos``).
No float atomics: outputs and gradients are bit-identical from run to run (the cuBLAS GEMMs of
fixed shapes included). Memory: the bit mask (``b * s_q * s_kv / 8`` bytes), the chunk's ``P`` and
``dS``, and an fp32 ``[b, s_kv, d_k]`` key-gradient accumulator.

Numerics as the gather kernels (fp32 softmax, P and dS rounded to the input dtype before their
products, fp32 accumulation; fp32 inputs use exact fp32 dots), except that each key's gradient is
summed in fp32 without rounding per (query, slot) partials to the input dtype first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_layers.kernels.mla_tiles_triton import (
    LOG2E, load_rows, pow2, scores, selected_slots)

DENSE_HEAD_KEYS_PER_SLOT = 256
""":func:`dense_pays` while ``s_kv * heads <= DENSE_HEAD_KEYS_PER_SLOT * W``."""

DS_BUFFER_BYTES = 1 << 29
"""Upper bound of a query chunk's ``P`` and ``dS`` buffers together (the GEMM backward)."""

QUERY_CHUNKS = 4
"""The GEMM backward splits the queries into at least this many chunks (the keys a chunk sees end
at its last query: fewer zero columns above the causal diagonal)."""


def dense_pays(s_kv: int, width: int, heads: int) -> bool:
    """Whether the contiguous-block layout is the faster one for ``s_kv`` keys, ``width`` slots and
    ``heads`` query heads: its work grows with the causal prefix (``~s_kv / 2`` keys per query),
    the gather kernels' with ``width`` but with a per-key cost that heads amortize. Measured on an
    H200 (docs/benchmarks.md, bf16, top-2048, fwd + bwd, dense / gather): 16 heads 0.19 at 4K,
    0.28 at 8K, 0.50 at 16K, 0.95 at 32K; 64 heads 0.36 at 4K, 0.59 at 8K, 1.09 at 16K; hence
    ``s_kv * heads <= 256 * W``."""
    return s_kv * heads <= DENSE_HEAD_KEYS_PER_SLOT * width


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
def _row_block(pid_q, pid_h, S, N, BQ: tl.constexpr, BH: tl.constexpr):
    """Token and head of each of the ``BQ * BH`` rows of a query block (token-major) and the rows'
    mask."""
    r = tl.arange(0, BQ * BH)
    tok = pid_q * BQ + r // BH
    head = pid_h * BH + r % BH
    return tok, head, (tok < S) & (head < N)


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
    tok, head, rmask = _row_block(pid_q, tl.program_id(1), S, N, BQ, BH)
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
def _delta_kernel(DO, O, DELTA, ROWS, V, BR: tl.constexpr, BV: tl.constexpr):
    """``DELTA[r] = sum_c DO[r, c] * O[r, c]`` in fp32 over rows ``r`` of contiguous ``[ROWS, V]``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cv = tl.arange(0, BV)
    mask = (rows < ROWS)[:, None] & (cv < V)[None, :]
    offs = rows.to(tl.int64)[:, None] * V + cv[None, :]
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(do * o, 1), mask=rows < ROWS)


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
    sel = _selected(BITS, (bi * S + tok).to(tl.int64) * NW, keys, rmask, S_KV)
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
    "fwd": dict(BM=64, BN=64, num_warps=8, num_stages=1),
    "ds": dict(BM=128, BN=128, BC=64, num_warps=8, num_stages=3),
}
"""Rows (query tokens x heads), key block and (``ds``) channel block per kernel, measured on an H200
for the 16-head proxy; the bits of the results depend on them, so a fixed table (no autotuning)
keeps runs reproducible across processes."""


def _fwd_meta(n: int, v: int, tail: int, dtype: torch.dtype) -> dict:
    """The forward's constexprs and launch arguments: ``BH`` = heads per row block (all of them
    when they fit), ``BQ`` = tokens per row block, value/tail blocks, dot precision (exact fp32 for
    fp32)."""
    cfg = dict(CONFIGS["fwd"])
    rows, bn = cfg.pop("BM"), cfg.pop("BN")
    if dtype == torch.float32:  # fp32 dots run on CUDA cores: small tiles
        rows, bn = 16, 16
    bh = min(pow2(n), rows)
    return dict(cfg, BQ=max(1, rows // bh), BH=bh, BN=bn, V=v, T=tail, BV=pow2(v), BT=pow2(tail),
                PREC="ieee" if dtype == torch.float32 else "tf32")


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
    meta = _fwd_meta(n, v_channels, d - v_channels, query.dtype)
    _fwd_kernel[(b * triton.cdiv(s, meta["BQ"]), triton.cdiv(n, meta["BH"]))](
        query, latent_kv, bits, key_start if key_start is not None else bits,
        query_pos if query_pos is not None else bits, out, lse2, s, s_kv, b, n, bits.size(-1),
        softmax_scale * LOG2E, *query.stride()[:3], *latent_kv.stride()[:2], *out.stride()[:3],
        HAS_KSTART=key_start is not None, HAS_QPOS=query_pos is not None, **meta)
    return out, lse2


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with fp32 accumulation and no rounding of the product to ``a``'s dtype:
    cuBLAS with an fp32 output for bf16/fp16 on CUDA, exact fp32 products elsewhere."""
    if a.is_cuda and a.dtype != torch.float32:
        acc += torch.mm(a, b, out_dtype=torch.float32)
    else:
        acc += a.float() @ b.float()


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
    rows = s * b * n
    delta = torch.empty(s, b, n, dtype=torch.float32, device=query.device)
    _delta_kernel[(triton.cdiv(rows, 16),)](do, out, delta, rows, v, BR=16, BV=pow2(v),
                                            num_warps=4)
    grad_query = torch.empty_like(query)
    grad_kv = torch.zeros(b, s_kv, d, dtype=torch.float32, device=query.device)
    cfg = dict(CONFIGS["ds"])
    if query.dtype == torch.float32:
        cfg.update(BM=16, BN=16, BC=16, num_stages=1)
    per_token = n * s_kv * 2 * query.element_size()
    chunk = max(1, min(triton.cdiv(s, QUERY_CHUNKS), DS_BUFFER_BYTES // per_token))
    for bi in range(b):
        for t0 in range(0, s, chunk):
            t1 = min(s, t0 + chunk)
            r = (t1 - t0) * n
            keys = s_kv if query_pos is not None else t1  # query i sees keys <= i
            p = torch.empty(r, keys, dtype=query.dtype, device=query.device)
            ds = torch.empty_like(p)
            _ds_kernel[(triton.cdiv(r, cfg["BM"]), triton.cdiv(keys, cfg["BN"]))](
                query, latent_kv, do, bits, lse2, delta, p, ds, t0, bi, s, s_kv, b, n,
                bits.size(-1), r, keys, softmax_scale, softmax_scale * LOG2E,
                *query.stride()[:3], *latent_kv.stride()[:2], *do.stride()[:3], V=v, T=d - v,
                BT=pow2(d - v), PREC="ieee" if query.dtype == torch.float32 else "tf32", **cfg)
            q_c = query[t0:t1, bi].reshape(r, d)
            k_c = latent_kv[:keys, bi, 0]
            grad_query[t0:t1, bi] = torch.mm(ds, k_c).view(t1 - t0, n, d)
            _accumulate(grad_kv[bi, :keys], ds.t(), q_c)
            _accumulate(grad_kv[bi, :keys, :v], p.t(), do[t0:t1, bi].reshape(r, v))
    return grad_query, grad_kv.transpose(0, 1).unsqueeze(2).to(latent_kv.dtype)
