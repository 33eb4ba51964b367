"""The sweep console: ``sweep summary (1/1 jobs completed)`` after the first of 4 jobs (the
denominator counted finished jobs), the last line printed twice, and a job's config error ending
the sweep in a traceback instead of the one-paragraph error and the summary path."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from recipes.observe.sweep_jobs import launched_jobs
from tests.train_runner import run_train

FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled",
        "train.steps=2", "train.save_final=false"]


def test_launched_jobs_counts_sweeper_params_times_command_line_sweeps() -> None:
    cfg = OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": {"model.dsa_indexer_kpool": "1,2,4,8"}},
        "overrides": {"task": ["precision=bf16,fp32", "train.steps=3"]}}})
    assert launched_jobs(cfg) == 8
    cfg.hydra.sweeper._target_ = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert launched_jobs(cfg) is None


def test_a_failing_job_prints_one_paragraph_and_the_sweep_ends_with_the_summary(tmp_path: Path) -> None:
    out = run_train(tmp_path, "sweep", ["-m", *FAST, "model.dsa_indexer_kpool=3,2"], check=False)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "Error: invalid config: model.dsa_indexer_kpool=3" in out.stderr, out.stderr[-3000:]
    summary = [line for line in out.stdout.splitlines() if line.startswith("sweep summary")]
    path = tmp_path / "sweep" / "summary.md"
    assert summary == [f"sweep summary (0/2 jobs completed): {path} (and summary.csv, summary.png)",
                       f"sweep summary (1/2 jobs completed): {path} (and summary.csv, summary.png)"], out.stdout
    assert out.stdout.strip().splitlines()[-1] == summary[-1]
