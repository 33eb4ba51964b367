"""KL objective that trains the DSA lightning indexer towards the main attention.

For every query the target is the main (absorbed MQA) attention distribution, summed over heads
(and over TP ranks) and normalised; the prediction is the softmax of the indexer scores over the
same keys. For ``kpool > 1`` the target is the attention mass of every visible complete pool
(summed over its tokens; the query's incomplete pool, the always-selected tail, is not a pool)
and the prediction is the softmax over pool scores. ``sparse`` restricts both to the selected keys
(pools), otherwise all causal keys of the query's document count.

Sparse target from the attention's own forward (``slot_mass``): a sparse-MLA kernel that returns
each slot's attention probability summed over heads (``dsa_kernels=triton``) already holds the
sparse target, so no second pass over the main attention is needed; it is summed over TP ranks,
per pool over its ``kpool`` slots (the tail is not a pool) and normalised exactly as the recomputed
one.

Context parallelism: the queries (``main_query``, the indexer's ``q``/``weights`` and its layout's
rows) are this CP rank's, the keys (``main_key``, the indexer's ``keys``) the whole row's. Each
rank's loss is its queries' KL summed over the mean's global denominator (all ``b * s`` rows of all
ranks): megatron's schedules scale the auxiliary loss's gradient by the CP size and DDP averages
over the data-parallel x CP ranks, so the gradient is exactly that of the whole row's mean.

Memory: queries are processed in chunks of ``config.dsa_indexer_query_chunk_size`` (fewer at long
context: :func:`kpool_layers.dsa.topk.score_rows` keeps a chunk's ``[c, heads, s]`` FP32 scores within
``SCORE_BUFFER_BYTES``); each chunk is
activation-checkpointed, so nothing of size ``[s, s]`` (or ``[s, s / kpool]``) is kept for
backward; the no-grad target of a chunk is recomputed in backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from kpool_layers.dsa.indexer import DSAIndexer, IndexerOutput
from kpool_layers.dsa.kpool import PoolLayout, pool_layout
from kpool_layers.dsa.topk import index_scores, score_dtype, score_rows

TARGET_EPS = 1e-10
"""Floor of the target's normaliser and of ``log(target)`` (megatron's INDEXER_LOSS_EPS)."""


def _masked_fill_min(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` with dropped entries at the dtype's most negative finite value (a finite stand-in for
    -inf: fully masked rows then softmax to finite values instead of NaN)."""
    return x.masked_fill(~keep, torch.finfo(x.dtype).min)


def _chunk_kl(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    main_query: Tensor,
    main_key: Tensor,
    selected: Tensor,
    layout: PoolLayout,
    start: int,
    windows: tuple[int, int, int],
    slot_mass: Optional[Tensor],
    *,
    softmax_scale: float,
    relu: bool,
    sparse: bool,
    tp_group: Optional[dist.ProcessGroup],
) -> Tensor:
    """Summed KL of query rows ``start .. start + c`` of one row.

    q [c, h, d], weights [c, h], keys [n, d] (all of the row's index keys), main_query [c, nh, dk],
    main_key [s_kv, dk], selected [c, W] token indices (-1 = none). ``windows`` = (first token,
    one past the last token, first pool, one past the last pool) any of the chunk's queries can see. ``slot_mass`` [c, W] (sparse
    only): the attention probability of every selected slot summed over all heads, which replaces
    the recomputation of the main attention."""
    c = q.shape[0]
    t_lo, t_hi, p_lo, p_hi = windows
    dev = q.device
    query = torch.arange(start, start + c, device=dev)  # rows of the layout
    if slot_mass is not None:
        with torch.no_grad():
            target, pool_ok = _target_from_slots(slot_mass, selected, layout, query, p_lo, p_hi)
        return _kl(q, weights, keys, target, pool_ok, p_lo, p_hi, relu)
    with torch.no_grad():
        tokens = torch.arange(t_lo, t_hi, device=dev)
        position = layout.query_pos[query, None]
        token_ok = (tokens >= layout.doc_start[query, None]) & (tokens <= position)  # [c, tw]
        if sparse:
            tw = tokens.numel()
            hit = torch.zeros(c, tw + 1, dtype=torch.bool, device=dev)
            hit.scatter_(1, torch.where(selected >= 0, selected - t_lo, tw), True)
            token_ok &= hit[:, :tw]
        dtype = score_dtype(main_query.dtype)
        logits = torch.einsum("cnd,td->cnt", main_query.to(dtype), main_key[t_lo:t_hi].to(dtype))
        probs = torch.softmax(_masked_fill_min(logits * softmax_scale, token_ok[:, None]), dim=-1)
        mass = (probs * token_ok[:, None]).sum(dim=1)  # [c, tw], summed over local heads
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(mass, group=tp_group)  # heads are split over TP ranks

        pools = torch.arange(p_lo, p_hi, device=dev)
        pool_ok = (pools >= layout.query_lo[query, None]) & (pools < layout.query_hi[query, None])
        # tokens of every pool in the window, as columns of the token window: [pw, kpool]
        pool_tokens = layout.pool_start[p_lo:p_hi, None] - t_lo + torch.arange(layout.kpool, device=dev)
        target = mass[:, pool_tokens].sum(dim=-1)  # [c, pw]; a gather, deterministic on GPU
        if sparse:
            pool_ok &= token_ok[:, pool_tokens].any(dim=-1)
        target = target * pool_ok
        target = target / target.sum(dim=-1, keepdim=True).clamp_min(TARGET_EPS)
    return _kl(q, weights, keys, target, pool_ok, p_lo, p_hi, relu)


def _kl(q: Tensor, weights: Tensor, keys: Tensor, target: Tensor, pool_ok: Tensor, p_lo: int,
        p_hi: int, relu: bool) -> Tensor:
    """Summed KL(target || softmax of the index scores over ``pool_ok``) of a chunk: target and
    pool_ok [c, pw] over pools ``p_lo .. p_hi``."""
    scores = index_scores(q, keys[p_lo:p_hi], weights, relu=relu)  # [c, pw]
    log_pred = torch.log_softmax(_masked_fill_min(scores, pool_ok), dim=-1)
    kl = target * (torch.log(target.clamp_min(TARGET_EPS)) - log_pred)
    return torch.where(pool_ok, kl, 0.0).sum()


def _target_from_slots(slot_mass: Tensor, selected: Tensor, layout: PoolLayout, query: Tensor,
                       p_lo: int, p_hi: int) -> tuple[Tensor, Tensor]:
    """Sparse target and pool mask [c, pw] from the attention mass of each selected slot.

    ``slot_mass`` / ``selected`` [c, W]: the first ``topk`` slots are whole pools (``kpool``
    consecutive slots each, -1 groups for none), the rest is the tail, which is not a pool. Each
    pool's mass is the sum over its slots (a fixed-order reduction), written to its column."""
    c, pw, kpool = selected.shape[0], p_hi - p_lo, layout.kpool
    n_sel = selected.shape[1] // kpool  # W = topk (+ kpool - 1 tail slots)
    groups = selected[:, : n_sel * kpool].view(c, n_sel, kpool)[..., 0]  # first token of each pool
    mass = slot_mass[:, : n_sel * kpool].reshape(c, n_sel, kpool).sum(-1)
    pool = torch.searchsorted(layout.pool_start, groups.clamp_min(0))  # pool of that first token
    visible = (groups >= 0) & (pool >= layout.query_lo[query, None]) & (pool < layout.query_hi[query, None])
    column = torch.where(visible, pool - p_lo, pw)  # pw: a dump column for empty groups
    target = torch.zeros(c, pw + 1, dtype=mass.dtype, device=mass.device)
    target.scatter_(1, column, torch.where(visible, mass, 0.0))  # unique pools per row
    pool_ok = torch.zeros(c, pw + 1, dtype=torch.bool, device=mass.device)
    pool_ok.scatter_(1, column, visible)
    target, pool_ok = target[:, :pw], pool_ok[:, :pw]
    return target / target.sum(dim=-1, keepdim=True).clamp_min(TARGET_EPS), pool_ok


def indexer_kl_loss(
    indexer: DSAIndexer,
    out: IndexerOutput,
    main_query: Tensor,
    main_key: Tensor,
    softmax_scale: float,
    *,
    sparse: bool,
    cu_seqlens: Optional[Tensor] = None,
    slot_mass: Optional[Tensor] = None,
) -> Tensor:
    """``dsa_indexer_loss_coeff * mean over queries of KL(target || softmax(indexer scores))``.

    Args:
        indexer: the layer that produced ``out`` (config, TP group).
        out: the indexer's output for this sequence.
        main_query: [s_q, b, n, d_k] the main (absorbed, MQA) attention's queries (TP-local heads;
            this CP rank's rows, ``out.layout``'s).
        main_key: [s, b, 1, d_k] the main attention's latent keys (the whole row).
        softmax_scale: the main attention's softmax scale.
        sparse: restrict target and prediction to the selected keys (pools).
        cu_seqlens: int [n_docs + 1] packed THD boundaries (b == 1); must match the indexer call
            (``out.layout`` already encodes them).
        slot_mass: fp32 [b, s_q, W] (``sparse`` only) the main attention's probability of every slot
            of ``out.topk_indices`` summed over this rank's heads, from the attention's forward;
            summed over TP here. None: recompute the main attention.

    Returns:
        Scalar loss (the mean is over all ``b * s`` query rows of the row, megatron's convention;
        under CP this rank's share of it) scaled by
        ``config.dsa_indexer_loss_coeff`` (0 when unset), with gradient to the indexer's q, weight
        and key projections, key norm, and KPool gate (and ape when trainable).
    """
    cfg = indexer.config
    if cu_seqlens is not None and main_query.shape[1] != 1:
        raise ValueError(f"packed THD input needs batch size 1, got {main_query.shape[1]}")
    main_query, main_key = main_query.detach(), main_key.detach()
    s, b = main_query.shape[:2]
    s_kv = main_key.shape[0]
    layout = out.layout
    expected = pool_layout(s_kv, layout.kpool, cu_seqlens, device=layout.doc_start.device)
    # the shared layout of one document is the indexer's own: nothing to compare (no host sync)
    if expected is not layout and not torch.equal(expected.doc_start[layout.query_pos], layout.doc_start):
        raise ValueError("cu_seqlens differ from the ones the indexer output was computed with")
    if slot_mass is not None:
        if not sparse:
            raise ValueError("slot_mass holds the sparse target only (dsa_indexer_use_sparse_loss)")
        slot_mass = slot_mass.detach().to(score_dtype(slot_mass.dtype))
        tp = indexer.tp_group
        if tp is not None and dist.get_world_size(tp) > 1:
            slot_mass = slot_mass.clone()
            dist.all_reduce(slot_mass, group=tp)  # heads are split over TP ranks
    # the dense target's [c, heads, keys] FP32 scores stay within SCORE_BUFFER_BYTES
    chunk = score_rows(cfg.dsa_indexer_query_chunk_size, max(out.q.shape[2], main_query.shape[2]), s_kv)
    doc_start, position = layout.doc_start.cpu(), layout.query_pos.cpu()
    lo, hi = layout.query_lo.cpu(), layout.query_hi.cpu()
    total = main_query.new_zeros((), dtype=score_dtype(out.q.dtype))
    for row in range(b):
        for start in range(0, s, chunk):
            end = min(start + chunk, s)
            rows = slice(start, end)
            windows = (int(doc_start[rows].min()), int(position[rows].max()) + 1,
                       int(lo[rows].min()), int(hi[rows].max()))
            if windows[3] <= windows[2]:
                continue  # no query of the chunk sees a key (pool) yet
            total = total + checkpoint(
                _chunk_kl,
                out.q[start:end, row],
                out.weights[start:end, row],
                out.keys[:, row],
                main_query[start:end, row],
                main_key[:, row, 0],
                out.topk_indices[row, start:end],
                layout,
                start,
                windows,
                None if slot_mass is None else slot_mass[row, start:end],
                softmax_scale=softmax_scale,
                relu=cfg.dsa_indexer_scoring_relu,
                sparse=sparse,
                tp_group=indexer.tp_group,
                use_reentrant=False,
            )
    return total / (b * s_kv) * (cfg.dsa_indexer_loss_coeff or 0.0)
