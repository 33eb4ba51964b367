"""Top-k replay: the sparse attention attends to recorded (rollout) top-k indices instead of the
indexer's selection (``config.dsa_topk_replay``).

A :class:`TopKReplay` holds one packed micro batch's recorded indices per computing layer and
travels on that micro batch's ``PackedSeqParams`` (like :class:`kpool_layers.mla.attention.TopKShare`'s
slots), so pipeline schedules and recomputation read their own micro batch's indices.

The indexer still runs where its scores are needed: for the indexer loss (whose sparse target is
then the attention's mass on the replayed keys) and when :attr:`TopKReplay.measure` is set, which
also records how much of the recorded selection the indexer's own selection contains
(:meth:`TopKReplay.overlaps`). Attached without ``dsa_topk_replay`` the indices are only measured
against: the layers attend to their own selection.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from kpool_layers.dsa.drift import intersection_sizes


class TopKReplay:
    """Recorded top-k of one micro batch: ``indices[L]`` int64 ``[b, s, W]`` key positions within
    the row (``-1`` = empty slot) for every computing DSA layer ``L`` (1-based)."""

    _ATTR = "_kpool_topk_replay"

    def __init__(self, indices: dict[int, Tensor], measure: bool = False) -> None:
        self.indices = indices
        self.measure = measure
        self._hits: dict[int, Tensor] = {}
        self._counts: dict[int, Tensor] = {}

    def attach(self, packed_seq_params: PackedSeqParams) -> None:
        """Hand this replay to the layers running on ``packed_seq_params``."""
        setattr(packed_seq_params, self._ATTR, self)

    @classmethod
    def of(cls, packed_seq_params: Optional[PackedSeqParams]) -> Optional[TopKReplay]:
        """The replay attached to ``packed_seq_params``, if any."""
        return getattr(packed_seq_params, cls._ATTR, None)

    def for_layer(self, layer_number: int, width: int) -> Tensor:
        """Layer ``layer_number``'s recorded indices; raises if none or of another width."""
        if layer_number not in self.indices:
            raise RuntimeError(f"top-k replay: no recorded indices for layer {layer_number} "
                               f"(recorded: {sorted(self.indices)})")
        idx = self.indices[layer_number]
        if idx.shape[-1] != width:
            raise RuntimeError(f"top-k replay: layer {layer_number} recorded width {idx.shape[-1]}, "
                               f"the indexer selects {width}")
        return idx

    def record_overlap(self, layer_number: int, recomputed: Tensor, replayed: Tensor) -> None:
        """Accumulate ``|recomputed ∩ replayed|`` and ``|replayed|`` (valid slots) of every query."""
        hits = intersection_sizes(recomputed.detach(), replayed).sum()
        count = (replayed >= 0).sum()
        self._hits[layer_number] = self._hits.get(layer_number, 0) + hits
        self._counts[layer_number] = self._counts.get(layer_number, 0) + count

    def overlaps(self) -> dict[int, tuple[Tensor, Tensor]]:
        """``{layer: (hits, replayed slots)}`` recorded in this micro batch (int64 0-d each)."""
        return {layer: (self._hits[layer], self._counts[layer]) for layer in self._hits}
