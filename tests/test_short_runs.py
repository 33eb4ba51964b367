"""Runs of a few steps: ``train.steps<=3`` failed on the default warmup, a config error or a dry
run left a run directory that the rerun "resumed", and there was no preset for "does it run"."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from recipes.config.short_runs import clamp_warmup, fit_drift_interval
from tests.train_runner import metrics, run_train

FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled",
        "train.save_final=false"]


def test_a_preset_warmup_is_clamped_to_a_tenth_of_the_run_and_a_chosen_one_is_not() -> None:
    cfg = OmegaConf.create({"train": {"steps": 2, "lr_warmup_steps": 3}})
    note = clamp_warmup(cfg, ["train.steps=2"])
    assert cfg.train.lr_warmup_steps == 0 and note is not None and "clamped to 0" in note
    cfg = OmegaConf.create({"train": {"steps": 25, "lr_warmup_steps": 100}})
    assert clamp_warmup(cfg, []) is not None and cfg.train.lr_warmup_steps == 2  # floor(0.1 * 25)
    cfg = OmegaConf.create({"train": {"steps": 2, "lr_warmup_steps": 3}})
    assert clamp_warmup(cfg, ["train.lr_warmup_steps=3"]) is None and cfg.train.lr_warmup_steps == 3
    cfg = OmegaConf.create({"train": {"steps": 30, "lr_warmup_steps": 3}})
    assert clamp_warmup(cfg, []) is None and cfg.train.lr_warmup_steps == 3


def test_two_steps_train_with_the_default_warmup_and_say_so_once(tmp_path: Path) -> None:
    out = run_train(tmp_path, "two", FAST + ["train.steps=2"])
    notes = [line for line in out.stdout.splitlines() if "warmup clamped" in line]
    assert len(notes) == 1 and "train.lr_warmup_steps=3" in notes[0], out.stdout
    assert [r["step"] for r in metrics(tmp_path / "two") if "loss" in r] == [1, 2]


def test_config_errors_and_dry_runs_leave_no_run_directory(tmp_path: Path) -> None:
    bad = run_train(tmp_path, "bad", FAST + ["train.lr=-1"], check=False)
    assert bad.returncode == 2 and "train.lr" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists(), sorted(p.name for p in (tmp_path / "bad").iterdir())
    run_train(tmp_path, "dry", FAST + ["train.dry_run=true"])
    assert not (tmp_path / "dry").exists(), sorted(p.name for p in (tmp_path / "dry").iterdir())


def test_smoke_preset_trains_three_tiny_steps_without_logging_files(tmp_path: Path) -> None:
    out = run_train(tmp_path, "smoke", ["+debug=smoke"])
    assert "completed: 3 steps" in out.stdout, out.stdout[-2000:]
    run = tmp_path / "smoke"
    assert not (run / "wandb").exists() and not (run / "checkpoints").exists(), sorted(p.name for p in run.iterdir())
    assert (run / ".hydra" / "config.yaml").read_text().count("name: glm5_tiny") == 1


def test_a_preset_drift_interval_longer_than_the_run_is_fitted_and_a_chosen_one_is_announced() -> None:
    cfg = OmegaConf.create({"train": {"steps": 30}, "precision": {"drift": {"interval": 50}}})
    note = fit_drift_interval(cfg, [])
    assert cfg.precision.drift.interval == 10 and note is not None and "every 10 steps" in note
    cfg = OmegaConf.create({"train": {"steps": 30}, "precision": {"drift": {"interval": 50}}})
    note = fit_drift_interval(cfg, ["precision.drift.interval=50"])
    assert cfg.precision.drift.interval == 50 and note is not None and "no top-k drift" in note
    for interval in (0, 30):
        cfg = OmegaConf.create({"train": {"steps": 30}, "precision": {"drift": {"interval": interval}}})
        assert fit_drift_interval(cfg, []) is None and cfg.precision.drift.interval == interval


def test_serving_match_with_the_default_drift_interval_logs_drift(tmp_path: Path) -> None:
    """``train.py precision=serving_match`` (30 steps, interval 50) logged no dsa/* metric; the
    same command shortened to 6 steps (interval fitted to 2) on CPU-emulated FP8."""
    out = run_train(tmp_path, "drift", ["model=glm5_tiny", "precision=serving_match", "data.seq_length=64",
                                        "train.steps=6", "logging.mode=disabled", "train.save_final=false"])
    assert "top-k drift measured every 2 steps" in out.stdout, out.stdout[-3000:]
    drift_steps = [r["step"] for r in metrics(tmp_path / "drift") if any(k.startswith("dsa/") for k in r)]
    assert drift_steps == [2, 4, 6], drift_steps
