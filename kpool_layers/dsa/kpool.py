"""KPool: the DSA lightning indexer over pooled index keys (see docs/kpool.md for the contract).

With ``kpool > 1`` the indexer does not score every token key. Pool ``j`` of a document covers its
tokens ``j*kpool .. j*kpool + kpool - 1``; its key is a gated softmax mixture of those token keys

    pk[j, d] = sum_m softmax_m(g[t_m, d] + ape[m, d]) * k[t_m, d]          (FP32, stored in k.dtype)

With ``dsa_indexer_rotate_activation`` the pooled keys and the queries are Hadamard-rotated after
pooling (:func:`index_keys`); the token keys are pooled unrotated.

A query at document-local position ``p`` sees the complete pools ``j < (p + 1) // kpool``, scores
them like token keys, keeps the ``topk // kpool`` best (ties -> lower pool index), expands every
pool, in ascending pool order, to its ``kpool`` tokens and pads with -1 up to ``topk`` entries
(a query that sees no pool, e.g. in a document shorter than ``kpool``, gets only -1 pools).
With ``always_select_tail`` the tokens of the query's incomplete pool,
``((p + 1) // kpool) * kpool .. p``, are appended (-1 padded to ``kpool - 1`` slots). Packed
sequences restart pooling at every document start. ``kpool == 1`` is plain DSA.

Layouts (one batch row of ``t`` tokens, packed documents back to back):
    q [t, h, d], k [t, d], gate [t, d], ape [kpool, d], weights [t, h], cu_seqlens int [n_docs + 1]
    result: int64 [t, topk] (+ kpool - 1 tail slots), token indices into the row, -1 = empty.

:func:`kpool_topk` is the plain reference of the contract; :func:`kpool_select` is the path the
layer runs (chunked PyTorch or a fused top-k kernel) and must return exactly the same indices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from kpool_layers.precision.hadamard import rotate_activation
from kpool_layers.dsa.topk import ascending_selection, index_scores, score_dtype, topk_lower_index_ties


@dataclass(frozen=True)
class PoolLayout:
    """Where the pools of one row of ``t`` tokens are and which pools each query sees.

    Pools of all documents are numbered back to back (document 0's pools first). For ``kpool == 1``
    pools are tokens. The per-query fields have one entry per query row: ``t_q = t`` rows in token
    order from :func:`pool_layout`, or the rows of :meth:`for_queries` (a context-parallel rank's
    queries, at positions ``query_pos``)."""

    kpool: int
    pool_start: Tensor  # int64 [n_pools], first token of every complete pool
    doc_start: Tensor  # int64 [t_q], first token of the query's document
    query_lo: Tensor  # int64 [t_q], first pool the query sees (its document's first pool)
    query_hi: Tensor  # int64 [t_q], one past the last complete pool the query sees
    tail_start: Tensor  # int64 [t_q], first token of the query's incomplete pool
    query_pos: Tensor  # int64 [t_q], the query's token position in the row

    @property
    def n_pools(self) -> int:
        return self.pool_start.numel()

    def for_queries(self, positions: Tensor) -> PoolLayout:
        """The layout of query rows at token ``positions`` (int64 ``[t_q]``) of a layout in token
        order; the pools are unchanged."""
        return PoolLayout(kpool=self.kpool, pool_start=self.pool_start,
                          doc_start=self.doc_start[positions], query_lo=self.query_lo[positions],
                          query_hi=self.query_hi[positions], tail_start=self.tail_start[positions],
                          query_pos=self.query_pos[positions])


def pool_layout(
    t: int, kpool: int, cu_seqlens: Optional[Tensor] = None, device: Optional[torch.device] = None
) -> PoolLayout:
    """Pools of a row of ``t`` tokens; ``cu_seqlens`` (int [n_docs + 1], last entry ``t``) marks
    packed documents, None means one document.

    The document boundaries are read to the host once, so building a layout does not wait for
    the device more than once. The layout of one document is built once per ``(t, kpool,
    device)`` and shared by every caller (its tensors are read, never written)."""
    if cu_seqlens is None:
        return _one_document_layout(t, kpool, device)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[-1] != t or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must run from 0 to the row length {t}, got {bounds}")
    return _layout(bounds, kpool, device)


@functools.lru_cache(maxsize=32)
def _one_document_layout(t: int, kpool: int, device: Optional[torch.device]) -> PoolLayout:
    """:func:`pool_layout` of one document (plain tensors even when first built under inference
    mode, so that autograd may use them)."""
    with torch.inference_mode(False):
        return _layout([0, t], kpool, device)


def _layout(bounds: list[int], kpool: int, device: Optional[torch.device]) -> PoolLayout:
    """The layout of documents at token ``bounds`` (``0 .. t``, host ints)."""
    t = bounds[-1]
    cu = torch.tensor(bounds, dtype=torch.long, device=device)
    dev = cu.device
    pools_per_doc = (cu[1:] - cu[:-1]) // kpool
    pool_cu = torch.cat([pools_per_doc.new_zeros(1), pools_per_doc.cumsum(0)])
    n_pools = sum((b - a) // kpool for a, b in zip(bounds[:-1], bounds[1:]))
    tok = torch.arange(t, device=dev)
    doc = torch.searchsorted(cu[1:], tok, right=True)  # document of every token
    local = tok - cu[doc]
    seen = (local + 1) // kpool  # complete pools visible to the query
    pool_doc = torch.repeat_interleave(torch.arange(pools_per_doc.numel(), device=dev),
                                       pools_per_doc, output_size=n_pools)
    pool_local = torch.arange(n_pools, device=dev) - pool_cu[pool_doc]
    return PoolLayout(
        kpool=kpool,
        pool_start=cu[pool_doc] + pool_local * kpool,
        doc_start=cu[doc],
        query_lo=pool_cu[doc],
        query_hi=pool_cu[doc] + seen,
        tail_start=cu[doc] + seen * kpool,
        query_pos=tok,
    )


def pool_keys(k: Tensor, gate: Tensor, ape: Tensor, layout: PoolLayout) -> Tensor:
    """Pooled keys [n_pools, d] from token keys k [t, d], gate logits gate [t, d] and the per-slot
    bias ape [kpool, d]: a max-subtracted softmax over the pool's slots per channel, computed in
    FP32 (FP64 for FP64 inputs) and returned in ``k.dtype``. Differentiable."""
    dtype = score_dtype(k.dtype)
    slots = layout.pool_start[:, None] + torch.arange(layout.kpool, device=k.device)  # [n, kpool]
    mix = torch.softmax(gate[slots].to(dtype) + ape.to(dtype), dim=1)  # [n, kpool, d]
    return (mix * k[slots].to(dtype)).sum(dim=1).to(k.dtype)


def index_keys(k: Tensor, gate: Tensor, ape: Tensor, layout: PoolLayout, *, rotate: bool) -> Tensor:
    """The keys the indexer scores, [n_pools, d] in ``k.dtype``: :func:`pool_keys` of the token keys
    ``k [t, d]`` (``k`` itself for ``kpool == 1``), then with ``rotate`` the Hadamard rotation
    :func:`kpool_layers.precision.hadamard.rotate_activation` of every pooled key. Pool first, rotate second,
    as upstream Megatron-LM's KPool indexer and SGLang's pooled-key write do: the pooling weights
    are per channel, so rotating the token keys before pooling would score other keys. Zero pools
    give ``[0, d]``. Differentiable."""
    keys = k if layout.kpool == 1 else pool_keys(k, gate, ape, layout)
    return rotate_activation(keys) if rotate else keys


def expand_pools(pools: Tensor, layout: PoolLayout) -> Tensor:
    """Pool indices [t_q, P] (-1 = none) -> their token indices [t_q, P * kpool] (-1 = none).
    A layout without pools (every document shorter than ``kpool``) has only -1 pools: all -1."""
    if layout.n_pools == 0:
        return pools.new_full((*pools.shape[:-1], pools.shape[-1] * layout.kpool), -1)
    slot = torch.arange(layout.kpool, device=pools.device)
    tokens = layout.pool_start[pools.clamp_min(0)][..., None] + slot  # [t, P, kpool]
    tokens = torch.where(pools[..., None] >= 0, tokens, -1)
    return tokens.flatten(start_dim=-2)


def tail_tokens(layout: PoolLayout) -> Tensor:
    """Tokens [t_q, kpool - 1] of every query's incomplete pool, ``tail_start .. query``, -1 padded."""
    query = layout.query_pos
    tokens = layout.tail_start[:, None] + torch.arange(layout.kpool - 1, device=query.device)
    return torch.where(tokens <= query[:, None], tokens, -1)


def _finish(pools: Tensor, layout: PoolLayout, always_select_tail: bool) -> Tensor:
    tokens = expand_pools(pools, layout)
    if always_select_tail:
        tokens = torch.cat([tokens, tail_tokens(layout)], dim=-1)
    return tokens


def kpool_topk(
    q: Tensor,
    k: Tensor,
    gate: Tensor,
    ape: Tensor,
    weights: Tensor,
    *,
    kpool: int,
    topk: int,
    always_select_tail: bool,
    relu: bool,
    cu_seqlens: Optional[Tensor] = None,
    rotate: bool = False,
) -> Tensor:
    """Reference KPool selection (the contract serving engines implement), unchunked.

    Args:
        q: [t, h, d] index queries of ``t`` packed tokens.
        k: [t, d] token index keys.
        gate: [t, d] compression gate logits.
        ape: [kpool, d] per-slot positional bias.
        weights: [t, h] per-head weights (scale included).
        kpool: tokens per pool (1 = plain DSA; gate and ape are then unused).
        topk: selected tokens per query, a multiple of ``kpool``.
        always_select_tail: append the query's incomplete pool (``kpool - 1`` slots).
        relu: ReLU on ``q . k`` before weighting.
        cu_seqlens: int [n_docs + 1] packed document boundaries; None = one document.
        rotate: ``dsa_indexer_rotate_activation``: Hadamard-rotate the queries and the pooled keys
            (after pooling, :func:`index_keys`); ``q`` and ``k`` are given unrotated.

    Returns:
        int64 [t, topk (+ kpool - 1)]: the selected pools' token indices in ascending order, -1
        padded, then the tail; -1 = empty. Rows (or whole calls) without a visible pool get -1
        pools and their tail.
    """
    with torch.no_grad():
        layout = pool_layout(q.shape[0], kpool, cu_seqlens, device=q.device)
        keys = index_keys(k, gate, ape, layout, rotate=rotate)
        q = rotate_activation(q) if rotate else q
        scores = index_scores(q, keys, weights, relu=relu)  # [t, n_pools]
        cols = torch.arange(layout.n_pools, device=q.device)
        visible = (cols >= layout.query_lo[:, None]) & (cols < layout.query_hi[:, None])
        n_sel = topk // kpool
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = topk_lower_index_ties(scores, min(n_sel, layout.n_pools))
        count = (layout.query_hi - layout.query_lo)[:, None]
        chosen = ascending_selection(chosen, torch.arange(chosen.shape[1], device=q.device) < count)
        pools = torch.full((q.shape[0], n_sel), -1, dtype=torch.long, device=q.device)
        pools[:, : chosen.shape[1]] = chosen
        return _finish(pools, layout, always_select_tail)


def kpool_select(
    q: Tensor,
    keys: Tensor,
    weights: Tensor,
    layout: PoolLayout,
    *,
    topk: int,
    always_select_tail: bool,
    relu: bool,
    range_topk: Callable[..., Tensor],
) -> Tensor:
    """The layer's selection over already pooled ``keys`` [n_pools, d] (token keys for
    ``kpool == 1``) with ``range_topk`` (:func:`kpool_layers.dsa.topk.chunked_range_topk`'s contract
    without its chunk size, e.g. ``partial(chunked_range_topk, chunk_size=1024)`` or a fused kernel
    of :mod:`kpool_layers.dsa.backends`); returns what :func:`kpool_topk` returns. Runs without
    grad."""
    pools = range_topk(
        q.detach(),
        keys.detach(),
        weights.detach(),
        layout.query_lo,
        layout.query_hi,
        topk=topk // layout.kpool,
        relu=relu,
    )
    if layout.kpool == 1:
        return pools
    with torch.no_grad():
        return _finish(pools, layout, always_select_tail)
