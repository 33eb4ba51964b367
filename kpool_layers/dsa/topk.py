"""Chunked, deterministic top-k selection for the DSA lightning indexer.

The indexer scores a query token ``t`` against a set of index keys ``j`` (token keys for plain DSA,
pooled keys for KPool) as

    score(t, j) = sum_h w[t, h] * act(q[t, h] . key[j])        act = ReLU or identity

and keeps, per query, the ``topk`` best keys inside the query's visible key range
``[lo[t], hi[t])`` (causal and, for packed sequences, restricted to the query's document).

Layouts (one batch row; packed THD rows are just longer rows):
    q        [t, h, d]   index queries
    keys     [n, d]      index keys (one shared key per position, MQA-like)
    weights  [t, h]      per-head weights
    lo, hi   [t] int64   visible key range of every query
    result   [t, topk] int64, the selected key indices into ``keys`` in ascending order, then
             -1 for the empty slots

Queries are processed in chunks of ``chunk_size`` (fewer where the chunk's ``[c, h, n]`` score
intermediate would exceed :data:`SCORE_BUFFER_BYTES`: :func:`score_rows`) and each chunk only scores
the keys its queries can see, so memory is ``O(min(chunk * n * h, SCORE_BUFFER_BYTES))`` and no
``[t, n]`` tensor exists.

Determinism: scores are computed in FP32 (FP64 if the inputs are FP64) and ties are broken towards
the LOWER key index by a stable descending sort, on CPU and GPU alike. ``-0.0`` is folded into
``+0.0`` first because GPU radix sorts order ``-0.0`` below ``+0.0`` while comparison sorts do not
(ReLU scoring makes exact zeros common).

Order: a selection is a set of keys (attention and the drift metrics do not depend on its order);
every backend lists it in ascending key order, which a radix-select kernel writes without a sort
(:mod:`kpool_layers.kernels.indexer_topk_triton`), so the backends return identical tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor


SCORE_BUFFER_BYTES = 1 << 30
"""Upper bound of one ``[c, h, n]`` FP32 intermediate of a query chunk's scores (1 GiB): at
``n = 131072`` keys and 32 heads a chunk holds 64 queries instead of 1024."""


def score_rows(chunk_size: int, heads: int, keys: int) -> int:
    """Queries per chunk when scoring against ``keys`` keys with ``heads`` heads (``heads = 1`` where
    no per-head intermediate exists): ``chunk_size``, or fewer so that a ``[c, heads, keys]`` FP32
    tensor stays within :data:`SCORE_BUFFER_BYTES`; at least 1."""
    return max(1, min(chunk_size, SCORE_BUFFER_BYTES // (4 * max(heads, 1) * max(keys, 1))))


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the index scores are computed in: FP32, or FP64 for FP64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def index_scores(q: Tensor, keys: Tensor, weights: Tensor, *, relu: bool) -> Tensor:
    """``score[c, j] = sum_h weights[c, h] * act(q[c, h] . keys[j])`` for q [c, h, d], keys [n, d],
    weights [c, h]; returns [c, n] in :func:`score_dtype`. Differentiable.

    Without ReLU the weights are folded into the query first (``(sum_h w_h q_h) . k``), which is the
    same sum without an ``[c, h, n]`` intermediate."""
    dtype = score_dtype(q.dtype)
    q, keys, weights = q.to(dtype), keys.to(dtype), weights.to(dtype)
    if not relu:
        return torch.einsum("chd,ch->cd", q, weights) @ keys.T
    logits = torch.relu(torch.einsum("chd,nd->chn", q, keys))  # [c, h, n]
    return torch.bmm(weights.unsqueeze(1), logits).squeeze(1)  # [c, 1, h] @ [c, h, n] -> [c, n]


EMPTY_SORT_KEY = torch.iinfo(torch.int64).max
"""Sort key of an empty (-1) slot: after every key index."""


def ascending_selection(chosen: Tensor, valid: Tensor) -> Tensor:
    """The selected indices ``chosen [..., k]`` (``valid [..., k]`` bool marks the slots that hold a
    selected key) in ascending order, then -1 for the other slots."""
    ordered = torch.where(valid, chosen, EMPTY_SORT_KEY).sort(dim=-1).values
    return torch.where(ordered == EMPTY_SORT_KEY, -1, ordered)


def topk_lower_index_ties(scores: Tensor, k: int) -> Tensor:
    """Indices [..., k] of the ``k`` largest ``scores [..., n]`` (k <= n), best first, ties broken
    towards the lower index, identically on CPU and GPU."""
    scores = scores + 0.0  # -0.0 + 0.0 == +0.0: one zero for every sort implementation
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def chunked_range_topk(
    q: Tensor,
    keys: Tensor,
    weights: Tensor,
    lo: Tensor,
    hi: Tensor,
    *,
    topk: int,
    relu: bool,
    chunk_size: int,
) -> Tensor:
    """Top-``topk`` keys of every query within its visible range ``[lo, hi)``; see the module
    docstring for layouts. Slots beyond the number of visible keys are -1. Runs without grad."""
    t = q.shape[0]
    out = torch.full((t, topk), -1, dtype=torch.long, device=q.device)
    if t == 0 or topk == 0:
        return out
    lo_host, hi_host = lo.cpu(), hi.cpu()  # one host sync for all chunk windows
    rows = score_rows(chunk_size, q.shape[1] if relu else 1, keys.shape[0])
    with torch.no_grad():
        for start in range(0, t, rows):
            end = min(start + rows, t)
            k_lo, k_hi = int(lo_host[start:end].min()), int(hi_host[start:end].max())
            width = min(topk, k_hi - k_lo)
            if width <= 0:
                continue
            cols = torch.arange(k_lo, k_hi, device=q.device)
            visible = (cols >= lo[start:end, None]) & (cols < hi[start:end, None])
            scores = index_scores(q[start:end], keys[k_lo:k_hi], weights[start:end], relu=relu)
            scores = scores.masked_fill(~visible, float("-inf"))
            chosen = topk_lower_index_ties(scores, width) + k_lo  # [c, width], best first
            count = (hi[start:end] - lo[start:end]).clamp_min(0)  # visible keys per query
            rank = torch.arange(width, device=q.device)
            out[start:end, :width] = ascending_selection(chosen, rank < count[:, None])
    return out
