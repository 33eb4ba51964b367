"""Context parallelism (CP) for DSA: the positions a CP rank holds, and per-token tensors of all CP
ranks gathered into sequence order.

The split is megatron's load-balanced one (``megatron.core.utils.get_batch_on_this_cp_rank``,
per-sequence zigzag): a row of ``s`` tokens is cut into ``2 * cp`` chunks of ``c = s / (2 * cp)``
tokens, and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, back to back, as its
``s_local = s / cp`` rows. Every rank then has early and late queries, which balances the causal
indexer's work. Packed THD rows are split the same way (megatron's ``use_per_sequence_balancing``):
documents may straddle ranks, and ``cu_seqlens`` keep describing the whole row.

DSA under CP (:class:`kpool_layers.mla.attention.GLMSparseMLA`): each rank keeps its queries local and
gathers what keys are made of (the latent KV, the indexer's token keys and KPool gates) from all
ranks with :func:`gather_sequence`, whose backward sums every rank's gradient contribution and
hands each rank its own positions' part (a reduce-scatter).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import Tensor


def cp_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks of the CP group (1 without one)."""
    return 1 if group is None else dist.get_world_size(group)


def local_positions(s_local: int, size: int, rank: int, device: torch.device) -> Tensor:
    """int64 ``[s_local]``: the sequence position of each of CP rank ``rank``'s rows (``size``
    ranks, ``s_local = s / size`` rows each)."""
    if s_local % 2:
        raise ValueError(f"a CP rank's sequence slice must hold two equal chunks, got {s_local} rows")
    chunk = s_local // 2
    offsets = torch.arange(chunk, device=device)
    return torch.cat([rank * chunk + offsets, (2 * size - 1 - rank) * chunk + offsets])


def query_positions(s_local: int, group: Optional[dist.ProcessGroup], device: torch.device
                    ) -> Optional[Tensor]:
    """This rank's :func:`local_positions` under CP, None without CP (row ``i`` is position ``i``)."""
    size = cp_size(group)
    if size == 1:
        return None
    return local_positions(s_local, size, dist.get_rank(group), device)


def gather_sequence(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """``x [s_local, ...]`` (this rank's rows) -> ``[s, ...]`` of all CP ranks in sequence order.

    Differentiable: the backward sums the gradients of all ranks and returns this rank's rows
    (megatron's sequence-parallel gather with a reduce-scatter backward, over the CP group). The
    identity without CP."""
    size = cp_size(group)
    if size == 1:
        return x
    gathered = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    chunks = gathered.view(size, 2, x.shape[0] // 2, *x.shape[1:])  # [rank, half, c, ...]
    # sequence chunk k < size is rank k's first half; chunk 2*size-1-k is rank k's second half
    return torch.cat([chunks[:, 0], chunks[:, 1].flip(0)]).reshape(size * x.shape[0], *x.shape[1:])
