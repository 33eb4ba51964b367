"""The memory plan (``recipes/plan/memory_plan.py``) with the chunked loss and activation recompute:
the figures it adds and removes, from its documented per-token model, on glm5_proxy at 128K
tokens (micro batch 1, one H200); and the plan against measured peaks (glm5_proxy at 32K and
128K, glm5_width at 4K)."""

from __future__ import annotations

import os

import pytest

from recipes.plan import memory_plan
from recipes.config.typed import to_config
from tests.test_config import _compose

GIB = 2**30
SEQ = 131072
BASE = ["experiment=glm5_proxy_h200", f"data.seq_length={SEQ}", f"model.max_position_embeddings={SEQ}",
        "train.micro_batch_size=1", "train.global_batch_size=1"]


def _built(overrides: list[str]):  # noqa: ANN202 - a fixture's generator
    """``(cfg, model)`` of ``overrides`` built on the meta device (as the dry run builds it), in a
    one-rank gloo group and megatron's parallel state, both torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model, meta_init
    from tests.conftest import free_port

    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    cfg = to_config(_compose(overrides + ["train.dry_run=true"]))
    tcfg = to_transformer_config(cfg)
    with meta_init(tcfg):
        model = build_gpt_model(cfg, tcfg)
    yield cfg, model
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
    for key, value in saved.items():  # later tests' subprocesses must not inherit this group's port
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def proxy():
    """glm5_proxy at 128K tokens, built on the meta device."""
    yield from _built(BASE)


def _stage(proxy, *overrides: str) -> memory_plan.StageMemory:
    cfg = to_config(_compose(BASE + list(overrides)))
    (stage,) = memory_plan.plan(cfg, proxy[1])
    return stage


def test_the_chunked_loss_keeps_one_chunk_of_logits(proxy) -> None:
    cfg = proxy[0]
    h, vocab = cfg.model.hidden_size, cfg.model.vocab_size
    whole, chunked = _stage(proxy), _stage(proxy, "train.loss_chunk_tokens=8192")
    assert whole.logits * GIB == SEQ * vocab * 4  # 76 GiB: the whole row's bf16 logits and their gradient
    assert chunked.logits * GIB == 8192 * vocab * 6 + 2 * h * SEQ + 6 * vocab * h
    assert chunked.activations - chunked.logits == pytest.approx(whole.activations - whole.logits, rel=1e-12)


def _moe_layer(m) -> float:  # noqa: ANN001
    """A glm5_proxy MoE layer's bytes per token: Korthikanti's 34 h, the absorbed MLA query and
    latent output, the int64 top-k indices, the routed intermediates."""
    mla = 2 * m.num_attention_heads * (2 * m.kv_lora_rank + m.qk_pos_emb_head_dim)
    return 34 * m.hidden_size + mla + 8 * m.dsa_indexer_topk + 6 * m.moe_router_topk * m.moe_ffn_hidden_size


def test_full_recompute_keeps_each_layers_input(proxy) -> None:
    cfg = proxy[0]
    m = cfg.model
    plain = _stage(proxy)
    full = _stage(proxy, "train.recompute_granularity=full", "train.recompute_method=uniform",
                  "train.recompute_num_layers=1")
    # every layer keeps its bf16 input (2 h per token); one layer (the largest: MoE) is rebuilt,
    # with its gradients (RECOMPUTE_WORKING_FACTOR); the peak holds it or the logits
    assert full.recompute_working * GIB == memory_plan.RECOMPUTE_WORKING_FACTOR * _moe_layer(m) * SEQ
    assert full.activations * GIB == pytest.approx(
        m.num_layers * 2 * m.hidden_size * SEQ + max(full.logits, full.recompute_working) * GIB, rel=1e-12)
    assert full.activations - full.logits < (plain.activations - plain.logits) / 5


def test_selective_recompute_of_the_moe_layers(proxy) -> None:
    cfg = proxy[0]
    m = cfg.model
    moe_layers = m.num_layers - m.moe_first_k_dense_layers
    moe_mlp = 19 * m.hidden_size + 6 * m.moe_router_topk * m.moe_ffn_hidden_size
    plain = _stage(proxy)
    moe = _stage(proxy, "train.recompute_granularity=selective", "train.recompute_modules=[moe]")
    # each MoE layer keeps the MLP's input (2 h) of its MLP part; one MoE MLP is rebuilt, with its
    # gradients, while the whole row's logits (larger) are gone
    assert moe.recompute_working * GIB == memory_plan.RECOMPUTE_WORKING_FACTOR * moe_mlp * SEQ < moe.logits * GIB
    saved = moe_layers * (moe_mlp - 2 * m.hidden_size) * SEQ
    assert (plain.activations - moe.activations) * GIB == pytest.approx(saved, rel=1e-12)


def test_the_plan_against_measured_peaks(proxy) -> None:
    """The plan against glm5_proxy's measured peaks on one H200 (docs/results/long_context_h200.json,
    ``scripts/bench/activation_memory.py``): within 10% at 32K (whole loss, no recompute; chunked
    loss + full recompute) and at 128K (chunked loss + full recompute)."""
    full = ["train.loss_chunk_tokens=8192", "train.recompute_granularity=full", "train.recompute_method=uniform",
            "train.recompute_num_layers=1"]
    short = [f"data.seq_length={32768}", f"model.max_position_embeddings={32768}"]
    for overrides, measured in ((short, 100.44), (short + full, 43.04), (full, 69.63)):
        assert _stage(proxy, *overrides).total == pytest.approx(measured, rel=0.10), overrides


@pytest.fixture(scope="module")
def width():
    """glm5_width at seq 4096 (``experiment=glm5_width_h200``), built on the meta device."""
    yield from _built(["experiment=glm5_width_h200"])


def test_the_plan_at_glm5_width_against_its_measured_peak(width) -> None:
    """At GLM-5's width (64 heads, hidden 6144; ``experiment=glm5_width_h200``, seq 4096) the bf16
    plan is within 10% of the peak measured on one H200 (111.03 GiB,
    docs/results/fp8_glm5_width_h200.json); under ``precision=fp8`` the plan is bf16's and its
    report names what it leaves out (the fp8 run peaked at 123.37 GiB)."""
    cfg, model = width
    (stage,) = memory_plan.plan(cfg, model)
    assert stage.total == pytest.approx(111.03, rel=0.10)
    fp8 = to_config(_compose(["experiment=glm5_width_h200", "precision=fp8"]))
    (fp8_stage,) = memory_plan.plan(fp8, model)
    assert fp8_stage.total == stage.total
    assert f"  not counted: {memory_plan.FP8_UNCOUNTED}" in memory_plan.report(fp8, model)
    assert not any("not counted" in line for line in memory_plan.report(cfg, model))


def test_the_report_prints_both(proxy) -> None:
    cfg = to_config(_compose(BASE + ["train.loss_chunk_tokens=8192", "train.recompute_granularity=full",
                                     "train.recompute_method=block", "train.recompute_num_layers=2"]))
    line = next(x for x in memory_plan.report(cfg, proxy[1]) if "of the activations" in x)
    assert "(loss in chunks of 8192 tokens)" in line and "(full: block, first 2 layers)" in line
