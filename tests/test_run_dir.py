"""A rerun of the same command resumes its last unfinished run; train.resume=none starts fresh."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from recipes.launch.run_dir import find_unfinished, select_run
from tests.train_runner import metrics, run_train


def _run(root: Path, name: str, overrides: list[str], status: str | None, age_s: float) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    marker = run / ".hydra" / "overrides.yaml"
    marker.write_text("".join(f"- {o}\n" for o in overrides))
    stamp = time.time() - age_s
    os.utime(marker, (stamp, stamp))
    if status is not None:
        (run / "result.json").write_text(json.dumps({"status": status}))
    return run


def test_only_an_older_unfinished_run_of_the_same_command_is_resumed(tmp_path: Path) -> None:
    cmd = ["model=glm5_tiny", "train.steps=8"]
    _run(tmp_path, "done", cmd, "completed", 50)
    _run(tmp_path, "other", ["model=glm5_tiny", "train.steps=9"], None, 40)
    older = _run(tmp_path, "older", cmd, "failed", 30)
    killed = _run(tmp_path, "killed", list(reversed(cmd)) + ["train.resume=auto"], None, 20)
    _run(tmp_path, "after_launch", cmd, None, -5)  # written by this launch's rank 0: not a candidate
    now = time.time()
    assert find_unfinished(tmp_path, cmd, now) == killed  # the newest; order and train.resume ignored
    assert find_unfinished(tmp_path, cmd, now - 25) == older
    assert find_unfinished(tmp_path, cmd + ["train.lr=1e-3"], now) is None
    assert find_unfinished(tmp_path / "absent", cmd, now) is None


def test_rerun_resumes_the_unfinished_run(tmp_path: Path) -> None:
    cmd = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "train.steps=3",
           "train.lr_warmup_steps=1", "train.save_interval=2", "logging.mode=disabled"]
    first = run_train(tmp_path, "", cmd)  # no KPOOL_RUN_ID: the id comes from the launch
    line = first.stdout.splitlines()[0]
    assert line.startswith("run ") and "to resume it, rerun this command" in line, line
    run = tmp_path / line.split()[1]
    # As if killed after the step-2 checkpoint: no result.json, latest = step 2, a cut-off record.
    (run / "result.json").unlink()
    (run / "checkpoints" / "latest").write_text("iter_0000002")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')
    again = run_train(tmp_path, "", cmd)
    assert again.stdout.splitlines()[0].startswith(f"resuming run {run.name} "), again.stdout
    assert "at step 2" in again.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_resume_none_starts_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = ["model=glm5_tiny", "train.steps=8"]
    _run(tmp_path, "killed", cmd, None, 3600)  # before this (pytest) process started
    monkeypatch.setenv("KPOOL_RUN_ROOT", str(tmp_path))
    monkeypatch.delenv("KPOOL_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert select_run(cmd).startswith("resuming run killed (the last unfinished run of this command)")
    assert os.environ["KPOOL_RUN_ID"] == "killed"
    monkeypatch.delenv("KPOOL_RUN_ID")
    line = select_run(cmd + ["train.resume=none"])
    assert line.startswith("run ") and "killed" not in line
    assert os.environ["KPOOL_RUN_ID"] == line.split()[1] and f"KPOOL_RUN_ID={line.split()[1]}" in line


def test_a_dry_run_does_not_offer_to_resume(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A dry run leaves no run directory, so its first line must not say how to resume one."""
    monkeypatch.setenv("KPOOL_RUN_ROOT", str(tmp_path))
    monkeypatch.setenv("KPOOL_RUN_ID", "plan")
    line = select_run(["model=glm5_tiny", "train.dry_run=true"])
    assert line == "dry run of run plan: plans the run and writes no run directory"
    assert "resume" in select_run(["model=glm5_tiny"])
