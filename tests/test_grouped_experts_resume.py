"""``train.py`` with grouped experts on the CPU: an exact resume, and a resume of its optimizer
state by sequential experts refused with the fix named (weights alone load either way:
tests/test_grouped_experts.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.train_runner import ROOT, metrics, subprocess_env

COMMON = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled", "train.steps=4"]


def _train(root: Path, run_id: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """``train.py`` on one rank with its own rendezvous port (29500 may be taken on a shared host)."""
    env = subprocess_env(KPOOL_RUN_ROOT=str(root), KPOOL_RUN_ID=run_id, WANDB_SILENT="true",
                         OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *COMMON, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_grouped_resume_is_exact_and_a_sequential_resume_is_refused(tmp_path: Path) -> None:
    full = _train(tmp_path, "full", ["model.moe_grouped_gemm=true", "train.save_interval=2"])
    assert full.returncode == 0, full.stderr[-4000:]
    ckpt = tmp_path / "full" / "checkpoints" / "iter_0000002"
    resumed = _train(tmp_path, "resumed", ["model.moe_grouped_gemm=true", f"train.resume={ckpt}"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == [r["loss"] for r in metrics(tmp_path / "full")[2:]]
    refused = _train(tmp_path, "refused", ["model.moe_grouped_gemm=false", f"train.resume={ckpt}"])
    assert refused.returncode != 0
    assert "saved with GroupedExperts" in refused.stderr and "model.moe_grouped_gemm=true" in refused.stderr
