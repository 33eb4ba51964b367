"""MoE router replay through megatron-core's ``RouterReplay`` (``model.moe_router_replay``).

With ``moe_enable_routing_replay`` every megatron ``TopKRouter`` owns a ``RouterReplay``; in
``REPLAY_FORWARD`` its top-k step returns the target experts and gathers their scores, from which
megatron's ``topk_routing_with_score_function`` forms the gate weights exactly as for computed
experts (score function, normalisation over the chosen experts, scaling factor). The expert bias
only selects experts, so it plays no part in replayed weights.

Layouts: a router's tokens are its input's ``[S, B]`` flattened (``t = s * B + b``); the
recorded experts of a packed row (``B = 1``) are int64 ``[S, moe_router_topk]``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch.utils.hooks import RemovableHandle


def routers(model: torch.nn.Module) -> dict[int, TopKRouter]:
    """This stage's MoE routers by their 1-based layer number (decoder layers only)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and ".mtp." not in f".{name}":
            found[int(module.layer_number)] = module
    return found


def set_targets(layer_routers: dict[int, TopKRouter], experts: dict[int, torch.Tensor]) -> None:
    """Make every router replay ``experts[L]`` (int64 ``[N, k]``) in its next forward."""
    missing = sorted(set(layer_routers) - set(experts))
    if missing:
        raise RuntimeError(f"router replay: no recorded experts for MoE layers {missing}")
    for layer, router in layer_routers.items():
        replay = router.router_replay
        if replay is None:
            raise RuntimeError("router replay needs moe_enable_routing_replay=True at the build")
        replay.clear_indices()
        replay.set_target_indices(experts[layer])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def recomputed_map(router: TopKRouter, hidden: torch.Tensor) -> torch.Tensor:
    """The routing map ``[N, E]`` bool the router would compute itself for ``hidden`` (megatron's
    top-k on its own scores, no replay, no grad)."""
    cfg = router.config
    with torch.no_grad():
        logits = router.gating(hidden).view(-1, cfg.num_moe_experts)
        _, routing_map = topk_routing_with_score_function(
            logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=router.score_function,
            expert_bias=router.expert_bias, fused=False, router_replay=None)
    return routing_map


class ExpertOverlap:
    """While armed, per MoE layer: recorded (token, expert) pairs the router would also choose
    itself (:func:`recomputed_map`), and all recorded pairs, over the tokens ``valid`` marks.
    Set the micro batch's recorded experts and valid tokens with :meth:`set_batch` before its
    forward."""

    def __init__(self, layer_routers: dict[int, TopKRouter]) -> None:
        self.layer_routers = layer_routers
        self.recorded: dict[int, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None
        self.hits: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = []

    def set_batch(self, experts: dict[int, torch.Tensor], valid: torch.Tensor) -> None:
        """The micro batch's recorded experts (int64 ``[N, k]`` per layer) and valid tokens ``[N]``."""
        self.recorded, self.valid = experts, valid.reshape(-1, 1)

    def arm(self) -> None:
        self.hits, self.counts = {}, {}
        for layer, router in self.layer_routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> Any:
        def record(router: TopKRouter, args: tuple, output: tuple) -> None:
            if layer not in self.recorded:  # records without routing: nothing to compare with
                return
            own = recomputed_map(router, args[0])
            recorded = torch.zeros_like(own).scatter_(1, self.recorded[layer].to(own.device), True)
            recorded &= self.valid.to(own.device)
            self.hits[layer] = self.hits.get(layer, 0) + (own & recorded).sum()
            self.counts[layer] = self.counts.get(layer, 0) + recorded.sum()
        return record
