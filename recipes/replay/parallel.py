"""This rank's part of a packed rollout row's replay tensors under tensor, sequence, context and
pipeline parallelism (docs/replay.md).

A packed row holds ``s`` positions; its recorded top-k ``[1, s, W]`` (key positions within the
row) and experts ``[s, k]`` are the whole row's. Each rank's layers read:

* top-k (:class:`kpool_layers.mla.attention.GLMSparseMLA`): one row per query row of this rank.
  Under TP the queries cover the full sequence on every rank (the SP input is gathered before the
  indexer), so the indices are replicated. Under CP the rank holds megatron's load-balanced query
  rows (:func:`kpool_layers.dsa.context_parallel.local_positions`: chunks ``r`` and
  ``2 * CP - 1 - r`` of ``2 * CP``) while its keys are gathered over the whole row in sequence
  order: the rows are those positions, the key indices stay row positions.
* experts (megatron's ``TopKRouter``): one row per token the router sees, its input ``[S, B]``
  flattened. That is the CP rank's rows (as above) and, under sequence parallelism, the TP rank's
  contiguous ``1 / TP`` of them (megatron's ``scatter_to_sequence_parallel_region`` split).
* pipeline stages: only the layers the stage builds (its routers and computing DSA layers, by
  megatron's global 1-based layer numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from kpool_layers.dsa.context_parallel import local_positions
from kpool_layers.mla.attention import GLMSparseMLA


@dataclass(frozen=True)
class RankSlice:
    """How this rank's layers see a packed row (module docstring)."""

    cp_size: int
    cp_rank: int
    sp_size: int
    """The TP size when sequence parallelism splits the routers' tokens, else 1."""
    sp_rank: int

    @classmethod
    def current(cls, sequence_parallel: bool) -> RankSlice:
        """The slice of this process (megatron's parallel state)."""
        sp = sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        return cls(cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                   sp_size=ps.get_tensor_model_parallel_world_size() if sp else 1,
                   sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0)

    def query_rows(self, s: int, device: torch.device) -> Optional[torch.Tensor]:
        """int64 ``[s / CP]``: the row positions of this CP rank's queries; None without CP."""
        if self.cp_size == 1:
            return None
        return local_positions(s // self.cp_size, self.cp_size, self.cp_rank, device)

    def topk(self, idx: torch.Tensor) -> torch.Tensor:
        """``[b, s, W]`` recorded top-k -> ``[b, s / CP, W]`` of this rank's query rows."""
        rows = self.query_rows(idx.shape[1], idx.device)
        return idx if rows is None else idx[:, rows]

    def router_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, ...]`` per row position -> ``[s / (CP * SP), ...]`` of the tokens this rank's
        routers see, in their order."""
        rows = self.query_rows(x.shape[0], x.device)
        if rows is not None:
            x = x[rows]
        if self.sp_size == 1:
            return x
        part = x.shape[0] // self.sp_size
        return x[self.sp_rank * part:(self.sp_rank + 1) * part]


def stage_topk_layers(model: torch.nn.Module) -> set[int]:
    """The computing DSA layers (1-based, global) this pipeline stage builds (MTP excluded)."""
    return {int(m.layer_number) for name, m in model.named_modules()
            if isinstance(m, GLMSparseMLA) and m.computes_topk and ".mtp." not in f".{name}"}
