"""The names of the top-k drift metrics (:mod:`recipes.observe.drift` logs them as
``dsa/<metric>[/layer_<N>]``) and what their values are, for whoever reads or plots them without
importing the training stack (``scripts/drift_report.py``, the sweep summary)."""

from __future__ import annotations

METRICS = ("topk_overlap", "topk_exact_rows", "topk_mismatch_frac", "topk_jaccard",
           "boundary_tie_frac", "score_rel_err", "pool_overlap")
"""Logged metric names, the headline first (``pool_overlap`` only for ``kpool > 1``)."""

FRACTIONS = frozenset(METRICS) - {"score_rel_err"}
"""Metrics that are fractions in [0, 1] (overlaps, row shares); ``score_rel_err`` is a relative
error in [0, inf)."""

OVERLAP = "dsa/topk_overlap"
"""The layer mean of the headline metric as logged (``metrics.jsonl`` key)."""


def metric_order(names: list[str] | set[str]) -> list[str]:
    """``names`` in :data:`METRICS` order, unknown names after them alphabetically."""
    known = [m for m in METRICS if m in names]
    return known + sorted(set(names) - set(METRICS))
