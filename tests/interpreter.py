"""Runs Python code under Triton's interpreter in a subprocess: ``TRITON_INTERPRET=1`` must be set
before triton is imported, which this test process has already done without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, timeout: int = 900) -> str:
    """``python -c code`` from the repository root with ``TRITON_INTERPRET=1``, one OpenMP thread
    and no visible GPU; asserts it exits 0 and returns its standard output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout
