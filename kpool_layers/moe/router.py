"""Fused sigmoid top-k routing for megatron's ``TopKRouter`` (issue #12: fewer kernel launches).

megatron's router (``TopKRouter.routing``, megatron-core 0.19.2) runs 31 small ops per call on the
router logits with our training configuration (score function, biased top-k, normalisation,
scatters into dense maps, a second top-k for the load-balancing loss and its token counts, the
loss, the expert-bias counts) and autograd runs 24 more to differentiate them. On a GPU every op is
a kernel launch and the training step is launch bound. :class:`FusedTopKRouter` computes the same
outputs with one ``torch.autograd.Function`` (:class:`SigmoidTopKRouting`) whose forward runs 19
ops (20 with the expert-bias counts' update) and whose hand-written backward runs 10
(``tests/test_moe_router.py`` pins them op by op).

What stays megatron's: the router's ``forward`` (expert-bias dtype upkeep, gating GEMM
``router_gating_linear``), ``attach_and_log_load_balancing_loss`` (the metrics-tracker record of
``aux_loss / coeff``, the per-token-loss and MTP scaling, ``MoEAuxLossAutoScaler``), the
tensor/context-parallel all-reduce of the loss's token counts
(``reduce_from_tensor_model_parallel_region``) and every configuration or call this module does
not cover, which runs megatron's ``routing`` unchanged.

Covered (decided once, at build, by :func:`uncovered`):

* ``moe_router_score_function='sigmoid'``, ``moe_router_topk >= 2``, ``moe_router_dtype='fp32'``,
  any ``moe_router_topk_scaling_factor``, with or without ``moe_router_enable_expert_bias``;
* ``moe_router_load_balancing_type`` one of ``'aux_loss'``, ``'seq_aux_loss'``, ``'none'`` (a
  string), with any ``moe_aux_loss_coeff`` (0: no loss) and ``calculate_per_token_loss``;
* none of: expert groups (``moe_router_num_groups``/``group_topk``), a capacity factor (token
  dropping), z-loss, input jitter, router replay, ``moe_router_force_load_balancing``,
  ``moe_router_force_biased``, Transformer Engine's router fusion, a repeated MTP layer.

A covered router falls back to megatron's ``routing`` for a call with a ``padding_mask``, in eval
mode or without grad (megatron's unsorted top-k and no loss there).

Arithmetic (all FP32; ``N`` tokens, ``E`` experts, ``k`` = top-k, ``S, B`` = the logits'
``[s, b]`` leading dims, ``N = S * B``):

* ``scores = sigmoid(logits)``; the experts are the ``k`` largest of ``scores + expert_bias`` (one
  ``torch.topk`` call, sorted); ``probs = scores / (sum of the k chosen scores + 1e-20) * scale``
  on the chosen experts, ``+0`` elsewhere; ``routing_map`` marks the chosen experts;
* load balancing: ``shares = scores / (scores.sum(-1) + 1e-20)``; the loss's routing map is the
  top-``k`` of ``shares``; with ``G`` token groups (1 for ``aux_loss``, ``B`` for
  ``seq_aux_loss``: token ``t`` is in group ``t % B``) and counts ``c [G, E]`` of tokens routed to
  each expert per group (all-reduced over TP x CP), ``loss = sum(shares.view(S', G * E).sum(0) *
  c) * E * coeff / (k * T * T) / G`` with ``S' = N / G`` and ``T = S' * |TP x CP|``.

Every forward value is megatron's bit for bit (the same ops on the same values in the same order,
or an exact reformulation: ``x / -d * -scale == x / d * scale``, ``-x / 0 == -inf``); the
routing-probability and both top-k selections (ties included) come from ``torch.topk`` on the same
values. The backward computes the exact gradient in fewer roundings than autograd through
megatron's ops; the two agree within a few FP32 ulps of the terms (test tolerance derivation in
``tests/test_moe_router.py``).

Layouts: router input ``[S, B, H]``; logits ``[N, E]`` FP32 (token ``t = s * B + b``); ``probs``
``[N, E]`` FP32 (zero off the top-k); ``routing_map`` ``[N, E]`` bool; token counts ``[E]`` int64.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from kpool_layers.precision.linears import RoleTopKRouter

EPS = 1e-20
"""megatron's guard on the score normalisers (``topk_routing_with_score_function``,
``compute_routing_scores_for_aux_loss``)."""

_BALANCE_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
"""The load-balancing types covered and the names megatron logs their losses under."""


@dataclasses.dataclass(frozen=True)
class Balance:
    """The switch load-balancing loss of one routing call (module docstring)."""

    groups: int
    """``G``: token groups with their own expert counts (1: ``aux_loss``, ``B``: ``seq_aux_loss``)."""
    scale: float
    """``E * coeff / (k * T * T)``, as megatron's ``switch_load_balancing_loss_func`` forms it."""
    reduce_group: Any
    """The group the counts are summed over (megatron's ``tp_cp_group``)."""


def uncovered(router: RoleTopKRouter) -> Optional[str]:
    """Why ``router``'s configuration needs megatron's routing, or None (module docstring)."""
    cfg = router.config
    checks = {
        "moe_router_score_function is not 'sigmoid'": router.score_function != "sigmoid",
        "moe_router_topk < 2": router.topk < 2,
        "moe_router_dtype is not 'fp32'": cfg.moe_router_dtype != "fp32",
        "moe_router_load_balancing_type is not aux_loss, seq_aux_loss or none":
            router.routing_type not in (*_BALANCE_NAMES, "none"),
        "expert groups": cfg.moe_router_num_groups is not None or cfg.moe_router_group_topk is not None,
        "moe_expert_capacity_factor": cfg.moe_expert_capacity_factor is not None,
        "moe_z_loss_coeff": cfg.moe_z_loss_coeff is not None,
        "moe_input_jitter_eps": cfg.moe_input_jitter_eps is not None,
        "router replay": router.router_replay is not None,
        "moe_router_force_load_balancing": bool(cfg.moe_router_force_load_balancing),
        "moe_router_force_biased": cfg.moe_router_force_biased is not None,
        "moe_router_fusion": bool(cfg.moe_router_fusion),
        "repeated MTP layer": router.is_mtp_layer and bool(cfg.mtp_use_repeated_layer),
    }
    return next((reason for reason, hit in checks.items() if hit), None)


def _token_dot(shares: torch.Tensor, counts: torch.Tensor, groups: int) -> torch.Tensor:
    """``[S', G, 1]``: each token's ``shares`` row dotted with its group's ``counts`` row."""
    return (shares.view(-1, groups, shares.shape[1]) * counts.view(groups, -1)).sum(-1, keepdim=True)


Routed = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]
"""probs, routing_map, routed counts (or None), load-balancing loss (or None)."""


class SigmoidTopKRouting(torch.autograd.Function):
    """``(logits [N, E], expert_bias [E] | None, k, scale, balance | None, count_routed)
    -> (probs [N, E], routing_map [N, E], routed counts [E] | None, loss [] | None)``.

    The routed counts (for the expert-bias update) are made when ``count_routed``, the loss when
    ``balance`` is given. Module docstring for the arithmetic."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, expert_bias: Optional[torch.Tensor], topk: int, scale: float,
                balance: Optional[Balance], count_routed: bool) -> Routed:
        tokens, experts = logits.shape
        rows, groups = (1, 1) if balance is None else (2, balance.groups)
        ranked = logits.new_empty(rows, tokens, experts)  # [0]: routing scores, [1]: loss shares
        if expert_bias is None:
            scores = torch.sigmoid(logits, out=ranked[0])
        else:
            scores = torch.sigmoid(logits)
            torch.add(scores, expert_bias, out=ranked[0])
        shares = norm = None
        if balance is not None:
            norm = scores.sum(-1, keepdim=True).add_(EPS)
            shares = torch.div(scores, norm, out=ranked[1])
        chosen = ranked.view(rows * tokens, experts).topk(topk, dim=1).indices
        hit = torch.zeros(rows * tokens, experts, dtype=torch.bool, device=logits.device).scatter_(1, chosen, True)
        routing_map = hit[:tokens]
        # -(chosen sum + eps), then -inf off the map (a negative number over False == 0): probs is
        # scores / -d * -scale == scores / d * scale there and +0 elsewhere.
        denominator = (-EPS - scores.gather(1, chosen[:tokens]).sum(-1, keepdim=True)) / routing_map
        probs = scores.div(denominator).mul_(-scale)

        counts = routed = loss = load = None
        if balance is not None or count_routed:
            counts = hit.view(rows, tokens // groups, groups * experts).sum(1)  # int64, as megatron's
        if count_routed:
            routed = counts[0] if groups == 1 else counts[0].view(groups, experts).sum(0)
        if balance is not None:
            load = reduce_from_tensor_model_parallel_region(counts[1], balance.reduce_group)
            loss = (shares.view(-1, groups * experts).sum(0) * load).sum() * balance.scale
            if groups > 1:
                loss = loss / groups
        ctx.mark_non_differentiable(*(t for t in (routing_map, routed) if t is not None))
        ctx.set_materialize_grads(False)  # no zero gradients for the map and the counts
        ctx.save_for_backward(scores, probs, denominator, shares, norm, load)
        ctx.scale, ctx.groups = scale, groups
        ctx.loss_scale = None if balance is None else balance.scale / groups
        return probs, routing_map, routed, loss

    @staticmethod
    def backward(ctx: Any, d_probs: Optional[torch.Tensor], _map: Any, _routed: Any,
                 d_loss: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        scores, probs, denominator, shares, norm, load = ctx.saved_tensors
        if d_probs is None:  # only the loss reached the router
            d_probs = torch.zeros_like(probs)
        # probs_e = scale * s_e / d (chosen e, d = chosen sum + eps), so with r = sum_e g_e probs_e:
        # d/ds_j = m_j (scale * g_j - r) / d = (r - scale * g_j) / denominator_j.
        r = (d_probs * probs).sum(-1, keepdim=True)
        d_scores = torch.sub(r, d_probs, alpha=ctx.scale).div_(denominator)
        if d_loss is not None:
            # loss = loss_scale * sum_t c[g(t)] . s_t / D_t: d/ds_j = loss_scale * (c_j - c . shares_t) / D_t.
            groups, experts = ctx.groups, scores.shape[1]
            centred = (load.view(groups, experts) - _token_dot(shares, load, groups)).view_as(scores)
            d_scores.addcdiv_(centred, norm / d_loss, value=ctx.loss_scale)
        return torch.ops.aten.sigmoid_backward(d_scores, scores), None, None, None, None, None


class FusedTopKRouter(RoleTopKRouter):
    """:class:`~kpool_layers.precision.linears.RoleTopKRouter` routing with :class:`SigmoidTopKRouting` when
    its configuration is covered (``fused_routing``; module docstring), megatron's routing else."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_routing = uncovered(self) is None

    def _balance(self, seq_length: int, bsz: int, coeff: float) -> Optional[Balance]:
        """The load-balancing loss of a call on ``[seq_length, bsz]`` tokens, if any."""
        if coeff <= 0:
            return None
        groups = bsz if self.routing_type == "seq_aux_loss" else 1
        total = seq_length * bsz // groups * self.tp_cp_group.size()
        scale = self.config.num_moe_experts * coeff / (self.topk * total * total)
        return Balance(groups=groups, scale=scale, reduce_group=self.tp_cp_group)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.fused_routing and padding_mask is None and self.training and torch.is_grad_enabled()):
            return super().routing(logits, padding_mask=padding_mask)
        coeff = self.get_aux_loss_coeff(self.routing_type) if self.routing_type in _BALANCE_NAMES else 0.0
        balance = self._balance(*logits.shape[:2], coeff)
        logits = logits.view(-1, self.config.num_moe_experts)
        probs, routing_map, routed, loss = SigmoidTopKRouting.apply(
            logits, self.expert_bias, self.topk, self.config.moe_router_topk_scaling_factor or 1.0,
            balance, self.enable_expert_bias)
        if balance is not None:
            probs = self.attach_and_log_load_balancing_loss(
                probs, coeff, loss, _BALANCE_NAMES[self.routing_type], self.tp_cp_group,
                valid_token_count=logits.shape[0])
        if routed is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routed
        return probs, routing_map
