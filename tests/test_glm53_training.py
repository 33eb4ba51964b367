"""``train.py model=glm5_3_flash_tiny`` (KDA + DSA layers, a shared indexer, dense + MoE, SwiGLU
clamp) end to end on CPU: loss falls, exact resume, top-k drift and the indexer KL loss on its DSA
layers, TP = 2 and PP = 2 (hybrid stages K D D | K D) equal to one rank, every precision profile
builds it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train_runner import metrics, run_train

FAST = ["model=glm5_3_flash_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled"]
ONE_STEP = FAST + ["train.steps=1", "train.lr_warmup_steps=0", "train.micro_batch_size=2",
                   "train.global_batch_size=2", "precision.drift.interval=0"]
# fp32 losses of one step: TP/PP reorder sums of <= a few hundred terms (u = 2^-24 each) on a loss
# of ~6: 1e-5 absolute is ~100x that rounding and far below what a wrong shard or a layer on the
# wrong stage changes (O(0.1)).
LOSS_TOL = 1e-5


@pytest.mark.dist
def test_trains_resumes_exactly_and_logs_drift_and_indexer_loss(tmp_path: Path) -> None:
    common = FAST + ["train.steps=4", "train.lr_warmup_steps=1", "train.keep_checkpoints=5",
                     "precision.drift.interval=2", "precision.drift.reference=fp32",
                     "model.dsa_indexer_loss_coeff=0.01"]
    run_train(tmp_path, "full", common + ["train.save_interval=2"])
    full = [r for r in metrics(tmp_path / "full") if "loss" in r]
    assert full[-1]["loss"] < full[0]["loss"]
    # the DSA layers 2 and 5 compute their top-k (3 shares 2's): both are measured and trained
    drift = full[1]
    assert {"dsa/topk_overlap/layer_2", "dsa/topk_overlap/layer_5"} <= set(drift), sorted(drift)
    assert not any(key.endswith(("layer_1", "layer_3", "layer_4")) for key in drift if key.startswith("dsa/"))
    assert all(r["dsa/indexer_loss"] > 0 for r in full)
    ckpt = tmp_path / "full" / "checkpoints" / "iter_0000002"
    run_train(tmp_path, "resumed", common + [f"train.resume={ckpt}"])
    resumed = [r for r in metrics(tmp_path / "resumed") if "loss" in r]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]


@pytest.mark.dist
def test_tp2_and_hybrid_pp2_first_step_equal_one_rank(tmp_path: Path) -> None:
    run_train(tmp_path, "one", ONE_STEP + ["parallelism=single"])
    run_train(tmp_path, "tp2", ONE_STEP + ["parallelism=tp2"], nproc=2)
    run_train(tmp_path, "pp2", ONE_STEP + ["parallelism=pp2", "parallelism.num_layers_in_first_pipeline_stage=3",
                                           "parallelism.num_layers_in_last_pipeline_stage=2"], nproc=2)
    one = metrics(tmp_path / "one")[0]["loss"]
    for name in ("tp2", "pp2"):
        got = metrics(tmp_path / name)[0]["loss"]
        assert abs(got - one) < LOSS_TOL, (name, got, one)


def test_every_precision_profile_builds_it(single_rank_parallel_state) -> None:
    """Each profile's policy on the built model: KDA's linears carry their roles (kda.qkv,
    kda.gate, kda.out) in the precision map, kda.gate never FP8, its fp32 parameters stay fp32."""
    from recipes.config.megatron import to_transformer_config
    from recipes.observe.precision_map import PROFILES_DIR, precision_map
    from recipes.train.model import build_gpt_model
    from tests.test_glm53_model import _compose

    for profile in sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")):
        cfg = _compose(["model=glm5_3_flash_tiny", f"precision={profile}"])
        tcfg = to_transformer_config(cfg)
        model = build_gpt_model(cfg, tcfg)
        rows = precision_map(model)
        roles = {r["role"] for r in rows}
        assert {"kda.qkv", "kda.gate", "kda.out"} <= roles, (profile, roles)
        assert not any(r["quantized"] for r in rows if r["role"] == "kda.gate"), profile
        kda = model.decoder.layers[0].self_attention
        kda.bfloat16()
        assert kda.A_log.dtype == kda.dt_bias.dtype == kda.conv_q.dtype == torch.float32
