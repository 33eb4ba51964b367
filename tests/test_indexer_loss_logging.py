"""The DSA indexer KL loss reaches the step metrics (issue #13): ``dsa/indexer_loss`` at every
step, ``dsa/indexer_loss/layer_N`` at the drift interval, and it falls while training."""

from __future__ import annotations

from pathlib import Path

from tests.train_runner import metrics, run_train

# fp32 on CPU with a fixed seed (train.seed) is deterministic. A low learning rate keeps the main
# attention from sharpening faster than the indexer can follow, so the KL falls within 30 steps.
OVERRIDES = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "train.steps=30",
             "train.seed=1234", "train.lr=3e-4", "train.min_lr=3e-5", "train.save_final=false",
             "logging.mode=disabled", "model.dsa_indexer_loss_coeff=1.0",
             "precision.drift.interval=15", "precision.drift.reference=fp32"]


def test_indexer_loss_is_logged_and_falls(tmp_path: Path) -> None:
    out = run_train(tmp_path, "idx", OVERRIDES)
    steps = [r for r in metrics(tmp_path / "idx") if "loss" in r]  # drift writes records of its own
    assert [r["step"] for r in steps] == list(range(1, 31))
    losses = [r["dsa/indexer_loss"] for r in steps]
    assert all(v > 0 for v in losses)
    # Falls: the mean of the last 5 steps is below the mean of the first 5.
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, (first, last)
    # Per layer (all 4 tiny layers compute their top-k) exactly at the drift interval; the
    # step value is their mean.
    for r in steps:
        layers = sorted(k for k in r if k.startswith("dsa/indexer_loss/layer_"))
        if r["step"] % 15:
            assert layers == [], r["step"]
        else:
            assert layers == [f"dsa/indexer_loss/layer_{n}" for n in range(1, 5)]
            assert abs(sum(r[k] for k in layers) / 4 - r["dsa/indexer_loss"]) < 1e-12
    assert "| indexer_loss " in out.stdout

