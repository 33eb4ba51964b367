"""megatron's allgather token dispatch without host synchronisations where every expert is local
(issue #12: the glm5_proxy step is host-bound).

megatron-core 0.19.2's ``MoEAllGatherTokenDispatcher`` copies the per-expert token counts to the
host (``.cpu()``), reads their sum (``.item()``) as the permutation's output size, and selects the
permuted probabilities with ``masked_select``: three host synchronisations per MoE layer and
micro-batch, although with all experts on this rank and dropless top-k routing the output size is
static (every token is routed to exactly ``moe_router_topk`` experts: ``T * topk`` rows) and the
grouped experts take the counts on the device (``kpool_layers.moe.grouped_gemm``: ``grouped_mm``'s
offsets).

:class:`LocalTokenDispatcher` is that dispatcher with the permutation and the combine of
:mod:`kpool_layers.moe.permute`: the same expert-major rows and permuted probabilities as megatron's
``permute`` bit for bit (its argsort order: rows by expert, ties by token index), the counts left on
the device (int64 ``[E]``), and every sum over a token's expert rows (the combine, and the
permutation's backward) a gather added in FP32 in a fixed order and rounded once, where megatron
adds in the tokens' dtype with atomics (``scatter_add`` / ``index_add``): bit-identical reruns
without deterministic algorithms, in one kernel each way. Experts that need the counts on the
host (``SequentialMLP``, the per-expert loops) read them with one ``tolist()``.

:class:`GLMMoELayer` is megatron's ``MoELayer`` that uses it, decided once at the build
(:func:`local_dispatch`): the allgather dispatcher with tensor- and expert-parallel size 1, no
capacity factor (token dropping), no router padding for quantization, no TE permute fusion and no
shared-expert overlap. Otherwise megatron's dispatcher stays.

Layouts: hidden ``[T, H]`` (``T = S * B / TP`` tokens), routing map ``[T, E]`` bool, probs
``[T, E]`` FP32 -> permuted hidden ``[T * topk, H]`` (rows grouped by expert), counts ``[E]``,
permuted probs ``[T * topk]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from kpool_layers.moe.permute import Permutation, combine_rows, expert_order, permute_rows


def local_dispatch(config: TransformerConfig, dispatcher: Any) -> Optional[str]:
    """Why ``dispatcher`` (megatron's, as ``MoELayer`` built it) must stay, or None when
    :class:`LocalTokenDispatcher` computes the same without host syncs (module docstring)."""
    checks = {
        "not the allgather dispatcher": type(dispatcher) is not MoEAllGatherTokenDispatcher,
        "tensor- or expert-parallel experts": dispatcher.tp_size > 1 or dispatcher.ep_size > 1,
        "moe_expert_capacity_factor (token dropping)": config.moe_expert_capacity_factor is not None,
        "moe_router_padding_for_quantization": bool(config.moe_router_padding_for_quantization),
        "moe_permute_fusion": bool(config.moe_permute_fusion),
        "moe_shared_expert_overlap": bool(config.moe_shared_expert_overlap),
    }
    return next((reason for reason, hit in checks.items() if hit), None)


class LocalTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher for local experts, without host syncs (module docstring)."""

    order: Optional[Permutation] = None
    """The current micro-batch's row order (set by :meth:`dispatch_postprocess`, read by
    :meth:`combine_preprocess`)."""

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T, H]``, ``probs [T, E]`` -> (rows grouped by expert ``[T * topk, H]``,
        tokens per expert ``[E]`` on the device, their probabilities ``[T * topk]``)."""
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map
        tokens_per_expert = self.local_map.sum(dim=0)
        self.order = expert_order(self.local_map, self.router_topk)
        self.local_probs = probs.t().reshape(-1).index_select(0, self.order.flat)
        self.routing_map = None
        return permute_rows(hidden_states, self.order), tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' rows ``[T * topk, H]`` -> ``[T, H]``, each token's rows summed in a fixed
        order (module docstring)."""
        return combine_rows(hidden_states, self.order)


class GLMMoELayer(MoELayer):
    """megatron's ``MoELayer`` with :class:`LocalTokenDispatcher` where :func:`local_dispatch`
    allows it (``local_token_dispatch``)."""

    def __init__(self, config: TransformerConfig, *args: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
        super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
        self.local_token_dispatch = local_dispatch(self.config, self.token_dispatcher) is None
        if self.local_token_dispatch:
            self.token_dispatcher = LocalTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config,
                pg_collection=pg_collection)
