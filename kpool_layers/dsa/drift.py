"""Top-k drift metrics: how far the training indexer's selections are from a reference (the
serving engine's, or an FP32/BF16 re-run of the indexer).

Inputs
------
* ``train_idx`` S and ``ref_idx`` R: int64 ``[b, s, W]`` selected key positions per query, ``-1``
  = empty slot. Each row is a set (no repeated positions besides ``-1``), as top-k produces.
* Scores (optional): ``[b, s, sk]`` floating rows (any query chunk), masked entries ``-inf``.

Per query q with ``I = |S_q ∩ R_q|``: overlap ``I / |R_q|``, Jaccard ``I / |S_q ∪ R_q|``, exact
``S_q == R_q``. Queries with ``|R_q| = 0`` are left out of every mean. Memory is
``O(b * s * W)`` (sort + binary search, never ``W x W`` or ``s x s``); only the score metrics read
``[..., sk]`` score rows, which :class:`ScoreDrift` takes chunk by chunk.

Every metric is a 0-d FP32 tensor on the input's device, so a dict of them can be all-reduced
(:func:`reduce_drift_metrics`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from kpool_layers.dsa.topk import EMPTY_SORT_KEY, ascending_selection


def _sorted_sets(idx: torch.Tensor) -> torch.Tensor:
    """Rows sorted ascending with empty slots (``-1``) mapped to ``EMPTY_SORT_KEY`` at the end."""
    return torch.where(idx < 0, EMPTY_SORT_KEY, idx).sort(dim=-1).values


def intersection_sizes(train_idx: torch.Tensor, ref_idx: torch.Tensor) -> torch.Tensor:
    """``|S_q ∩ R_q|`` per query: ``[b, s, W]`` x ``[b, s, W']`` -> int64 ``[b, s]``."""
    if train_idx.shape[:-1] != ref_idx.shape[:-1]:
        raise ValueError(f"selections differ in [b, s]: {tuple(train_idx.shape)} vs {tuple(ref_idx.shape)}")
    s_sorted = _sorted_sets(train_idx).contiguous()
    r = ref_idx.contiguous()
    pos = torch.searchsorted(s_sorted, r.clamp(min=0)).clamp(max=s_sorted.shape[-1] - 1)
    hit = (s_sorted.gather(-1, pos) == r) & (r >= 0)
    return hit.sum(dim=-1)


def _valid_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``valid`` entries (0 when none), FP32 0-d."""
    n = valid.sum()
    return torch.where(n > 0, (x.float() * valid).sum() / n.clamp(min=1), torch.zeros((), device=x.device))


def _dedupe(idx: torch.Tensor) -> torch.Tensor:
    """Distinct values of each row, ascending, ``-1`` padded: ``[..., W]`` -> same shape."""
    s = _sorted_sets(idx)
    repeat = torch.zeros_like(s, dtype=torch.bool)
    repeat[..., 1:] = s[..., 1:] == s[..., :-1]
    return ascending_selection(s, ~repeat)


def pool_ids(idx: torch.Tensor, kpool: int, tail: int = 0) -> torch.Tensor:
    """Pool sets of an expanded KPool selection: ``[b, s, W]`` token positions (the last ``tail``
    columns are the query's own incomplete-pool tokens and are dropped) -> ``[b, s, W - tail]``
    distinct pool ids ``token // kpool`` per row, ``-1`` padded."""
    body = idx[..., : idx.shape[-1] - tail]
    return _dedupe(torch.where(body < 0, -1, body // kpool))


def topk_drift(
    train_idx: torch.Tensor,
    ref_idx: torch.Tensor,
    *,
    kpool: int = 1,
    tail: int = 0,
    mismatch_threshold: float = 0.8,
    train_scores: Optional[torch.Tensor] = None,
    ref_scores: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Drift of the selection ``train_idx`` from ``ref_idx`` (both ``[b, s, W]``, -1 = empty).

    Returns 0-d FP32 tensors:

    * ``topk_overlap`` - mean over queries of ``|S ∩ R| / |R|``;
    * ``topk_exact_rows`` - fraction of queries with ``S == R`` as sets;
    * ``topk_mismatch_frac`` - fraction of queries with overlap ``< mismatch_threshold``;
    * ``topk_jaccard`` - mean of ``|S ∩ R| / |S ∪ R|``;
    * ``pool_overlap`` (``kpool > 1``) - ``topk_overlap`` of the pool sets (:func:`pool_ids`,
      ``tail`` trailing columns excluded);
    * ``score_rel_err`` (both score tensors given, ``[b, s, sk]``) - :func:`score_rel_err`.
    """
    inter = intersection_sizes(train_idx, ref_idx)
    size_s = (train_idx >= 0).sum(dim=-1)
    size_r = (ref_idx >= 0).sum(dim=-1)
    valid = size_r > 0
    overlap = inter / size_r.clamp(min=1)
    union = size_s + size_r - inter
    out = {
        "topk_overlap": _valid_mean(overlap, valid),
        "topk_exact_rows": _valid_mean((inter == size_r) & (inter == size_s), valid),
        "topk_mismatch_frac": _valid_mean(overlap < mismatch_threshold, valid),
        "topk_jaccard": _valid_mean(inter / union.clamp(min=1), valid),
    }
    if kpool > 1:
        ps, pr = pool_ids(train_idx, kpool, tail), pool_ids(ref_idx, kpool, tail)
        pool_r = (pr >= 0).sum(dim=-1)
        out["pool_overlap"] = _valid_mean(intersection_sizes(ps, pr) / pool_r.clamp(min=1), pool_r > 0)
    if (train_scores is None) != (ref_scores is None):
        raise ValueError("score_rel_err needs both train_scores and ref_scores")
    if train_scores is not None and ref_scores is not None:
        out["score_rel_err"] = score_rel_err(train_scores, ref_scores)
    return out


def _score_sums(train_scores: torch.Tensor, ref_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 ``(sum (s_train - s_ref)^2, sum s_ref^2)`` over entries finite in both (masked entries
    are ``-inf``)."""
    if train_scores.shape != ref_scores.shape:
        raise ValueError(f"score shapes differ: {tuple(train_scores.shape)} vs {tuple(ref_scores.shape)}")
    t, r = train_scores.float(), ref_scores.float()
    valid = torch.isfinite(t) & torch.isfinite(r)
    return torch.where(valid, t - r, 0.0).square().sum(), torch.where(valid, r, 0.0).square().sum()


def _rel_err(diff_sq: torch.Tensor, ref_sq: torch.Tensor) -> torch.Tensor:
    """``sqrt(diff_sq) / sqrt(ref_sq)``; 0 when ``ref_sq`` is 0."""
    ref = ref_sq.sqrt()
    return torch.where(ref > 0, diff_sq.sqrt() / ref.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(ref))


def _tie_counts(ref_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(queries whose k-th and (k+1)-th largest scores are equal, queries with k + 1 finite
    scores)`` of ``ref_scores [..., sk]``, FP32 0-d each."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    zero = torch.zeros((), device=ref_scores.device)
    if ref_scores.shape[-1] <= k:
        return zero, zero
    top = ref_scores.float().topk(k + 1, dim=-1).values
    kth, next_ = top[..., k - 1], top[..., k]
    valid = torch.isfinite(next_)
    return ((kth == next_) & valid).sum().float(), valid.sum().float()


def _ratio(count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return torch.where(total > 0, count / total.clamp(min=1), torch.zeros_like(total))


def score_rel_err(train_scores: torch.Tensor, ref_scores: torch.Tensor) -> torch.Tensor:
    """``||s_train - s_ref||_2 / ||s_ref||_2`` over entries finite in both (masked entries are
    ``-inf``), computed in FP32; 0 when the reference norm is 0. Any equal shapes."""
    return _rel_err(*_score_sums(train_scores, ref_scores))


def boundary_tie_frac(ref_scores: torch.Tensor, k: int) -> torch.Tensor:
    """Fraction of queries whose k-th and (k+1)-th largest reference scores are equal (the top-k
    set is then decided by tie-breaking alone): ``ref_scores [b, s, sk]`` (a query chunk; masked
    entries ``-inf``) -> 0-d FP32. Queries with fewer than ``k + 1`` finite scores cannot tie at
    the boundary and are left out of the mean."""
    return _ratio(*_tie_counts(ref_scores, k))


class ScoreDrift:
    """:func:`score_rel_err` and :func:`boundary_tie_frac` over score rows passed chunk by chunk
    (:meth:`add`; any split of the same rows gives the same metrics up to FP32 summation order),
    so no ``[s, sk]`` score tensor needs to exist."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k = k
        self._sums = torch.zeros(4, device=device)  # diff^2, ref^2, ties, tie-able queries

    def add(self, train_scores: torch.Tensor, ref_scores: torch.Tensor) -> None:
        """One chunk of rows: ``[..., sk]`` each, equal shapes."""
        self._sums += torch.stack([*_score_sums(train_scores, ref_scores), *_tie_counts(ref_scores, self.k)])

    def result(self) -> dict[str, torch.Tensor]:
        diff_sq, ref_sq, ties, total = self._sums.unbind()
        return {"score_rel_err": _rel_err(diff_sq, ref_sq), "boundary_tie_frac": _ratio(ties, total)}


def reduce_drift_metrics(
    metrics: dict[str, torch.Tensor], group: Optional[dist.ProcessGroup] = None
) -> dict[str, torch.Tensor]:
    """Average each metric over the ranks of ``group`` (one all-reduce of the stacked values;
    every rank must pass the same keys). Identity when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized() or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    stacked = torch.stack([metrics[k].float().reshape(()) for k in keys])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    stacked /= dist.get_world_size(group)
    return {k: stacked[i] for i, k in enumerate(keys)}
