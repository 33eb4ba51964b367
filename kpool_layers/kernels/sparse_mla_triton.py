"""Deterministic Triton sparse absorbed-MLA attention (DeepSeek Sparse Attention), fwd and bwd.

Same function as :func:`kpool_layers.dsa.sparse_attention.sparse_mla_attention`. Layouts:
  * ``query``        ``[s_q, b, n, d_k]`` absorbed queries, ``d_k = v_channels + tail`` (tail =
    rope dim, 0 without rope);
  * ``latent_kv``    ``[s_kv, b, 1, d_k]`` latent keys of the whole sequence, whose first
    ``v_channels`` are the value; ``s_kv >= s_q`` (``s_kv == s_q`` without ``query_pos``);
  * ``topk_indices`` int32/int64 ``[b, s_q, W]`` key positions in ``[0, s_kv)`` of the batch row,
    ``-1`` = empty slot;
  * ``key_start``    int64 ``[s_q]`` first key each query row may see (packed THD documents) or
    None (0);
  * ``query_pos``    int32/int64 ``[s_q]`` key position of each query row (its position in the full
    sequence: context parallelism's non-contiguous query rows against all keys) or None
    (``arange(s_q)``);
  * output           ``[s_q, b, n, v_channels]`` in ``query.dtype``; the latent-key gradient is
    ``[s_kv, b, 1, d_k]`` (zero on keys no query row selects).

A slot counts only if ``key_start[i] <= key <= query_pos[i]``; other slots are ignored, and a query
without a valid slot gets zero output and zero gradients. Precondition: the valid keys of one row
are unique (the indexer's top-k guarantees it); unlike the reference, duplicates are not dropped.
``query_pos`` is read through a pointer behind the ``HAS_QPOS`` constexpr: without it the kernels
compile to the plain causal form (``key <= i``). Its values are not checked (no host sync): they must lie
in ``[0, s_kv)``, like the top-k keys, since valid slots are loaded unguarded.

Two layouts (``layout=``): the gather kernels below, and for dense selections (many slots per key
of the row, few heads) the contiguous-key-block kernels of
:mod:`kpool_layers.kernels.sparse_mla_dense_triton`; ``auto`` picks by shape (``dense_pays``).

Gather kernels (one program per token ``t = batch * s_q + i``):
  1. forward, grid ``(b*s_q, head blocks)``: loop over slot blocks, scores of the gathered key
     rows accumulated over channel blocks, online softmax in fp32 (base 2), ``O += P V``; writes
     ``O`` and ``lse2 [s_q, b, n]`` (log2 units, ``+inf`` for an empty row so that recomputed
     probabilities are 0);
  2. ``delta = rowsum(dO * O)`` (fp32, one kernel for all rows:
     :func:`~kpool_layers.kernels.mla_tiles_triton.output_delta`);
  3. per query chunk, grid ``(chunk tokens, head blocks)``: loop over slot blocks, recompute
     ``P`` and ``dS = P (dO V^T - delta) scale`` as slot-major ``[slots, heads]`` tiles (``K Q^T``
     and ``V dO^T`` accumulated over channel blocks, so that no whole row lives in registers) and
     store them (input dtype, as the products use them; zeros on skipped slot blocks) into the
     chunk's ``[chunk, W, 2n]`` buffer (per slot: ``dS`` of each head, then ``P`` of each head);
  4. per query chunk, grid ``(chunk tokens x channel blocks, head blocks)``: ``dQ = dS K`` over the
     gathered key rows of one channel block, and the token's rows of ``Q`` and ``dO`` copied into
     the chunk's stacked ``[chunk, 2n, d_k]`` operand;
  5. the chunk's per-slot key-gradient rows as one batched GEMM over its tokens (cuBLAS on CUDA):
     ``partial[t] [W, d_k] = [dS | P] [W, 2n] @ [Q; dO 0] [2n, d_k]``, i.e.
     ``sum_h dS[t,h,slot] Q[t,h,:]`` plus, on the value channels, ``P[t,h,slot] dO[t,h,:]``,
     fp32 accumulation, rounded once to the input dtype;
  6. deterministic segmented reduction: the chunk's flat key ids (``batch * s_kv + key``) are
     stably sorted (invalid slots last), and one program per key adds its rows, in query order,
     into the fp32 ``dKV [b * s_kv, d_k]`` row it alone owns; chunks run in order. The programs
     span the keys the chunk can reach: up to its last token without ``query_pos``, else the
     whole key range of the chunk's batch rows (bounds from shapes only, no host sync). Rows of
     invalid slots are never read;
  7. optionally (``return_slot_probs``), grid ``(b*s_q, slot blocks)``: the probabilities of each
     slot from the final lse, summed over heads in a fixed order.
Blocks of slots that are all invalid are skipped (early queries of a causal top-k; in the forward
and gradient loops as ``CONFIGS`` says).
No float atomics anywhere, so outputs and gradients are bit-identical from run to run (the batched
GEMM of fixed shapes included). Memory is ``O(s_q * n)`` saved state plus the chunk's buffers:
``[chunk, W, d_k]`` partial rows, ``[chunk, W, 2n]`` dS and P, ``[chunk, 2n, d_k]`` stacked Q and
dO, together at most ``PARTIAL_BUFFER_BYTES`` (never ``[s_q, s_kv]``). The partial rows are stored
in the input dtype (like the reference's per-slot key gradients, which its bf16/fp16 matmuls return
rounded), halving their memory traffic for bf16/fp16; the reduction adds them in fp32.

Numerics: fp32 softmax, lse and accumulation; bf16/fp16 inputs take tensor-core dots on bf16/fp16
operands (P and dS rounded to the input dtype before their products, as in the reference); fp32
inputs use exact fp32 dots (``input_precision="ieee"``, no tf32; on a GPU these run on CUDA
cores, slowly: meant for tests). Under ``TRITON_INTERPRET=1`` (CPU) only fp32 and fp16 are right,
since the interpreter's bf16 ``tl.dot`` is wrong.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import triton
import triton.language as tl

from kpool_layers.kernels import sparse_mla_dense_triton as dense_mla
from kpool_layers.kernels.mla_tiles_triton import (
    LOG2E, load_rows, load_tile, load_tile_t, output_delta, pow2, scores, selected_slots)
from kpool_layers.dsa.sparse_attention import check_layouts

Layout = Literal["auto", "gather", "dense"]
"""Which kernels :func:`sparse_mla_triton` runs (see its docstring)."""

PARTIAL_BUFFER_BYTES = 2 << 30
"""Upper bound of the backward's per-chunk buffers together (at least one query per chunk): see
:func:`partial_bytes_per_token`."""


def partial_bytes_per_token(heads: int, width: int, d_k: int, dtype: torch.dtype) -> int:
    """Bytes of the gather backward's chunk buffers per query token, all in ``dtype``: ``W``
    partial key-gradient rows of ``d_k`` channels, ``dS`` and ``P`` (``2 heads x W``) and the
    stacked query and output-gradient rows (``2 heads x d_k``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (width * d_k + 2 * heads * width + 2 * heads * d_k) * itemsize

@triton.jit
def _fwd_kernel(Q, KV, IDX, KSTART, QPOS, O, LSE, S, B, N, W, scale_log2,
                sq_s, sq_b, sq_h, skv_s, skv_b, si_b, si_s, so_s, so_b, so_h,
                V: tl.constexpr, T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, HAS_KSTART: tl.constexpr,
                HAS_QPOS: tl.constexpr, PREC: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """Token ``t``, heads of one block: ``O [BH, V]`` and ``lse2``; grid (tokens, head blocks).

    Per slot block, the scores ``Q K^T [BH, BK]`` accumulate over channel blocks of ``BC`` (then
    the tail), so the queries and gathered keys stream through shared memory in ``[BH | BK, BC]``
    tiles; then one online-softmax step and ``O += P V`` on the whole value rows."""
    t = tl.program_id(0).to(tl.int64)
    bi = t // S
    i = t % S
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < N
    q_rows = Q + i * sq_s + bi * sq_b + heads * sq_h
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BV], tl.float32)
    cv = tl.arange(0, BV)
    for k0 in range(0, W, BK):
        keys, valid = selected_slots(IDX, KSTART, QPOS, bi, i, k0 + tl.arange(0, BK), W, si_b,
                                      si_s, HAS_KSTART, HAS_QPOS)
        if not SKIP_EMPTY or tl.max(valid.to(tl.int32), 0) > 0:
            k_rows = KV + bi * skv_b + keys * skv_s
            sc = tl.zeros([BH, BK], tl.float32)
            for c0 in range(0, V, BC):
                c = c0 + tl.arange(0, BC)
                sc += tl.dot(load_tile(q_rows, hmask, c, V), load_tile_t(k_rows, valid, c, V),
                             input_precision=PREC)
            if T > 0:
                ct = tl.arange(0, BT)
                sc += tl.dot(load_tile(q_rows + V, hmask, ct, T),
                             load_tile_t(k_rows + V, valid, ct, T), input_precision=PREC)
            sc = tl.where(valid[None, :], sc * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: p = alpha = 0
            p = tl.exp2(sc - m_ref[:, None])
            alpha = tl.exp2(m - m_ref)
            l = l * alpha + tl.sum(p, 1)
            value = load_tile(k_rows, valid, cv, V)
            acc = acc * alpha[:, None] + tl.dot(p.to(value.dtype), value, input_precision=PREC)
            m = m_new
    nonempty = l > 0.0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]
    tl.store(O + i * so_s + bi * so_b + heads[:, None] * so_h + cv[None, :],
             out.to(O.dtype.element_ty), mask=hmask[:, None] & (cv[None, :] < V))
    lse2 = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("inf"))
    tl.store(LSE + (i * B + bi) * N + heads, lse2, mask=hmask)


@triton.jit
def _grad_kernel(Q, KV, DO, IDX, KSTART, QPOS, LSE, DELTA, PDS, t0, S, B, N, W, scale,
                 scale_log2, sq_s, sq_b, sq_h, skv_s, skv_b, si_b, si_s, sdo_s, sdo_b, sdo_h,
                 V: tl.constexpr, T: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 BH: tl.constexpr, BK: tl.constexpr, HAS_KSTART: tl.constexpr,
                 HAS_QPOS: tl.constexpr, PREC: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """Token ``t0 + row`` of a chunk, heads of one block: the chunk's ``PDS [chunk, W, 2N]`` rows
    (per slot, ``dS`` of each head, then ``P``); grid (chunk tokens, head blocks).

    Slot-major tiles ``[BK, BH]``: ``S^T = K Q^T`` and ``dP^T = V dO^T`` accumulate over channel
    blocks of ``BC`` (then the tail), so the gathered key rows, the queries and the output gradients
    stream through shared memory in ``[BK | BH, BC]`` tiles instead of living in registers."""
    row = tl.program_id(0).to(tl.int64)
    t = t0 + row
    bi = t // S
    i = t % S
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < N
    lse2 = tl.load(LSE + (i * B + bi) * N + heads, mask=hmask, other=float("inf"))
    delta = tl.load(DELTA + (i * B + bi) * N + heads, mask=hmask, other=0.0)
    q_rows = Q + i * sq_s + bi * sq_b + heads * sq_h
    do_rows = DO + i * sdo_s + bi * sdo_b + heads * sdo_h
    pds_base = PDS + row * W * 2 * N + heads
    for k0 in range(0, W, BK):
        slots = k0 + tl.arange(0, BK)
        keys, valid = selected_slots(IDX, KSTART, QPOS, bi, i, slots, W, si_b, si_s, HAS_KSTART,
                                      HAS_QPOS)
        pds_rows = pds_base[None, :] + slots[:, None] * 2 * N
        pmask = hmask[None, :] & (slots[:, None] < W)
        if not SKIP_EMPTY or tl.max(valid.to(tl.int32), 0) > 0:
            k_rows = KV + bi * skv_b + keys * skv_s
            st = tl.zeros([BK, BH], tl.float32)
            dpt = tl.zeros([BK, BH], tl.float32)
            for c0 in range(0, V, BC):
                c = c0 + tl.arange(0, BC)
                k = load_tile(k_rows, valid, c, V)
                st += tl.dot(k, load_tile_t(q_rows, hmask, c, V), input_precision=PREC)
                dpt += tl.dot(k, load_tile_t(do_rows, hmask, c, V), input_precision=PREC)
            if T > 0:
                ct = tl.arange(0, BT)
                st += tl.dot(load_tile(k_rows + V, valid, ct, T),
                             load_tile_t(q_rows + V, hmask, ct, T), input_precision=PREC)
            p = tl.where(valid[:, None], tl.exp2(st * scale_log2 - lse2[None, :]), 0.0)
            ds = p * (dpt - delta[None, :]) * scale
            tl.store(pds_rows, ds.to(PDS.dtype.element_ty), mask=pmask)
            tl.store(pds_rows + N, p.to(PDS.dtype.element_ty), mask=pmask)
        else:  # the batched GEMM reads every slot
            zero = tl.zeros([BK, BH], PDS.dtype.element_ty)
            tl.store(pds_rows, zero, mask=pmask)
            tl.store(pds_rows + N, zero, mask=pmask)


@triton.jit
def _dq_kernel(Q, KV, DO, IDX, KSTART, QPOS, PDS, DQ, STACK, t0, S, N, W, V, D, sq_s, sq_b, sq_h,
               skv_s, skv_b, si_b, si_s, sdo_s, sdo_b, sdo_h, BH: tl.constexpr, BK: tl.constexpr,
               BC: tl.constexpr, HAS_KSTART: tl.constexpr, HAS_QPOS: tl.constexpr,
               PREC: tl.constexpr):
    """Token ``t0 + row`` of a chunk, heads of one block, channels ``c`` of one block:
    ``DQ[t, h, c] = sum_slot dS[t, h, slot] K[key(slot), c]`` from the chunk's stored ``dS``
    (zero on ignored slots), and the token's ``STACK [chunk, 2N, D]`` rows: ``Q[t, h, c]``, then
    ``dO[t, h, c]`` for ``c < V`` (other channels of those rows are left as they are). Grid
    (chunk tokens x channel blocks, head blocks), a token's channel blocks adjacent so that its
    ``dS`` is read from L2."""
    blocks = tl.cdiv(D, BC)
    row = (tl.program_id(0) // blocks).to(tl.int64)
    c = (tl.program_id(0) % blocks) * BC + tl.arange(0, BC)
    cmask = c < D
    t = t0 + row
    bi = t // S
    i = t % S
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < N
    tile_mask = hmask[:, None] & cmask[None, :]
    q_tile = Q + i * sq_s + bi * sq_b + heads[:, None] * sq_h + c[None, :]
    stack_tile = STACK + (row * 2 * N + heads[:, None]) * D + c[None, :]
    tl.store(stack_tile, tl.load(q_tile, mask=tile_mask), mask=tile_mask)
    vmask = hmask[:, None] & (c[None, :] < V)
    do_tile = DO + i * sdo_s + bi * sdo_b + heads[:, None] * sdo_h + c[None, :]
    tl.store(stack_tile + N * D, tl.load(do_tile, mask=vmask), mask=vmask)
    ds_rows = PDS + row * W * 2 * N + heads
    acc = tl.zeros([BH, BC], tl.float32)
    for k0 in range(0, W, BK):
        slots = k0 + tl.arange(0, BK)
        keys, valid = selected_slots(IDX, KSTART, QPOS, bi, i, slots, W, si_b, si_s, HAS_KSTART,
                                      HAS_QPOS)
        ds = tl.load(ds_rows[:, None] + slots[None, :] * 2 * N,
                     mask=hmask[:, None] & (slots[None, :] < W), other=0.0)
        k = tl.load(KV + bi * skv_b + keys[:, None] * skv_s + c[None, :],
                    mask=valid[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(ds, k, input_precision=PREC)
    tl.store(DQ + i * sq_s + bi * sq_b + heads[:, None] * sq_h + c[None, :],
             acc.to(DQ.dtype.element_ty), mask=tile_mask)


@triton.jit
def _slot_probs_kernel(Q, KV, IDX, KSTART, QPOS, LSE, PROBS, S, B, N, W, scale_log2,
                       sq_s, sq_b, sq_h, skv_s, skv_b, si_b, si_s,
                       V: tl.constexpr, T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       BH: tl.constexpr, BK: tl.constexpr, HAS_KSTART: tl.constexpr,
                       HAS_QPOS: tl.constexpr, PREC: tl.constexpr):
    """``PROBS[b, i, slot] = sum_h P[h, slot]`` from the final ``LSE``; grid (tokens, slots)."""
    t = tl.program_id(0).to(tl.int64)
    bi = t // S
    i = t % S
    slots = tl.program_id(1) * BK + tl.arange(0, BK)
    keys, valid = selected_slots(IDX, KSTART, QPOS, bi, i, slots, W, si_b, si_s, HAS_KSTART,
                                  HAS_QPOS)
    total = tl.zeros([BK], tl.float32)
    if tl.max(valid.to(tl.int32), 0) > 0:
        k, kt = load_rows(KV + bi * skv_b, keys * skv_s, valid, V, T, BV, BT)
        for h0 in range(0, N, BH):
            heads = h0 + tl.arange(0, BH)
            hmask = heads < N
            q, qt = load_rows(Q + i * sq_s + bi * sq_b, heads * sq_h, hmask, V, T, BV, BT)
            lse2 = tl.load(LSE + (i * B + bi) * N + heads, mask=hmask, other=float("inf"))
            p_t = tl.exp2(scores(k, kt, q, qt, T, PREC) * scale_log2 - lse2[None, :])
            total += tl.sum(tl.where(valid[:, None], p_t, 0.0), 1)
    tl.store(PROBS + (bi * S + i) * W + slots, total, mask=slots < W)


@triton.jit
def _dkv_reduce_kernel(PART, ORDER, SEGMENT, DKV, key0, D, BR: tl.constexpr, BD: tl.constexpr):
    """``DKV[key0 + p] += sum of PART rows ORDER[SEGMENT[p] : SEGMENT[p + 1]]`` in that order."""
    pid = tl.program_id(0)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = c < D
    start = tl.load(SEGMENT + pid)
    end = tl.load(SEGMENT + pid + 1)
    acc = tl.zeros([BD], tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        rmask = rows < end
        src = tl.load(ORDER + rows, mask=rmask, other=0)
        rows_in = tl.load(PART + src[:, None] * D + c[None, :],
                          mask=rmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(rows_in.to(tl.float32), 0)
    dst = DKV + (key0 + pid).to(tl.int64) * D + c
    tl.store(dst, tl.load(dst, mask=cmask) + acc, mask=cmask)


CONFIGS = {
    "fwd": dict(BH=64, BK=64, BC=64, num_warps=8, num_stages=3, SKIP_EMPTY=True),
    "grad": dict(BH=64, BK=128, BC=64, num_warps=8, num_stages=3, SKIP_EMPTY=True),
    "dq": dict(BH=64, BK=32, BC=64, num_warps=4, num_stages=3),
    "probs": dict(BH=32, BK=32, num_warps=8, num_stages=1),
}
"""Head block (capped at the head count), slot block, channel block (``BC``), warps and stages per
kernel (``fwd``: output and lse; ``grad``: P and dS; ``dq``: the query gradient and the stacked
operand; ``probs``: the slot probabilities); ``SKIP_EMPTY`` branches around all-invalid slot
blocks in the slot loops. Chosen for d_k = 576 bf16 on Hopper by the sweep of
``scripts/bench/sparse_mla_triton_check.py`` at 32K (docs/benchmarks.md, "Sparse MLA attention");
the bits of the results depend on BK, BH and BC, so a fixed table (no autotuning) keeps runs
reproducible across processes."""


def _meta(kernel: str, n: int, dtype: torch.dtype) -> dict:
    """Constexpr and launch arguments of ``kernel`` from ``CONFIGS``: head block capped at the head
    count, dot precision (exact fp32 for fp32 inputs, on small tiles)."""
    cfg = dict(CONFIGS[kernel])
    cfg["BH"] = min(cfg["BH"], pow2(n))
    if dtype == torch.float32:  # fp32 dots run on CUDA cores: small tiles
        cfg.update(BH=min(cfg["BH"], 16), BK=16)
        if "BC" in cfg:
            cfg["BC"] = 32
    return dict(cfg, PREC="ieee" if dtype == torch.float32 else "tf32")


def _channels(v: int, tail: int) -> dict:
    """Value/tail channel constexprs of the kernels that hold whole rows: widths and their blocks
    (powers of two >= 16, masked)."""
    return dict(V=v, T=tail, BV=pow2(v), BT=pow2(tail))


class _SparseMLATriton(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query: torch.Tensor, latent_kv: torch.Tensor, topk_indices: torch.Tensor,
                key_start: torch.Tensor | None, query_pos: torch.Tensor | None,
                softmax_scale: float, v_channels: int, slot_probs: bool, dense: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s, b, n, d = query.shape
        w = topk_indices.size(-1)
        has_start, has_qpos = key_start is not None, query_pos is not None
        start = key_start if has_start else topk_indices  # unread dummies when absent
        qpos = query_pos if has_qpos else topk_indices
        bits = None
        if dense:
            bits = dense_mla.selection_bits(topk_indices, key_start, query_pos, latent_kv.size(0))
            out, lse2 = dense_mla.dense_forward(query, latent_kv, bits, key_start, query_pos,
                                                softmax_scale, v_channels)
        else:
            out = query.new_empty(s, b, n, v_channels)
            lse2 = torch.empty(s, b, n, dtype=torch.float32, device=query.device)
            meta = dict(_meta("fwd", n, query.dtype), **_channels(v_channels, d - v_channels))
            _fwd_kernel[(b * s, triton.cdiv(n, meta["BH"]))](
                query, latent_kv, topk_indices, start, qpos, out, lse2, s, b, n, w,
                softmax_scale * LOG2E, *query.stride()[:3], *latent_kv.stride()[:2],
                *topk_indices.stride()[:2], *out.stride()[:3], HAS_KSTART=has_start,
                HAS_QPOS=has_qpos, **meta)
        probs = None
        if slot_probs:
            probs = torch.empty(b, s, w, dtype=torch.float32, device=query.device)
            meta = dict(_meta("probs", n, query.dtype), **_channels(v_channels, d - v_channels))
            _slot_probs_kernel[(b * s, triton.cdiv(w, meta["BK"]))](
                query, latent_kv, topk_indices, start, qpos, lse2, probs, s, b, n, w,
                softmax_scale * LOG2E, *query.stride()[:3], *latent_kv.stride()[:2],
                *topk_indices.stride()[:2], HAS_KSTART=has_start, HAS_QPOS=has_qpos, **meta)
            ctx.mark_non_differentiable(probs)
        ctx.save_for_backward(query, latent_kv, topk_indices, key_start, query_pos, out, lse2, bits)
        ctx.softmax_scale = softmax_scale
        ctx.v_channels = v_channels
        return out, probs

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_probs: torch.Tensor | None):  # noqa: ANN205
        query, latent_kv, topk_indices, key_start, query_pos, out, lse2, bits = ctx.saved_tensors
        scale, v = ctx.softmax_scale, ctx.v_channels
        if bits is not None:
            grad_query, grad_kv = dense_mla.dense_backward(
                query, latent_kv, bits, query_pos, out, lse2, grad_out, scale, v)
            return grad_query, grad_kv, None, None, None, None, None, None, None
        s, b, n, d = query.shape
        s_kv = latent_kv.size(0)
        w = topk_indices.size(-1)
        do = grad_out.contiguous()
        delta = output_delta(do, out)
        has_start, has_qpos = key_start is not None, query_pos is not None
        start = key_start if has_start else topk_indices
        qpos = query_pos if has_qpos else topk_indices
        strides = (*query.stride()[:3], *latent_kv.stride()[:2], *topk_indices.stride()[:2],
                   *do.stride()[:3])
        grad_query = torch.empty_like(query)
        grad_kv = torch.zeros(b * s_kv, d, dtype=torch.float32, device=query.device)
        chunk = max(1, min(b * s, PARTIAL_BUFFER_BYTES
                           // partial_bytes_per_token(n, w, d, query.dtype)))
        partial = torch.empty(chunk, w, d, dtype=query.dtype, device=query.device)
        pds = torch.empty(chunk, w, 2 * n, dtype=query.dtype, device=query.device)
        # the dq kernel fills the rows of Q and the value channels of dO; dO's tail stays 0
        stacked = torch.zeros(chunk, 2 * n, d, dtype=query.dtype, device=query.device)
        flat = topk_indices.reshape(b * s, w)
        grad_meta = dict(_meta("grad", n, query.dtype), V=v, T=d - v, BT=pow2(d - v))
        dq_meta = _meta("dq", n, query.dtype)
        for t0 in range(0, b * s, chunk):
            t1 = min(t0 + chunk, b * s)
            rows = t1 - t0
            _grad_kernel[(rows, triton.cdiv(n, grad_meta["BH"]))](
                query, latent_kv, do, topk_indices, start, qpos, lse2, delta, pds, t0, s, b, n, w,
                scale, scale * LOG2E, *strides, HAS_KSTART=has_start, HAS_QPOS=has_qpos,
                **grad_meta)
            _dq_kernel[(rows * triton.cdiv(d, dq_meta["BC"]), triton.cdiv(n, dq_meta["BH"]))](
                query, latent_kv, do, topk_indices, start, qpos, pds, grad_query, stacked, t0, s,
                n, w, v, d, *strides, HAS_KSTART=has_start, HAS_QPOS=has_qpos, **dq_meta)
            token = torch.arange(t0, t1, device=query.device)
            torch.bmm(pds[:rows], stacked[:rows], out=partial[:rows])
            # flat key ids (batch * s_kv + key) of the chunk's valid slots, invalid -> b * s_kv
            # (last); they lie in [key0, key_end): from the first key of t0's batch row to t1
            # (key <= i) or, with query_pos, to the end of t1 - 1's batch row
            lowest = key_start[token % s] if has_start else torch.zeros_like(token)
            highest = query_pos[token % s].to(torch.int64) if has_qpos else token % s
            keys = flat[t0:t1].to(torch.int64)
            valid = (keys >= lowest[:, None]) & (keys <= highest[:, None])
            flat_key = torch.where(valid, keys + (token // s * s_kv)[:, None], b * s_kv)
            key0 = t0 // s * s_kv
            key_end = ((t1 - 1) // s + 1) * s_kv if has_qpos else t1
            sorted_keys, order = torch.sort(flat_key.reshape(-1), stable=True)
            segment = torch.searchsorted(
                sorted_keys, torch.arange(key0, key_end + 1, device=query.device))
            _dkv_reduce_kernel[(key_end - key0, triton.cdiv(d, 64))](
                partial, order, segment, grad_kv, key0, d, BR=16, BD=64, num_warps=2)
        grad_kv = grad_kv.view(b, s_kv, 1, d).transpose(0, 1).to(latent_kv.dtype)
        return grad_query, grad_kv, None, None, None, None, None, None, None


def sparse_mla_triton(query: torch.Tensor, latent_kv: torch.Tensor, topk_indices: torch.Tensor,
                      softmax_scale: float, *, v_channels: int,
                      key_start: torch.Tensor | None = None,
                      query_pos: torch.Tensor | None = None, return_slot_probs: bool = False,
                      layout: Layout = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``query [s_q, b, n, d_k]`` over its selected latent keys
    ``latent_kv [s_kv, b, 1, d_k]`` (Triton).

    See the module docstring for layouts, masking (query row ``i`` sits at key position
    ``query_pos[i]``, default ``i``) and the unique-keys precondition. Returns
    ``[s_q, b, n, v_channels]`` in ``query.dtype``; differentiable in ``query`` and ``latent_kv``,
    deterministically. Any ``n``, ``W``, ``v_channels`` and tail width work (channel and head
    blocks are padded to powers of two >= 16 and masked).

    With ``return_slot_probs`` also returns, without grad, the attention probability of each slot
    summed over the heads, fp32 ``[b, s_q, W]`` (0 on ignored slots; each row sums to ``n``, or 0
    for a query without a valid key): the target of the indexer's KL loss.

    ``layout`` picks the kernels: ``gather`` (this module's, work per selected key), ``dense``
    (:mod:`kpool_layers.kernels.sparse_mla_dense_triton`, contiguous key blocks of each query
    block's causal span masked by the selection) or ``auto``:
    :func:`~kpool_layers.kernels.sparse_mla_dense_triton.dense_pays` for these shapes. Both are
    deterministic; their bits differ (other summation orders).
    """
    check_layouts(query, latent_kv, topk_indices, key_start, query_pos)
    s, b, n, d = query.shape
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype must be fp32, fp16 or bf16, got {query.dtype}")
    if latent_kv.dtype != query.dtype:
        raise ValueError(f"latent_kv must be {query.dtype} like query, got {latent_kv.dtype}")
    if topk_indices.size(2) < 1:
        raise ValueError(f"topk_indices must be [{b}, {s}, W >= 1], got {list(topk_indices.shape)}")
    if topk_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_indices must be int32 or int64, got {topk_indices.dtype}")
    if query_pos is not None and query_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_pos must be int64 (or int32) [{s}], got {query_pos.dtype}")
    if not 0 < v_channels <= d:
        raise ValueError(f"v_channels={v_channels} must be in (0, d_k={d}]")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if layout not in get_args(Layout):
        raise ValueError(f"layout must be one of {get_args(Layout)}, got {layout!r}")
    dense = layout == "dense" or (
        layout == "auto" and dense_mla.dense_pays(latent_kv.size(0), topk_indices.size(2), n))
    out, probs = _SparseMLATriton.apply(
        query.contiguous(), latent_kv.contiguous(), topk_indices.contiguous(),
        None if key_start is None else key_start.contiguous(),
        None if query_pos is None else query_pos.contiguous(), softmax_scale, v_channels,
        return_slot_probs, dense)
    return (out, probs) if return_slot_probs else out
