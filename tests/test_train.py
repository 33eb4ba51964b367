"""End-to-end training through ``train.py`` on CPU: loss falls, TP=2 == TP=1, exact resume,
wandb offline/disabled, dry run parameter counts, run-dir layout under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train_runner import metrics, run_train

FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64"]


def test_tiny_model_trains_and_loss_falls(tmp_path: Path) -> None:
    run_train(tmp_path, "trains", FAST + ["train.steps=30", "logging.mode=disabled"])
    rows = metrics(tmp_path / "trains")
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 1.0, (first, last)
    result = json.loads((tmp_path / "trains" / "result.json").read_text())
    assert result["status"] == "completed" and result["steps"] == 30
    assert (tmp_path / "trains" / "checkpoints" / "latest").read_text() == "iter_0000030"


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    common = FAST + ["train.steps=8", "logging.mode=disabled", "train.keep_checkpoints=5"]
    run_train(tmp_path, "full", common + ["train.save_interval=4"])
    full = metrics(tmp_path / "full")
    # A second run resumes from the step-4 checkpoint of the first and trains steps 5..8.
    ckpt4 = tmp_path / "full" / "checkpoints" / "iter_0000004"
    assert ckpt4.is_dir()
    out = run_train(tmp_path, "resumed", common + [f"train.resume={ckpt4}"])
    assert "resumed from" in out.stdout
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]


def test_resume_auto_continues_in_the_same_run_dir(tmp_path: Path) -> None:
    common = FAST + ["logging.mode=disabled"]
    run_train(tmp_path, "auto", common + ["train.steps=6", "train.save_interval=3"])
    (tmp_path / "auto" / "checkpoints" / "latest").write_text("iter_0000003")
    out = run_train(tmp_path, "auto", common + ["train.steps=6", "train.resume=auto"])
    assert "at step 3" in out.stdout


def test_wandb_offline_history_and_disabled_writes_nothing(tmp_path: Path) -> None:
    from scripts.drift_report import find_run_files, read_history

    run_train(tmp_path, "offline", FAST + ["train.steps=4", "logging.mode=offline"])
    (run_file,) = find_run_files(tmp_path / "offline")
    history = read_history(run_file)
    losses = [history[step]["train/loss"] for step in sorted(history) if "train/loss" in history[step]]
    logged = [r["loss"] for r in metrics(tmp_path / "offline")]
    assert losses == pytest.approx(logged)
    run_train(tmp_path, "disabled", FAST + ["train.steps=2", "train.lr_warmup_steps=1", "logging.mode=disabled"])
    assert not (tmp_path / "disabled" / "wandb").exists()


@pytest.mark.dist
def test_tp2_first_step_loss_equals_tp1(tmp_path: Path) -> None:
    common = FAST + ["train.steps=1", "train.lr_warmup_steps=0", "logging.mode=disabled", "train.micro_batch_size=2",
                     "train.global_batch_size=2"]
    run_train(tmp_path, "tp1", common + ["parallelism=single"])
    run_train(tmp_path, "tp2", common + ["parallelism=tp2"], nproc=2)
    tp1, tp2 = metrics(tmp_path / "tp1")[0]["loss"], metrics(tmp_path / "tp2")[0]["loss"]
    assert abs(tp1 - tp2) < 1e-5, (tp1, tp2)
    # Both ranks wrote into one run dir; only rank 0 wrote .hydra/ and the metrics.
    assert (tmp_path / "tp2" / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "tp2").glob("train_rank*.log")) == [
        "train_rank0.log", "train_rank1.log"]
    # Every rank's log keeps its step lines (rank 1 prints none), with the loss both ranks agree on.
    for rank in (0, 1):
        log = (tmp_path / "tp2" / f"train_rank{rank}.log").read_text()
        assert f"[kpool.console][INFO] - step     1/1 | loss {tp2:.4f} |" in log, (rank, log[-2000:])


def test_dry_run_counts_glm5_2_parameters(tmp_path: Path) -> None:
    """The cluster preset planned on one CPU: parameters, stages and the per-GPU verdict."""
    out = run_train(tmp_path, "dry", ["experiment=glm5_2_h200_64n", "data=mock", "train.dry_run=true"])
    line = next(x for x in out.stdout.splitlines() if x.startswith("model glm5_2:"))
    total = int(line.split(":")[1].split("parameters")[0].replace(",", ""))
    assert abs(total - 753_329_940_480) / 753_329_940_480 < 0.005
    assert "active per token" in out.stdout and "per-rank memory" in out.stdout
    stages = [x for x in out.stdout.splitlines() if x.startswith("  stage ")]
    assert [int(x.split(":")[1].split()[0]) for x in stages] == [2] + [12] * 6 + [4]
    verdict = next(x for x in out.stdout.splitlines() if x.startswith("largest: stage"))
    assert "80 GB (A100/H100): does not fit | 141 GB (H200): fits | 192 GB (B200): fits" in verdict


def test_invalid_override_fails_before_building(tmp_path: Path) -> None:
    out = run_train(tmp_path, "bad", ["model.dsa_indexer_kpool=3"], check=False)
    assert out.returncode != 0
    assert "model.dsa_indexer_kpool=3" in out.stderr + out.stdout
    # A config error leaves no run directory (a rerun would "resume" it); sweep jobs keep their
    # result.json (tests/test_kpool_training.py).
    assert not (tmp_path / "bad").exists()
