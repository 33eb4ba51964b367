"""Quiet consoles beyond training: torch's distributed-checkpoint warnings on every load or resume
and megatron's Transformer Engine / apex / absl notes before the tools print anything."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from recipes.launch import console
from tests.train_runner import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_load_warnings_are_filtered_and_nothing_else() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.install_filters()
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
                      "is to load in a single process.", UserWarning)
        warnings.warn("The argument order of load has been changed. Please check the document to avoid "
                      "future breakages.", UserWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
        warnings.warn("some other torch.distributed note", UserWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", UserWarning)
    assert [str(w.message) for w in seen] == ["some other torch.distributed note",
                                              "Please use DTensor instead and we are deprecating ShardedTensor."]


@pytest.mark.parametrize("script", ["preprocess_data.py", "convert_checkpoint.py", "drift_report.py"])
def test_tools_print_their_help_without_warnings(script: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:")
