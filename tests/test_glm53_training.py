"""``train.py model=glm5_3_flash_tiny`` (KDA + DSA layers, a shared indexer, dense + MoE, SwiGLU
clamp, 4 mHC streams) end to end on CPU: top-k drift and the indexer KL loss on its DSA layers,
resume, TP = 2 and PP = 2 (hybrid stages K D D | K D, the streams crossing the boundary) equal to
one rank, every precision profile builds it; on a GPU, fla against the torch kernels and CUDA-graph
replays against eager steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train_runner import metrics, run_train

COMMON = ["model=glm5_3_flash_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled",
          "train.lr_warmup_steps=0", "train.micro_batch_size=2", "train.global_batch_size=2",
          "precision.drift.interval=1", "precision.drift.reference=fp32", "model.dsa_indexer_loss_coeff=0.01",
          "train.keep_checkpoints=5",
          # megatron's distributed-optimizer buffers do not reshard across PP sizes; Adam's
          # per-parameter state does, so the PP = 2 run resumes the PP = 1 checkpoint exactly
          "parallelism.use_distributed_optimizer=false"]
# fp32 losses: TP/PP reorder sums of <= a few hundred terms (u = 2^-24 each) on a loss of ~6;
# 1e-5 absolute is ~100x that rounding and far below what a wrong shard or a layer built on the
# wrong stage changes (O(0.01) and more).
LOSS_TOL = 1e-5


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


@pytest.mark.dist
def test_drift_indexer_loss_resume_tp2_and_hybrid_pp2(tmp_path: Path) -> None:
    run_train(tmp_path, "one", COMMON + ["train.steps=2", "train.save_interval=1"])
    rows = metrics(tmp_path / "one")
    keys = {k for r in rows for k in r if k.startswith("dsa/")}
    # the DSA layers 2 and 5 compute their top-k (3 shares 2's): both measured and trained, no other
    assert {"dsa/topk_overlap/layer_2", "dsa/topk_overlap/layer_5", "dsa/indexer_loss/layer_2",
            "dsa/indexer_loss/layer_5"} <= keys, sorted(keys)
    assert not any(k.endswith(("layer_1", "layer_3", "layer_4")) for k in keys), sorted(keys)
    one = _losses(tmp_path / "one")
    ckpt = tmp_path / "one" / "checkpoints" / "iter_0000001"
    # resume at PP = 2 (stages of layers 1-3 and 4-5, [s, b, 4, h] streams between them) from the
    # PP = 1 step-1 checkpoint: step 2 only, with the loss of the uninterrupted run (a resume that
    # lost the weights, the Adam state or the data position changes it by O(0.01) and more)
    run_train(tmp_path, "pp2", COMMON + ["train.steps=2", f"train.resume={ckpt}", "parallelism=pp2",
                                         "parallelism.num_layers_in_first_pipeline_stage=3",
                                         "parallelism.num_layers_in_last_pipeline_stage=2"], nproc=2)
    pp2 = _losses(tmp_path / "pp2")
    assert list(pp2) == [2] and abs(pp2[2] - one[2]) < LOSS_TOL, (pp2, one)
    # TP = 2 from scratch: the CPU initialisation does not depend on TP
    run_train(tmp_path, "tp2", COMMON + ["train.steps=1", "parallelism=tp2"], nproc=2)
    assert abs(_losses(tmp_path / "tp2")[1] - one[1]) < LOSS_TOL


def test_every_precision_profile_builds_it(single_rank_parallel_state) -> None:
    """Each profile's policy on the built model: KDA's linears carry their roles (kda.qkv,
    kda.gate, kda.out) in the precision map, kda.gate never FP8, its decay computed in FP32 from a
    BF16 layer (its conv, dt_bias and A_log take the model dtype: tests/test_kda_bf16_save.py);
    the mHC projection (mhc.proj) is FP32 and unquantized."""
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
        x = torch.zeros(4, 1, tcfg.hidden_size, dtype=torch.bfloat16)
        assert kda.A_log.dtype == torch.bfloat16 and kda._decay(x).dtype == torch.float32
        hc = {(r["dtype"], r["quantized"]) for r in rows if r["role"] == "mhc.proj"}
        assert hc == {("float32", False)}, (profile, hc)


@pytest.mark.gpu
def test_gpu_bf16_fla_first_step_matches_torch_kernels(tmp_path: Path) -> None:
    """On a GPU: the tiny hybrid in bf16 with the fla delta rule against the torch one (same
    weights and data): the first step's loss agrees within bf16 rounding of the layer outputs
    (bound: 5 layers x 5 bf16 ulps of 2^-8 each on the loss), and 3 steps train."""
    gpu = ["model=glm5_3_flash_tiny", "precision=bf16", "data.seq_length=256", "logging.mode=disabled",
           "train.steps=3", "train.lr_warmup_steps=0", "precision.drift.interval=0"]
    run_train(tmp_path, "fla", gpu + ["model.linear_attention_kernels=fla"])
    run_train(tmp_path, "torch", gpu + ["model.linear_attention_kernels=torch"])
    fla, ref = _losses(tmp_path / "fla"), _losses(tmp_path / "torch")
    assert sorted(fla) == [1, 2, 3]
    assert abs(fla[1] - ref[1]) < 5 * 2**-8 * 5, (fla, ref)


@pytest.mark.gpu
def test_gpu_replayed_training_equals_eager_bit_for_bit(tmp_path: Path) -> None:
    """``train.cuda_graph_impl=full_iteration`` with KDA layers on fla's kernels, the mHC and DSA
    Triton kernels and top-2 MoE: step 1 eager, step 2 captured then replayed, steps 3-5 replayed.
    The losses and grad norms equal an eager run's bit for bit: none of these kernels reads a device
    value on the host for unpacked rows, none adds with float atomics (the MoE token dispatcher adds
    each token's expert rows in a fixed order, ``kpool_layers.moe.permute``), and the second run
    reads fla's autotuned configurations from Triton's cache, so both run the same kernels."""
    from tests.test_cuda_graph import GRAPHS, _losses as _run_losses

    gpu = ["model=glm5_3_flash_tiny", "precision=bf16", "model.linear_attention_kernels=fla",
           "model.dsa_kernels=triton", "data.seq_length=256", "train.steps=5", "train.micro_batch_size=1",
           "train.global_batch_size=2", "train.save_final=false", "logging.mode=disabled",
           "train.cuda_graph_warmup_steps=1", "precision.drift.interval=0"]
    eager = _run_losses(tmp_path, "eager", gpu)
    graphed = _run_losses(tmp_path, "graphed", gpu + [GRAPHS], captured_at=2)
    assert len(eager[0]) == 5 and len(set(eager[0])) > 1 and graphed == eager
