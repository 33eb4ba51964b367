"""``scripts/bench/attention.py`` on the CPU: ``--kernels N`` records each backend's top ops of one
profiled forward + backward, largest first, and a negative count is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.train_runner import ROOT, subprocess_env

SCRIPT = ROOT / "scripts" / "bench" / "attention.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--small", "--seq", "64", "--repeats", "1",
                           *args], cwd=ROOT, env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=300)


def _top_ops(tmp_path: Path, n: int) -> tuple[list[dict], str]:
    out = tmp_path / f"k{n}.json"
    proc = _run("--backends", "torch", "--kernels", str(n), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"][0]["torch"]["kernels"], proc.stdout


def test_kernels_are_the_profiled_top_ops(tmp_path: Path) -> None:
    ops, stdout = _top_ops(tmp_path, 3)
    assert len(ops) == 3, ops
    assert all(isinstance(o["name"], str) and o["calls"] >= 1 and o["ms"] > 0 for o in ops), ops
    assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True), ops
    assert f"{ops[0]['ms']:10.3f} ms" in stdout
    every, _ = _top_ops(tmp_path, 10_000)  # all of them: the sparse attention's autograd nodes too
    assert 3 < len(every) < 10_000
    assert {"_SparseMLAAttention", "_SparseMLAAttentionBackward"} <= {o["name"] for o in every}


def test_negative_kernel_count_is_refused(tmp_path: Path) -> None:
    proc = _run("--kernels", "-1", "--out", str(tmp_path / "k.json"))
    assert proc.returncode == 2
    assert "--kernels must be >= 0, got -1" in proc.stderr
    assert not (tmp_path / "k.json").exists()
