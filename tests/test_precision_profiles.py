"""Precision profiles: each YAML builds the policy it should, and on the built GLM-5 tiny model
every linear is built with its role's numerics exactly as the profile says, serving-quantized indexer scoring equals
``fp8.serving_index_scores``, top-k drift is exact for ``serving_match`` and measurable for
``bf16``; config validation of the precision keys."""

from __future__ import annotations

from pathlib import Path

import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir

from kpool_layers.precision import fp8
from kpool_layers.mla.attention import KV_UP_NOTE
from kpool_layers.dsa.indexer import DSAIndexer, ScoredSelection
from kpool_layers.dsa.numerics import IndexerNumerics, PlainProjections, RoutedProjections, indexer_numerics
from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleDuplicatedLinear, RoleRowParallelLinear
from kpool_layers.precision.policy import PrecisionPolicy
from kpool_layers.dsa.topk import ascending_selection, topk_lower_index_ties
from recipes.launch.distributed import register_resolvers
from recipes.observe.drift import DriftMonitor, reference_numerics
from recipes.config.megatron import to_transformer_config
from recipes.train.model import build_gpt_model
from recipes.observe.precision_map import PROFILES_DIR, precision_map, profile_policy
from recipes.config.schema import ConfigError, register_configs
from recipes.config.rules import validate
from recipes.config.typed import to_config
from tests.test_indexer import tiny_config
from tests.scoring import row_scores

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()
register_configs()

ALWAYS = {"mlp.fc1", "mlp.fc2", "moe.expert_fc1", "moe.expert_fc2", "moe.shared_fc1", "moe.shared_fc2"}
MLA_ROUTED = {"mla.q_down", "mla.q_up", "mla.kv_down", "mla.out"}  # mla.kv_up is absorbed
INDEXER = {"indexer.q", "indexer.k", "indexer.weights"}
QUANTIZED = {"bf16": set(), "fp8": ALWAYS | MLA_ROUTED | INDEXER, "serving_match": ALWAYS}
FP32_ROLES = {"bf16": {"moe.router"}, "fp8": {"moe.router"}, "serving_match": {"moe.router", "indexer.weights"}}
ROLES = ALWAYS | MLA_ROUTED | INDEXER | {"mla.kv_up", "moe.router", "embedding", "output"}


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _build(overrides: list[str]):
    composed = _compose(["model=glm5_tiny", "data.seq_length=64", *overrides])
    validate(composed, 1)
    cfg = to_config(composed)
    tcfg = to_transformer_config(cfg)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, tcfg).to(tcfg.params_dtype)
    return cfg, model


def _forward(model: torch.nn.Module, seed: int = 0, batch: int = 2, seq: int = 64) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (batch, seq), generator=g)
    positions = torch.arange(seq).expand(batch, seq)
    with torch.no_grad():
        model(tokens, positions, None)


@pytest.mark.parametrize("profile", ["bf16", "fp8", "serving_match"])
def test_every_linear_routed_as_the_profile_says(single_rank_parallel_state, profile):
    fp8 = [] if profile == "bf16" else ["precision.backend=emulate"]  # an FP8-only key
    cfg, model = _build([f"precision={profile}", *fp8])
    rows = precision_map(model)
    modules = dict(model.named_modules())
    assert {r["role"] for r in rows} == ROLES  # every role present, no linear without a role
    for row in rows:
        role, module = row["role"], modules[row["module"]]
        assert row["quantized"] == (role in QUANTIZED[profile]), row
        assert row["dtype"] == ("float32" if role in FP32_ROLES[profile] else "bfloat16"), row
        assert row["backend"] == ("emulate" if row["quantized"] else "none"), row
        own_gemm = (isinstance(module, (RoleColumnParallelLinear, RoleRowParallelLinear, RoleDuplicatedLinear))
                    and module.numerics.replaces_gemm(module.weight.dtype))
        # Introspection: quantized roles and dtype changes (FP32 indexer weights) compute their own
        # GEMM, the absorbed kv_up, the embedding, the output layer and the FP32 router do not.
        routed = row["quantized"] or (role == "indexer.weights" and profile == "serving_match")
        assert own_gemm == routed, row
        if role == "mla.kv_up":
            assert row["note"] == KV_UP_NOTE and not row["quantized"]
    indexers = [m for m in model.modules() if isinstance(m, DSAIndexer)]
    assert len(indexers) == 4
    serving = profile == "serving_match"
    assert all(ix.numerics == IndexerNumerics(RoutedProjections(), k_norm_fp32=serving,
                                              index_quant="ue8m0" if serving else None)
               for ix in indexers)


def test_quantized_linear_computes_emulated_fp8(single_rank_parallel_state):
    cfg, model = _build(["precision=fp8", "precision.backend=emulate"])
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    x = torch.randn(5, 2, 128).to(torch.bfloat16)
    out, _ = fc1(x)
    x_deq = fp8.emulate(x.reshape(-1, 128), "blockwise", "activation")
    expected = (x_deq @ fp8.emulate(fc1.weight.detach(), "blockwise", "weight").t()).to(torch.bfloat16)
    assert torch.equal(out.reshape(-1, out.shape[-1]), expected)


def test_indexer_serving_quant_equals_serving_index_scores(single_rank_parallel_state):
    torch.manual_seed(0)
    plain_cfg = tiny_config(dsa_indexer_head_dim=32, dsa_indexer_n_heads=4, dsa_indexer_topk=6)
    cfg = dataclasses.replace(plain_cfg, precision=PrecisionPolicy(dsa_indexer_kpool_use_quantization=True))
    indexer = DSAIndexer(cfg, layer_number=1)
    assert indexer.numerics.index_quant == "ue8m0"  # from config.precision at construction
    s = 20
    hidden, q_latent = torch.randn(s, 1, 16), torch.randn(s, 1, 8)
    out = indexer(hidden, q_latent)
    # Independent: unrotated q / LayerNorm-ed k / scaled weights into fp8.serving_index_scores.
    q = (q_latent[:, 0] @ indexer.linear_wq_b.weight.t()).view(s, 4, 32)
    k = indexer.k_norm(hidden[:, 0] @ indexer.linear_wk.weight.t())
    w = hidden[:, 0] @ indexer.linear_weights_proj.weight.t() * (4**-0.5 * 32**-0.5)
    expected = fp8.serving_index_scores(q, k, w)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    expected = expected.masked_fill(~causal, float("-inf"))
    got = row_scores(ScoredSelection.of(out, indexer.numerics), 0, 7)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    ref_idx = ascending_selection(topk_lower_index_ties(expected, 6),
                                  torch.arange(6) < (torch.arange(s) + 1)[:, None])
    assert torch.equal(out.topk_indices[0], ref_idx)
    # Without index_quant the scores are the unquantized (rotated) ones: quantization is no no-op.
    plain_indexer = DSAIndexer(plain_cfg, layer_number=1)
    plain_indexer.load_state_dict(indexer.state_dict())
    assert plain_indexer.numerics.index_quant is None
    plain = row_scores(ScoredSelection.of(plain_indexer(hidden, q_latent), plain_indexer.numerics), 0, 7)
    assert not torch.equal(plain, got)
    torch.testing.assert_close(plain, got, rtol=0.2, atol=0.2)


def _drift(model: torch.nn.Module, cfg) -> dict[int, dict[str, float]]:
    monitor = DriftMonitor(cfg.precision.drift, model, cfg.model.num_layers)
    monitor.arm()
    _forward(model)
    return monitor.measure()


def test_serving_match_has_no_drift_and_bf16_drifts(single_rank_parallel_state):
    cfg, model = _build(["precision=serving_match", "precision.backend=emulate"])
    exact = _drift(model, cfg)
    assert sorted(exact) == [1, 2, 3, 4]
    for metrics in exact.values():
        assert metrics["topk_overlap"] == 1.0 and metrics["topk_exact_rows"] == 1.0
        assert metrics["topk_jaccard"] == 1.0 and metrics["score_rel_err"] == 0.0
    # Same weights and tokens under bf16 (a bf16 build, the serving_match weights loaded): the
    # serving reference's FP8 rounding flips selections.
    bf16, bf16_model = _build(["precision=bf16"])
    bf16_model.load_state_dict(model.state_dict())
    drifted = _drift(bf16_model, bf16)
    overlaps = [m["topk_overlap"] for m in drifted.values()]
    assert all(0.5 < o < 1.0 for o in overlaps), overlaps
    assert all(0.0 < m["score_rel_err"] < 0.5 for m in drifted.values())
    assert all(m["topk_mismatch_frac"] <= 1.0 - m["topk_exact_rows"] for m in drifted.values())


def test_drift_hooks_record_the_first_forward_and_leave_nothing(single_rank_parallel_state):
    """arm() hooks every indexer, the first forward of the step is measured, measure() removes the
    hooks; no attribute is left on the indexers."""
    cfg, model = _build(["precision=bf16"])
    monitor = DriftMonitor(cfg.precision.drift, model, cfg.model.num_layers)
    indexers = list(monitor.indexers.values())
    attributes = [dict(vars(ix)) for ix in indexers]
    monitor.arm()
    assert all(len(ix._forward_hooks) == 1 for ix in indexers)
    _forward(model, seed=0)
    _forward(model, seed=1)  # a second micro batch: not measured
    first = monitor.measure()
    assert all(not ix._forward_hooks for ix in indexers)
    assert [dict(vars(ix)) for ix in indexers] == attributes
    monitor.arm()
    _forward(model, seed=0)
    assert monitor.measure() == first
    _forward(model, seed=0)  # not armed: nothing recorded
    with pytest.raises(RuntimeError, match="no forward of the indexers of layers"):
        monitor.measure()


def test_kpool_drift_reports_pool_overlap(single_rank_parallel_state):
    cfg, model = _build(["precision=bf16", "model.dsa_indexer_kpool=4", "model.dsa_indexer_kpool_always_select_tail=true"])
    for ix in model.modules():
        if isinstance(ix, DSAIndexer):  # non-uniform pooling gates
            torch.nn.init.normal_(ix.index_kpool_compress_gate.weight, std=0.5)
    drifted = _drift(model, cfg)
    for m in drifted.values():
        assert 0.0 < m["pool_overlap"] < 1.0 and 0.0 < m["topk_overlap"] < 1.0
        assert 0.0 <= m["boundary_tie_frac"] <= 1.0


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["precision=fp8", "precision.backend=torch"], "precision.backend"),
        (["precision=fp8", "precision.recipe=tensorwise", "model.moe_grouped_gemm=true"], "model.moe_grouped_gemm"),
        (["precision=fp8", "precision.dsa_indexer_weights_proj_dtype=fp32"],
         "precision.dsa_indexer_weights_proj_disable_quantization"),
        (["precision=serving_match", "model.dsa_indexer_head_dim=96", "model.dsa_indexer_rotate_activation=false"],
         "model.dsa_indexer_head_dim"),
        (["model.dsa_indexer_head_dim=256"], "model.dsa_indexer_head_dim"),
        (["precision.drift.interval=-1"], "precision.drift.interval"),
    ],
)
def test_invalid_precision_names_the_key(overrides, key):
    if key == "precision.backend" and "torch" in overrides[-1] and torch.cuda.is_available():
        pytest.skip("the torch backend is available on this GPU")
    cfg = _compose(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert err.value.key == key and "allowed" in str(err.value)


SERVING_MATCH = dict(fp8=True, dsa_indexer_qk_proj_disable_quantization=True, mla_proj_disable_quantization=True,
                     dsa_indexer_kpool_use_quantization=True, dsa_indexer_weights_proj_dtype="fp32",
                     dsa_indexer_weights_proj_disable_quantization=True, dsa_indexer_k_norm_fp32=True)
PROFILE_POLICIES = {
    "bf16": PrecisionPolicy(name="bf16"),
    "fp32": PrecisionPolicy(name="fp32", dtype="fp32"),
    "fp8": PrecisionPolicy(name="fp8", fp8=True, fp8_backward="fp8"),
    "serving_match": PrecisionPolicy(name="serving_match", **SERVING_MATCH),
}


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
def test_each_profile_yaml_builds_its_policy(name):
    policy = profile_policy(name)
    assert policy == PROFILE_POLICIES[name]
    assert PrecisionPolicy.from_config(_compose([f"precision={name}"]).precision) == policy
    assert to_transformer_config(to_config(_compose([f"precision={name}"]))).precision == policy


def test_overrides_reach_the_policy():
    cfg = _compose(["precision=serving_match", "precision.recipe=rowwise", "precision.drift.reference=fp32"])
    policy = PrecisionPolicy.from_config(cfg.precision)
    assert policy.recipe == "rowwise" and cfg.precision.drift.reference.value == "fp32"


def test_drift_references_are_the_profiles_numerics():
    """``serving`` = the ``serving_match`` profile's indexer numerics, in the run's scale format."""
    bf16, fp32 = torch.bfloat16, torch.float32
    run = PrecisionPolicy(scale_format="amax")
    assert reference_numerics("serving", run) == IndexerNumerics(PlainProjections(bf16, fp32), k_norm_fp32=True,
                                                                 index_quant="amax")
    assert reference_numerics("serving", PrecisionPolicy()).index_quant == "ue8m0"
    assert reference_numerics("bf16", run) == IndexerNumerics(PlainProjections(bf16, bf16), k_norm_fp32=False,
                                                              index_quant=None)
    assert reference_numerics("fp32", run) == IndexerNumerics(PlainProjections(fp32, fp32), k_norm_fp32=True,
                                                              index_quant=None)
    assert indexer_numerics(profile_policy("serving_match")) == IndexerNumerics(
        PlainProjections(bf16, fp32), k_norm_fp32=True, index_quant="ue8m0")
