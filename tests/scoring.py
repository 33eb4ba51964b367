"""Test support: a selection's whole index-score rows from its chunks."""

from __future__ import annotations

import torch

from kpool_layers.dsa.indexer import ScoredSelection


def row_scores(selection: ScoredSelection, row: int, chunk_size: int) -> torch.Tensor:
    """FP32 ``[s_q, n]`` ReLU index scores of batch row ``row`` of ``selection``, ``-inf`` where a
    query cannot see the key: :meth:`ScoredSelection.score_chunks` concatenated."""
    return torch.cat(list(selection.score_chunks(row, relu=True, chunk_size=chunk_size)))
