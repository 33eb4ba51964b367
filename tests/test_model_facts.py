"""Model facts (``kpool_layers.model_facts``): IndexShare and MoE layer patterns against megatron's
own functions, KPool validity, the config's methods, and the analytic parameter count (MFU,
preflight) against a meta build of the model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern
from megatron.core.transformer.experimental_attention_variant.dsa import (
    is_dsa_skip_topk_layer,
    source_dsa_compute_layer,
)

from kpool_layers import model_facts
from recipes.launch.distributed import register_resolvers
from recipes.config.schema import Config, register_configs
from recipes.config.typed import to_config

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()
register_configs()


@pytest.mark.parametrize("freq", [1, 2, 3, 4])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 5])
def test_index_share_matches_megatron(freq: int, offset: int) -> None:
    for n in range(1, 25):
        assert model_facts.computes_topk(n, freq, offset) == (not is_dsa_skip_topk_layer(n, offset, freq))
        assert model_facts.topk_source_layer(n, freq, offset) == source_dsa_compute_layer(n, offset, freq)
    layers = model_facts.topk_layers(24, freq, offset)
    assert layers == [n for n in range(1, 25) if not is_dsa_skip_topk_layer(n, offset, freq)]


def test_index_share_glm5_2_pattern() -> None:
    """GLM-5.2: freq 4, offset 3: layers 1..3 compute, then every 4th from 3 (7, 11, ...)."""
    assert model_facts.topk_layers(12, 4, 3) == [1, 2, 3, 7, 11]
    assert [model_facts.topk_source_layer(n, 4, 3) for n in range(1, 12)] == [1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 11]


@pytest.mark.parametrize("layers,first_dense", [(4, 1), (78, 3), (5, 0), (3, 3)])
def test_moe_first_k_dense_matches_megatron(layers: int, first_dense: int) -> None:
    freq = model_facts.moe_layer_freq(layers, 8, first_dense)
    oracle = get_moe_layer_pattern(SimpleNamespace(moe_layer_freq=freq, num_layers=layers))
    assert [model_facts.is_moe(n, 8, freq) for n in range(1, layers + 1)] == [bool(x) for x in oracle]
    assert [model_facts.is_moe(n, 8, freq) for n in range(1, layers + 1)] == (
        [False] * first_dense + [True] * (layers - first_dense))


@pytest.mark.parametrize("freq", [1, 2, 3])
def test_moe_integer_freq_matches_megatron(freq: int) -> None:
    oracle = get_moe_layer_pattern(SimpleNamespace(moe_layer_freq=freq, num_layers=9))
    assert [model_facts.is_moe(n, 4, freq) for n in range(1, 10)] == [bool(x) for x in oracle]


def test_no_experts_is_dense() -> None:
    assert model_facts.moe_layer_freq(4, None, 1) == 1
    assert not any(model_facts.is_moe(n, None, 1) for n in range(1, 5))


@pytest.mark.parametrize("kpool,topk,problem", [
    (1, 16, None), (4, 16, None), (64, 128, None), (4, None, None),
    (3, 16, "dsa_indexer_kpool"), (128, 128, "dsa_indexer_kpool"),
    (8, 12, "dsa_indexer_topk"), (2, 0, "dsa_indexer_topk")])
def test_kpool_validity(kpool: int, topk: int | None, problem: str | None) -> None:
    found = model_facts.kpool_problem(kpool, topk)
    assert (found and found[0]) == problem


def _compose(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides + ["precision=fp32"]))


def test_config_methods_use_the_facts() -> None:
    from recipes.config.megatron import to_transformer_config

    tcfg = to_transformer_config(_compose(["model=glm5_2"]))
    assert [n for n in range(1, 79) if tcfg.computes_topk(n)] == model_facts.topk_layers(78, 4, 3)
    assert tcfg.topk_source_layer(6) == 3 and tcfg.topk_source_layer(7) == 7
    assert [tcfg.is_moe(n) for n in (1, 3, 4, 78)] == [False, False, True, True]


# Shapes the analytic count must get right: IndexShare with an offset (skip layer last, so the MTP
# layer's own numbering matters), KPool with tail and MoE from layer 1, tied embeddings with two
# MTP layers and no shared expert.
SHAPES = [
    [],
    ["model.num_layers=6", "model.dsa_indexer_topk_freq=2", "model.dsa_indexer_skip_topk_offset=3",
     "model.mtp_num_layers=1"],
    ["model.dsa_indexer_kpool=4", "model.dsa_indexer_kpool_always_select_tail=true",
     "model.moe_first_k_dense_layers=0"],
    ["model.moe_shared_expert_intermediate_size=null", "model.untie_embeddings_and_output_weights=false",
     "model.mtp_num_layers=2"],
    ["model.hc_mult=3", "model.qk_pos_emb_head_dim=0"],
]


@pytest.mark.parametrize("overrides", SHAPES)
def test_analytic_param_count_matches_the_meta_build(single_rank_parallel_state, overrides: list[str]) -> None:
    from recipes.plan.dry_run import analytic_param_count
    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model, count_parameters, meta_init

    cfg = _compose(["model=glm5_tiny", *overrides])
    tcfg = to_transformer_config(cfg)
    with meta_init(tcfg):
        counted = count_parameters(build_gpt_model(cfg, tcfg), tcfg)
    assert analytic_param_count(cfg.model) == (counted.total, counted.active_per_token)


def test_analytic_param_count_of_glm5_2() -> None:
    """The meta build's count (``train.dry_run=true model=glm5_2``: 753,329,921,024 total,
    41,841,744,896 active; the released checkpoint adds 19,456 expert-bias buffers)."""
    from recipes.plan.dry_run import analytic_param_count

    assert analytic_param_count(_compose(["model=glm5_2"]).model) == (753_329_921_024, 41_841_744_896)
