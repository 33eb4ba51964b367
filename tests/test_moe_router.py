"""The fused router (``kpool_layers.moe.router``) against megatron's ``TopKRouter``: forward outputs
bit for bit (probs, routing map, expert-bias token counts, the tracker's load-balancing loss),
gradients within a derived FP32 bound, ties, the configurations and calls it leaves to megatron,
and its op budget (issue #12).

Gradient tolerance (FP32, unit roundoff ``u = 2**-24``, ``gamma_n = n u / (1 - n u)``, Higham,
Accuracy and Stability of Numerical Algorithms, 3.1). Both routers differentiate the same function
at the same forward values (bit-identical scores ``s``, probs ``P``, normalisers ``d`` and ``D``,
shares ``a`` and counts ``c``); the exact logit gradient is
``s (1 - s) * [m (scale g - sum_e g_e P_e) / d + gL c' (c - sum_e c_e a_e) / D]``
(``g`` = the probs' gradient, ``m`` the routing map, ``gL`` the loss's gradient, ``c'`` the loss's
constant). Either computation is a sum of such terms, each carried through one reduction of at
most ``E`` terms (``E - 1`` additions) and at most 14 other roundings; megatron's longest path (the
shares' normaliser) has the most: the loss constant in FP32 and ``/ B`` (2), the per-token-loss
scaling (2), ``* c`` (1), ``D * D``, ``* s`` and the quotient (3), the add to the numerator's path
and to the probs' path (2; scatter and gather are exact), ``sigmoid_backward`` (``1 - s`` and two
products, 3) - 13, one to spare. So each result lies within ``gamma_{E+13} M`` of the exact value,
``M`` = the same expression with every term replaced by its absolute value, and the two within
``2 gamma_{E+13} M`` of each other (:func:`logit_grad_bound`; observed: under 10% of it). The
gating GEMM carries it on: ``|A W - B W|`` computed is at most ``|A - B| |W| + gamma_K (|A| + |B|)
|W|``, ``K`` its reduction length (``E`` for the input gradient, ``N`` for the weight gradient).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker, get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    get_default_pg_collection,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from kpool_layers.moe import router as moe_router
from kpool_layers.moe.router import Balance, FusedTopKRouter, SigmoidTopKRouting, uncovered
from kpool_layers.precision.policy import PrecisionPolicy
from tests.conftest import free_port
from tests.op_counts import OwnOps

U = 2.0**-24
HIDDEN, EXPERTS, TOPK = 24, 16, 4
ROUNDINGS = EXPERTS + 13
"""Roundings along one term's path in either gradient computation (module docstring)."""
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


@pytest.fixture(autouse=True)
def _fresh_metrics_tracker():
    """megatron's MoE metrics tracker is a process global sized by the first model that records:
    every test starts and ends without one."""
    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def config(**overrides: object) -> TransformerConfig:
    """Our training router's settings (glm5_proxy: sigmoid, expert bias, scale 2.5, top-4 of 16,
    sequence aux loss, FP32 routing) on a tiny model; a larger loss coefficient makes its gradient
    visible next to the probs'."""
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                moe_router_topk=TOPK, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.05,
                moe_router_dtype="fp32", add_bias_linear=False, use_cpu_initialization=True,
                params_dtype=torch.float32)
    cfg = TransformerConfig(**{**base, **overrides})
    cfg.precision = PrecisionPolicy()
    return cfg


def routers(cfg: TransformerConfig, seed: int = 0) -> tuple[TopKRouter, FusedTopKRouter]:
    """megatron's router and ours with the same weight and expert bias, layer 1, training."""
    torch.manual_seed(seed)
    ref = TopKRouter(cfg, pg_collection=get_default_pg_collection())
    fused = FusedTopKRouter(cfg, pg_collection=get_default_pg_collection())
    if ref.expert_bias is not None:
        ref.expert_bias.copy_(torch.randn(EXPERTS) * 0.05)
    fused.load_state_dict(ref.state_dict())
    for router in (ref, fused):
        router.set_layer_number(1)
    return ref, fused


def run(router: TopKRouter, x: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward, ``(probs * weight).sum()`` backward (the aux loss joins through megatron's
    ``MoEAuxLossAutoScaler``); outputs, tracker values and gradients (logits' included)."""
    destroy_moe_metrics_tracker()
    router.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    gating, seen = router.gating, {}

    def keep_logits(inp: torch.Tensor) -> torch.Tensor:
        seen["logits"] = logits = gating(inp)
        logits.retain_grad()
        return logits

    router.gating = keep_logits
    probs, routing_map = router(x)
    del router.gating
    (probs * weight).sum().backward()
    tracked = {name: entry.values.clone() for name, entry in get_moe_metrics_tracker().metrics.items()}
    return dict(probs=probs.detach(), routing_map=routing_map, tracked=tracked,
                logits=seen["logits"].detach().view(-1, EXPERTS), d_logits=seen["logits"].grad.view(-1, EXPERTS),
                d_x=x.grad, d_weight=router.weight.grad,
                tokens=None if router.local_tokens_per_expert is None else router.local_tokens_per_expert.clone())


def assert_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else torch.equal(a, b)


def loss_terms(logits: torch.Tensor, groups: int, constant: float, group: Any = None) -> torch.Tensor:
    """The loss's part of ``M`` per unit loss gradient: ``c' (c + sum_e c_e a_e) / D`` with
    megatron's counts ``c`` (per token's group, summed over ``group``) and shares ``a``."""
    aux_map, shares = compute_routing_scores_for_aux_loss(logits, TOPK, "sigmoid")
    counts = aux_map.view(-1, groups * EXPERTS).sum(0).double().view(groups, EXPERTS)
    if group is not None:
        dist.all_reduce(counts, group=group)
    per_token = counts.repeat(logits.shape[0] // groups, 1)  # token t: group t % groups
    norm = torch.sigmoid(logits.double()).sum(-1, keepdim=True) + 1e-20
    return constant * (per_token + (per_token * shares.double()).sum(-1, keepdim=True)) / norm


def logit_grad_bound(cfg: TransformerConfig, out: dict[str, torch.Tensor], weight: torch.Tensor,
                     seq_length: int, loss_grad: float, group: Any = None) -> torch.Tensor:
    """``2 gamma_{E+13} M`` per logit (module docstring), from megatron's forward values; the
    loss's counts and token total span ``group`` (megatron's TP x CP group) when given."""
    logits, probs, chosen = (out[k].double() for k in ("logits", "probs", "routing_map"))
    s = torch.sigmoid(logits)
    scale = cfg.moe_router_topk_scaling_factor or 1.0
    d = (s * chosen).sum(-1, keepdim=True) + 1e-20
    terms = chosen * (scale * weight.abs() + (weight * probs).abs().sum(-1, keepdim=True)) / d
    kind = cfg.moe_router_load_balancing_type
    if kind in LOSS_NAMES and cfg.moe_aux_loss_coeff > 0:
        groups = logits.shape[0] // seq_length if kind == "seq_aux_loss" else 1
        total = logits.shape[0] // groups * (1 if group is None else group.size())
        constant = EXPERTS * cfg.moe_aux_loss_coeff / (TOPK * total * total) / groups
        if cfg.calculate_per_token_loss:  # megatron attaches loss * tokens
            loss_grad *= logits.shape[0]
        terms = terms + abs(loss_grad) * loss_terms(out["logits"], groups, constant, group)
    return 2 * gamma(ROUNDINGS) * s * (1 - s) * terms


def assert_within(fused: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (fused.double() - ref.double()).abs() - bound
    assert excess.max() <= 0, f"worst excess over the bound {excess.max():.3g}"


CASES = {
    # our training configuration (micro-batch 1: one group), a non-1 main-loss backward scale
    "seq_aux_b1": (dict(), 1, 0.37),
    "seq_aux_b3": (dict(), 3, 1.0),
    "aux_loss_per_token": (dict(moe_router_load_balancing_type="aux_loss", calculate_per_token_loss=True), 2, 2.0),
    "no_loss_no_bias_no_scale": (dict(moe_router_load_balancing_type="none", moe_router_enable_expert_bias=False,
                                      moe_router_topk_scaling_factor=None), 2, 1.0),
    "coeff_zero": (dict(moe_aux_loss_coeff=0.0), 2, 1.0),
}


@pytest.mark.parametrize("probs_weight", [1.0, 0.0], ids=["probs_and_loss", "loss_only"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_router_matches_megatron(single_rank_parallel_state, case: str, probs_weight: float) -> None:
    overrides, bsz, loss_scale = CASES[case]
    cfg = config(**overrides)
    ref, fused = routers(cfg)
    assert fused.fused_routing
    seq_length = 6
    x = torch.randn(seq_length, bsz, HIDDEN)
    weight = torch.randn(seq_length * bsz, EXPERTS) * probs_weight
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(loss_scale))
    want, got = run(ref, x, weight), run(fused, x, weight)

    for key in ("probs", "routing_map", "logits"):
        assert_bits(got[key], want[key])
    assert got["routing_map"].sum(-1).eq(TOPK).all()
    if want["tokens"] is not None:
        assert_bits(got["tokens"], want["tokens"])
        assert want["tokens"].sum() == TOPK * seq_length * bsz
    assert want["tracked"].keys() == got["tracked"].keys()
    for name in want["tracked"]:
        assert_bits(got["tracked"][name], want["tracked"][name])

    bound = logit_grad_bound(cfg, want, weight, seq_length, loss_scale)
    # far below the gradient, not a vacuous check (M is up to ~10x it: c - c . a cancels)
    assert bound.max() <= 1e-4 * want["d_logits"].abs().max()
    assert_within(got["d_logits"], want["d_logits"], bound)
    spread = got["d_logits"].double().abs() + want["d_logits"].double().abs()
    w = ref.weight.detach().double().abs()
    n_tokens = seq_length * bsz
    assert_within(got["d_x"], want["d_x"], (bound @ w + gamma(EXPERTS) * spread @ w).view(seq_length, bsz, HIDDEN))
    xs = x.view(n_tokens, HIDDEN).double().abs()
    assert_within(got["d_weight"], want["d_weight"], bound.t() @ xs + gamma(n_tokens) * spread.t() @ xs)
    if probs_weight == 0.0 and case in ("seq_aux_b1", "aux_loss_per_token"):
        assert want["d_logits"].abs().max() > 0  # the loss alone drives the gradient here


def test_loss_alone_matches_megatron_functions(single_rank_parallel_state) -> None:
    """Backward from the loss output alone (no gradient reaches the probs): the loss bit for bit
    and its gradient within the bound, against autograd through megatron's aux-loss functions."""
    torch.manual_seed(2)
    logits = torch.randn(12, EXPERTS)
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    constant = EXPERTS * 0.05 / (TOPK * 12 * 12)
    balance = Balance(groups=1, scale=constant, reduce_group=get_default_pg_collection().tp_cp)
    loss = SigmoidTopKRouting.apply(mine, None, TOPK, 2.5, balance, False)[3]
    aux_map, shares = compute_routing_scores_for_aux_loss(ref, TOPK, "sigmoid")
    want = switch_load_balancing_loss_func(shares, aux_map.sum(0), 12, TOPK, EXPERTS, 0.05)
    assert_bits(loss.detach(), want.detach())
    loss.backward()
    want.backward()
    s = torch.sigmoid(logits.double())
    assert_within(mine.grad, ref.grad, 2 * gamma(ROUNDINGS) * s * (1 - s) * loss_terms(logits, 1, constant))


def _tensor_parallel_worker(rank: int, port: int) -> None:
    """One of two TP ranks, each routing its own tokens: megatron sums the loss's counts over the
    TP x CP group and counts its tokens there."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    from kpool_layers.compat import cpu as _cpu

    _cpu.install()
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = config(tensor_model_parallel_size=2)
    ref, fused = routers(cfg)  # the same weights on both ranks
    assert ref.tp_cp_group.size() == 2 and fused.fused_routing
    x = torch.randn(6, 2, HIDDEN, generator=torch.Generator().manual_seed(rank))
    weight = torch.randn(12, EXPERTS, generator=torch.Generator().manual_seed(10 + rank))
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    want, got = run(ref, x, weight), run(fused, x, weight)
    for key in ("probs", "routing_map", "tokens"):
        assert_bits(got[key], want[key])
    assert_bits(got["tracked"]["seq_load_balancing_loss"], want["tracked"]["seq_load_balancing_loss"])
    bound = logit_grad_bound(cfg, want, weight, 6, 0.5, ref.tp_cp_group)
    assert_within(got["d_logits"], want["d_logits"], bound)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.dist
def test_tensor_parallel_matches_megatron() -> None:
    mp.spawn(_tensor_parallel_worker, args=(free_port(),), nprocs=2)


def test_ties_resolved_as_megatron(single_rank_parallel_state) -> None:
    """Six experts with one weight row and one bias tie on every token; expert 0 always wins and
    the last nine never do, so three of the six tied ones are chosen (and tie in the loss's top-k
    too). Both routers take torch.topk's pick of the same values."""
    cfg = config()
    ref, fused = routers(cfg)
    with torch.no_grad():
        ref.weight[1:7] = ref.weight[1]
        ref.expert_bias[1:7] = 0.0
        ref.expert_bias[0], ref.expert_bias[7:] = 10.0, -10.0
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, HIDDEN)
    weight = torch.randn(10, EXPERTS)
    want, got = run(ref, x, weight), run(fused, x, weight)
    for key in ("probs", "routing_map", "tokens"):
        assert_bits(got[key], want[key])
    assert_bits(got["tracked"]["seq_load_balancing_loss"], want["tracked"]["seq_load_balancing_loss"])
    assert (want["routing_map"][:, 1:7].sum(-1) == 3).all()
    bound = logit_grad_bound(cfg, want, weight, 5, 1.0)
    assert_within(got["d_logits"], want["d_logits"], bound)


@pytest.mark.parametrize("overrides, reason", [
    (dict(moe_z_loss_coeff=1e-3), "moe_z_loss_coeff"),
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False), "is not 'sigmoid'"),
    (dict(moe_router_load_balancing_type="global_aux_loss"), "moe_router_load_balancing_type"),
    (dict(moe_router_topk=1, moe_router_topk_scaling_factor=None), "moe_router_topk < 2"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "expert groups"),
])
def test_uncovered_config_runs_megatron(single_rank_parallel_state, monkeypatch, overrides, reason) -> None:
    cfg = config(**overrides)
    ref, fused = routers(cfg)
    assert reason in uncovered(fused) and not fused.fused_routing
    monkeypatch.setattr(SigmoidTopKRouting, "apply", None)  # would fail if called
    torch.manual_seed(1)
    x = torch.randn(4, 2, HIDDEN)
    if cfg.moe_input_jitter_eps is None:  # jitter draws noise: same arithmetic, other numbers
        want, got = run(ref, x, torch.ones(8, EXPERTS)), run(fused, x, torch.ones(8, EXPERTS))
        for key in ("probs", "routing_map", "d_x", "d_weight"):
            assert_bits(got[key], want[key])
    else:
        run(fused, x, torch.ones(8, EXPERTS))


def test_uncovered_calls_run_megatron(single_rank_parallel_state, monkeypatch) -> None:
    """A padding mask, no-grad calls and eval mode take megatron's routing (same outputs).
    (megatron's expert-bias update does not broadcast a padding mask: no expert bias with one.)"""
    monkeypatch.setattr(SigmoidTopKRouting, "apply", None)  # would fail if called
    x = torch.randn(4, 2, HIDDEN)
    padding = torch.zeros(4, 2, dtype=torch.bool)
    padding[-1] = True
    ref, fused = routers(config(moe_router_enable_expert_bias=False))
    want, got = ref(x, padding_mask=padding), fused(x, padding_mask=padding)
    assert_bits(got[0], want[0])
    assert_bits(got[1], want[1])
    ref, fused = routers(config())
    with torch.no_grad():
        assert_bits(fused(x)[0], ref(x)[0])
    for router in (ref, fused):
        router.eval()
    assert_bits(fused(x)[0], ref(x)[0])
    assert_bits(fused.local_tokens_per_expert, ref.local_tokens_per_expert)


ROUTING_FWD = 2 + 3 + 1 + 3 + 6 + 4
"""The Function's forward: sigmoid and ``+ expert_bias`` (written into the top-k input); the
shares (row ``sum``, ``+ eps``, ``div``); one ``topk`` of both; the map of both choices
(``zeros``, ``scatter_``) and its token counts (one ``sum``); the probs' normaliser (``gather``,
``sum``, ``-eps - x``, ``/ map``) and the probs (``div``, ``mul_``); the loss (tokens ``sum``,
``* counts``, ``sum``, ``* constant``)."""
ROUTING_BWD = 4 + 5 + 1
"""The Function's backward: ``g * probs``, its row ``sum``, ``r - scale g`` (``sub``), ``div_``
by the masked normaliser; the loss: shares times counts (``mul``, row ``sum``), ``counts - that``
(``sub``), ``norm / gL``, ``addcdiv_``; ``sigmoid_backward``."""
FUSED_OWN_FWD = 1 + ROUTING_FWD + 1 + 3
"""The gating GEMM (``mm``; FP32 weight and input: no casts), the Function, the expert-bias
counts' ``add_``, megatron's tracker record (``/ coeff``, the layer entry's ``add_`` and
``copy_``)."""
FUSED_OWN_BWD = ROUTING_BWD + 2 + 2
"""The Function, megatron's ``MoEAuxLossAutoScaler`` (``ones_like``, ``mul``), the gating GEMM's
two ``mm``."""


def test_launch_budget(single_rank_parallel_state) -> None:
    """Own ops per call (each a kernel on a GPU) of our training router, micro-batch 1, once the
    tracker entry and the loss scale exist; megatron's own router for comparison."""
    cfg = config(moe_aux_loss_coeff=1e-4)
    counts = {}
    for router in routers(cfg):
        x = torch.randn(8, 1, HIDDEN, requires_grad=True)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        router(x)[0].sum().backward()
        router.zero_grad(set_to_none=True)
        x.grad = None  # no gradient accumulation in the count
        with OwnOps(router) as ops:
            router(x)[0].sum().backward()
        counts[type(router)] = ops.counts[("", "fwd")], ops.counts[("", "bwd")]
    assert counts[FusedTopKRouter] == (FUSED_OWN_FWD, FUSED_OWN_BWD)
    megatron_fwd, megatron_bwd = counts[TopKRouter]  # 35 / 28 with megatron-core 0.19.2
    assert FUSED_OWN_FWD <= 0.7 * megatron_fwd and FUSED_OWN_BWD <= 0.5 * megatron_bwd


def test_module_docstring_counts() -> None:
    """The op counts the module docstring states are the pinned ones."""
    doc = " ".join(moe_router.__doc__.split())
    assert f"forward runs {ROUTING_FWD} ops" in doc and f"backward runs {ROUTING_BWD}" in doc
