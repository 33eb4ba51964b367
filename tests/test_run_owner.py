"""One owner per run directory (issue 34): a second process on a live run fails at once naming the
owner; a lock left by a dead process is taken over; run ids name one directory under the root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.launch.run_owner import LOCK_FILE, RunBusy, acquire, check_run_id
from tests.train_runner import ROOT, metrics, subprocess_env

HOLD = ("import sys, time; from pathlib import Path; from recipes.launch.run_owner import acquire; "
        "owner = acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)")


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that owns ``run_dir`` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_owner_fails_at_once_naming_the_pid_and_a_dead_owner_is_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        start = time.monotonic()
        with pytest.raises(RunBusy) as err:
            acquire(run_dir)
        assert time.monotonic() - start < 1.0  # non-blocking: fails at once, never waits
        assert f"pid {holder.pid} " in str(err.value)
        for hint in ("Wait for that process to end", "another KPOOL_RUN_ID"):
            assert hint in str(err.value)
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without releasing: the kernel drops the lock
        holder.wait()
    owner = acquire(run_dir)
    assert owner.took_over is not None and f"pid {holder.pid} " in owner.took_over
    assert f"pid {os.getpid()} " in (run_dir / LOCK_FILE).read_text()
    owner.release()
    again = acquire(run_dir)  # released normally: nothing stale to report
    assert again.took_over is None
    again.release()


@pytest.mark.parametrize("bad", ["../../x", "..", ".", "a/b", "run\nid", "tab\tid", ""])
def test_run_ids_that_leave_the_run_root_or_break_the_console_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="KPOOL_RUN_ID"):
        check_run_id(bad)
    assert check_run_id("2026-12-03_run.1") == "2026-12-03_run.1"


def test_train_py_refuses_a_run_id_outside_the_run_root(tmp_path: Path) -> None:
    env = subprocess_env(KPOOL_RUN_ROOT=str(tmp_path / "runs"), KPOOL_RUN_ID="../../x")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=glm5_tiny"], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "KPOOL_RUN_ID='../../x'" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_second_launch_of_a_live_run_fails_at_once_and_the_run_keeps_its_metrics(tmp_path: Path) -> None:
    """The old bug: the second launch resumed the live run, trimmed its metrics.jsonl and both
    trained and saved into one directory."""
    cmd = [sys.executable, str(ROOT / "train.py"), "model=glm5_tiny", "precision=fp32",
           "data.seq_length=32", "logging.mode=disabled", "train.lr_warmup_steps=0",
           "train.micro_batch_size=2", "train.global_batch_size=2", "precision.drift.interval=0",
           "train.steps=100000", "train.save_interval=0", "train.save_final=false"]
    env = subprocess_env(KPOOL_RUN_ROOT=str(tmp_path), KPOOL_RUN_ID="live", WANDB_SILENT="true",
                         OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run_dir = tmp_path / "live"
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run_dir / "metrics.jsonl").is_file() and metrics(run_dir)):
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first run logged no step"
            time.sleep(0.5)
        hydra_files = {p: p.stat().st_mtime_ns for p in (run_dir / ".hydra").iterdir()}
        second = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert {p: p.stat().st_mtime_ns for p in (run_dir / ".hydra").iterdir()} == hydra_files  # refused before Hydra wrote
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"in use by pid {first.pid} " in second.stderr
        assert first.poll() is None  # the owner trains on
        steps = [r["step"] for r in metrics(run_dir)]
        assert steps == list(range(1, len(steps) + 1))  # nothing trimmed, nothing interleaved
        assert not (run_dir / "result.json").exists()  # the refused launch recorded nothing
    finally:
        first.kill()
        first.wait()
