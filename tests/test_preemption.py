"""recipes.launch.preemption on CPU without SLURM: signals set the stop flag, ranks agree on it, and
requeue() calls scontrol with the job id (a fake scontrol on PATH records its arguments)."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recipes.launch.preemption import PreemptionGuard
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _fake_scontrol(tmp_path: Path, exit_code: int = 0) -> Path:
    """Puts an executable `scontrol` in tmp_path/bin that appends its arguments to calls.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    lines = ["#!/bin/sh", f'echo "$@" >> "{tmp_path}/calls.txt"']
    if exit_code:
        lines += ['echo "fake failure" >&2', f"exit {exit_code}"]
    script.write_text("\n".join(lines) + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_signal_to_self_sets_should_stop(sig: str) -> None:
    proc = _run_python(
        f"""
        import os, signal
        from recipes.launch.preemption import PreemptionGuard
        guard = PreemptionGuard()
        assert not guard.should_stop() and guard.signal_name is None
        os.kill(os.getpid(), signal.{sig})
        print(guard.should_stop(), guard.signal_name)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"preemption: {sig} received on rank 0; stopping after this step",
                                        f"True {sig}"]


def test_signal_not_in_list_keeps_default_action() -> None:
    proc = _run_python(
        """
        import os, signal
        from recipes.launch.preemption import PreemptionGuard
        guard = PreemptionGuard(signals=("USR2",))
        os.kill(os.getpid(), signal.SIGUSR2)
        print(guard.should_stop(), guard.signal_name)
        os.kill(os.getpid(), signal.SIGUSR1)
        print("still alive")
        """
    )
    assert proc.stdout.splitlines()[-1] == "True SIGUSR2"
    assert proc.returncode == -signal.SIGUSR1


@pytest.mark.parametrize(
    "signals, message",
    [(("SIGFOO",), "unknown signal 'SIGFOO'"), (("SIGKILL",), "cannot be caught"),
     ("SIGUSR1", "sequence of names")],
)
def test_bad_signal_names_are_rejected(signals, message: str) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ValueError, match=message):
        PreemptionGuard(signals=("SIGUSR1", *signals) if isinstance(signals, tuple) else signals)
    assert signal.getsignal(signal.SIGUSR1) is before  # nothing installed before the error


def test_disabled_guard_installs_nothing_and_never_stops() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    guard = PreemptionGuard(enabled=False)
    assert signal.getsignal(signal.SIGUSR1) is before
    assert guard.should_stop() is False


@pytest.fixture
def slurm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake scontrol first on PATH, SLURM_JOB_ID=4242, global rank 0."""
    monkeypatch.setenv("PATH", f"{_fake_scontrol(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("RANK", "0")
    return tmp_path


def test_requeue_runs_scontrol_with_job_id(slurm_env: Path) -> None:
    assert PreemptionGuard(enabled=False).requeue() is True
    assert (slurm_env / "calls.txt").read_text().split() == ["requeue", "4242"]


def test_requeue_only_on_rank_zero(slurm_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    assert PreemptionGuard(enabled=False).requeue() is False
    assert not (slurm_env / "calls.txt").exists()


def test_requeue_needs_slurm(slurm_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    assert PreemptionGuard(enabled=False).requeue() is False
    assert not (slurm_env / "calls.txt").exists()


def test_failed_scontrol_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", f"{_fake_scontrol(tmp_path, exit_code=1)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    with caplog.at_level(logging.ERROR, logger="recipes.launch.preemption"):
        assert PreemptionGuard(enabled=False).requeue() is False
    assert "fake failure" in caplog.text
    assert (tmp_path / "calls.txt").read_text().split() == ["requeue", "7"]


_TWO_RANKS = """
import json, os, signal, sys
import torch.distributed as dist
from recipes.launch.preemption import PreemptionGuard
dist.init_process_group("gloo")
rank = dist.get_rank()
guard = PreemptionGuard()
stopped_at = None
for step in range(20):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGUSR1)
    if guard.should_stop():
        stopped_at = step
        break
print(json.dumps({"rank": rank, "stopped_at": stopped_at, "signal": guard.signal_name,
                  "requeued": guard.requeue()}))
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_ranks_stop_at_the_same_step_and_requeue_once(tmp_path: Path) -> None:
    bin_dir = _fake_scontrol(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "99",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_RANKS], cwd=ROOT, env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["stopped_at"] for r in results] == [3, 3]
    assert [r["signal"] for r in results] == [None, "SIGUSR1"]
    assert [r["requeued"] for r in results] == [True, True]
    assert (tmp_path / "calls.txt").read_text().split() == ["requeue", "99"]


def test_preemption_notice_is_a_console_line_and_kept_in_the_rank_log(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notice came as ``[time][recipes.launch.preemption][WARNING] - preemption: ...`` (Hydra's
    log format): it is the project's own line on stdout, once, and the rank's log file keeps it."""
    import io

    from recipes.launch.console import ConsoleFilter

    monkeypatch.setenv("RANK", "0")
    hydra_format = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    console, log_file = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(console), logging.StreamHandler(log_file)]  # as conf/config.yaml
    handlers[0].addFilter(ConsoleFilter())
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.INFO)
    for handler in handlers:
        handler.setFormatter(hydra_format)
        root.addHandler(handler)
    guard = PreemptionGuard(("SIGUSR1",))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.should_stop() and guard.should_stop()  # announced once
    finally:
        guard.close()
        for handler in handlers:
            root.removeHandler(handler)
        root.setLevel(old_level)
    notice = "preemption: SIGUSR1 received on rank 0; stopping after this step"
    assert capsys.readouterr().out == notice + "\n"
    assert console.getvalue() == ""
    assert log_file.getvalue().rstrip().endswith(f"[kpool.console][INFO] - {notice}")


def test_notice_when_another_rank_got_the_signal() -> None:
    guard = PreemptionGuard(enabled=False)
    assert guard.notice() == "preemption: another rank received a stop signal; stopping after this step"
