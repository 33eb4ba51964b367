"""Runs ``train.py`` the way a user does (a subprocess, optionally under torchrun) for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ADAM_EPS = 1e-4
"""``train.adam_eps`` for tests comparing the losses of runs on different layouts over several
steps. Adam's update ``lr * m / (sqrt(v) + eps)`` moves by up to ``lr * dg / eps`` when a gradient
component near zero moves by ``dg``: at the default eps of 1e-8, the ~1e-9 reordering differences of
the components that cancel to about zero become parameter differences of order ``lr`` after one
step (glm5_3_flash_tiny's step-3 loss then differs by 2.8e-5 while the step-2 gradient norms agree to
6e-6). At 1e-4 the same differences move a parameter by at most ``lr * 1e-5``."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables (ranks, master address/port, SLURM): a child
    process must not join this test process's (or a SLURM job's) rendezvous."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_RANK", "MASTER_"))}
    env.update(extra)
    return env


def run_train(root: Path, run_id: str, overrides: list[str], nproc: int = 1,
              check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """``[torchrun --nproc-per-node N] train.py overrides`` with runs under ``root/run_id``."""
    env = subprocess_env(KPOOL_RUN_ROOT=str(root), KPOOL_RUN_ID=run_id, WANDB_SILENT="true",
                         OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                f"--master-port={_free_port()}"]
    cmd += [str(ROOT / "train.py"), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    """The per-step records a run wrote."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
