"""``make test``: ``make test ARGS="... -q"`` ran ``pytest -q ... -q``, and pytest's -q -q drops
the summary line ("N passed"), so a run ended without saying whether anything passed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("quiet", ["-q", "--quiet"])
def test_make_test_with_quiet_args_keeps_the_summary_line(tmp_path: Path, quiet: str) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    # -o .venv/.installed: never (re)build the virtual environment here; PY: this interpreter.
    proc = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "test", f"PY={sys.executable}",
         f"ARGS={tmp_path / 'test_one.py'} {quiet} -p no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("1 passed in "), proc.stdout
