"""End-to-end SLURM tests on the local cluster of scripts/slurm_local.sh (CPU, gloo, 2 tasks):

    bash scripts/slurm_local.sh --sacct && export SLURM_CONF=/tmp/kpool-slurm/slurm.conf
    .venv/bin/python -m pytest -m slurm tests/test_slurm.py

slurm/train.sbatch trains the tiny model (TP=2) and checkpoints; a USR1 mid-run makes the job
requeue itself and resume to the same final loss; a Hydra sweep through hydra/launcher=slurm runs
as an array job and writes its summary; a USR1 to a sweep element requeues it and the sweep waits
for the resumed run (same final loss as an uninterrupted run); a bad override fails the job with
the error in its log.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train_runner import run_train

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"
# Two CPU tasks stand for two GPUs (the header asks for 8 GPUs per node).
CPU_TASKS = ["--gpus-per-node=0", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1"]
TINY = ["parallelism=tp2", "model=glm5_tiny", "precision=fp32", "logging.mode=disabled"]
STEPS = 10
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL"}


def _cluster_problem() -> str | None:
    """Why the SLURM tests cannot run here, or None if they can."""
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF is unset: start a cluster with `bash scripts/slurm_local.sh --sacct`"
    if shutil.which("sbatch") is None or shutil.which("sacct") is None:
        return "sbatch/sacct not on PATH: run `bash scripts/slurm_local.sh --sacct`"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if "UP" not in ping.stdout:
        return f"slurmctld not reachable with SLURM_CONF={os.environ['SLURM_CONF']}: {ping.stdout}{ping.stderr}"
    acct = subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, text=True, timeout=30)
    if acct.returncode != 0:
        return f"sacct does not work (start the cluster with --sacct): {acct.stderr.strip()}"
    return None


pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", autouse=True)
def _cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)


def _sbatch(tmp: Path, *overrides: str, slurm_args: tuple[str, ...] = ()) -> str:
    """Submits slurm/train.sbatch from the project root; runs go under tmp/runs. Returns the job id."""
    out = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp}/slurm-%j.out", *CPU_TASKS, *slurm_args,
         str(SBATCH), *overrides],
        cwd=ROOT, env={**os.environ, "KPOOL_RUN_ROOT": str(tmp / "runs")},
        capture_output=True, text=True, check=True, timeout=60,
    )
    return out.stdout.strip().split(";")[0]


def _state(job_id: str) -> tuple[str, str]:
    """(state, exit code) of the job's latest run as sacct reports it; ("", "") before it is known."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
        capture_output=True, text=True, timeout=30,
    ).stdout.strip().splitlines()
    if not out:
        return "", ""
    state, code = out[-1].split("|")
    return state.split()[0], code


def _wait(job_id: str, timeout_s: float = 300) -> tuple[str, str]:
    """Polls until the job is finished (in sacct and gone from squeue); returns (state, exit code)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, code = _state(job_id)
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout
        if state in TERMINAL and not queued.strip():
            return state, code
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"job {job_id} not finished after {timeout_s}s (last state {_state(job_id)})")


def _read_result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _log(tmp: Path, job_id: str) -> str:
    return (tmp / f"slurm-{job_id}.out").read_text()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, float]:
    """One uninterrupted TP=2 run: (tmp dir, job id, wall seconds)."""
    tmp = tmp_path_factory.mktemp("full")
    start = time.monotonic()
    # An override with spaces checks that "$@" reaches train.py with its quoting intact.
    job = _sbatch(tmp, *TINY, f"train.steps={STEPS}", "logging.project=kpool slurm test")
    state, code = _wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), _log(tmp, job)
    return tmp, job, time.monotonic() - start


def test_sbatch_trains_and_checkpoints(full_run: tuple[Path, str, float]) -> None:
    tmp, job, seconds = full_run
    run_dir = tmp / "runs" / f"slurm-{job}"
    result = _read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == STEPS
    assert "logging.project=kpool slurm test" in result["overrides"]
    assert any((run_dir / "checkpoints").iterdir()), "no checkpoint written"
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"rank-0.log", "rank-1.log"}
    assert "2 ranks" in _log(tmp, job)
    print(f"uninterrupted {STEPS}-step TP=2 job: {seconds:.0f}s")


def test_usr1_requeues_and_resumes_to_the_same_loss(
    full_run: tuple[Path, str, float], tmp_path: Path
) -> None:
    start = time.monotonic()
    job = _sbatch(tmp_path, *TINY, f"train.steps={STEPS}")
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline, "the job never logged a step"
        time.sleep(0.1)
    # No --batch: like `#SBATCH --signal=USR1@120`, this signals the training ranks themselves.
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    state, code = _wait(job)
    assert (state, code) == ("COMPLETED", "0:0"), _log(tmp_path, job)

    log = _log(tmp_path, job)
    assert "restart 1" in log, f"job was not requeued:\n{log}"
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "SIGUSR1 received" in rank0 and "resumed from" in rank0, rank0
    result = _read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == STEPS
    reference = _read_result(full_run[0] / "runs" / f"slurm-{full_run[1]}")["final_loss"]
    assert math.isclose(result["final_loss"], reference, rel_tol=1e-5), (result, reference)
    print(f"preempted + requeued job: {time.monotonic() - start:.0f}s")


def test_hydra_sweep_runs_as_array_job_and_writes_summary(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
         "hydra.launcher.cpus_per_task=1", "model.dsa_indexer_kpool=1,2", "train.steps=4",
         "precision=fp32", "logging.mode=disabled"],
        cwd=ROOT, env={**os.environ, "KPOOL_RUN_ROOT": str(tmp_path)},
        capture_output=True, text=True, timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sweep_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    array_elements = sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and "_" in p.name)
    job = array_elements[0].split("_")[0]
    assert array_elements == [f"{job}_0", f"{job}_1"], array_elements
    summary = (sweep_dir / "summary.csv").read_text().splitlines()
    assert len(summary) == 3 and all(",completed,4," in row for row in summary[1:]), summary
    for element in array_elements:
        assert _wait(element, timeout_s=60) == ("COMPLETED", "0:0")  # sacct lags the results
    print(f"2-point sweep as array job {job}: {time.monotonic() - start:.0f}s")


def test_usr1_requeues_a_sweep_element_which_resumes_to_the_same_loss(tmp_path: Path) -> None:
    """A time-limit signal to a submitit-launched sweep element: the guard checkpoints and
    requeues it, the element re-runs the same Hydra job, resumes, and the sweep completes with the
    loss of an uninterrupted run of the same config."""
    start = time.monotonic()
    point = ["train.steps=20", "precision=fp32", "logging.mode=disabled", "data.seq_length=256"]
    sweep = subprocess.Popen(
        [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
         "hydra.launcher.cpus_per_task=1", "model.dsa_indexer_kpool=2", *point],
        cwd=ROOT, env={**os.environ, "KPOOL_RUN_ROOT": str(tmp_path)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (metrics := list(tmp_path.glob("*/*/metrics.jsonl"))) or not metrics[0].read_text():
            assert sweep.poll() is None, sweep.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the sweep element never logged a step"
            time.sleep(0.1)
        (log_file,) = metrics[0].parents[1].glob(".submitit/*/*_0_log.out")
        element = log_file.parent.name  # the element's job id (<array id>_0 when the array has several)
        subprocess.run(["scancel", "--signal=USR1", element], check=True, timeout=30)
        output, _ = sweep.communicate(timeout=400)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, output[-3000:]
    run_dir = metrics[0].parent
    console = log_file.read_text()  # both runs of the element append to the same submitit log
    assert "SIGUSR1 received" in console and "resumed from" in console, console[-3000:]
    result = _read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == 20, result
    summary = (run_dir.parent / "summary.csv").read_text().splitlines()
    assert len(summary) == 2 and ",completed,20," in summary[1], summary  # written after the requeued run
    reference = run_train(tmp_path / "reference", "ref", ["model.dsa_indexer_kpool=2", *point])
    ref_loss = _read_result(tmp_path / "reference" / "ref")["final_loss"]
    assert math.isclose(result["final_loss"], ref_loss, rel_tol=1e-5), (result, ref_loss, reference.returncode)
    print(f"preempted + requeued sweep element {element}: {time.monotonic() - start:.0f}s")


@pytest.mark.parametrize(
    "args, error",
    [(("train.no_such_key=1",), "unknown config key train.no_such_key"),
     (("-m", "train.lr=1,2"), "one run per job")],
)
def test_bad_input_fails_the_job_with_the_error_in_its_log(
    tmp_path: Path, args: tuple[str, ...], error: str
) -> None:
    start = time.monotonic()
    job = _sbatch(tmp_path, *TINY, *args)
    state, code = _wait(job, timeout_s=120)
    assert state == "FAILED" and code != "0:0", (state, code)
    assert error in _log(tmp_path, job)
    print(f"bad input {args}: failed in {time.monotonic() - start:.0f}s")
