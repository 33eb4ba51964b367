"""KDA's float32-born parameters (conv weights, ``dt_bias``, ``A_log``) in a BF16 model: they sit
in the BF16 parameter buffer with every other parameter, so megatron's distributed optimizer can
shard and save their state (an FP32 parameter inside a BF16 model fails megatron 0.19.2's
``sharded_param_state_dp_reshardable`` shape check at the first save)."""

from __future__ import annotations

from pathlib import Path

from tests.train_runner import run_train


def test_bf16_hybrid_model_saves_its_distributed_optimizer_state(tmp_path: Path) -> None:
    """glm5_3_flash_tiny in bf16 (``Float16Module``, megatron's DDP and distributed optimizer, the
    default ``parallelism.use_distributed_optimizer``) trains one step and saves its checkpoint,
    optimizer state included (``train.py`` in its own process)."""
    run_train(tmp_path, "bf16", ["model=glm5_3_flash_tiny", "precision=bf16", "data.seq_length=32",
                                 "train.steps=1", "train.lr_warmup_steps=0", "train.save_final=true",
                                 "logging.mode=disabled", "precision.drift.interval=0"])
    assert (tmp_path / "bf16" / "checkpoints" / "latest").read_text() == "iter_0000001"
