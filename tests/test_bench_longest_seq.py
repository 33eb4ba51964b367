"""``scripts/bench/longest_seq.py``: its presets are configs the schema accepts at 128K tokens,
overrides after ``--`` reach ``train.py``, and the dry run's planned memory is read per length."""

from __future__ import annotations

import json
import sys

import pytest

from recipes.config.rules import all_problems
from tests.test_bench_precision import _script
from tests.test_config import _compose


@pytest.mark.parametrize("preset", ["whole", "chunked_loss", "selective_recompute", "full_recompute"])
def test_presets_are_valid_at_128k(preset: str) -> None:
    bench = _script("longest_seq")
    overrides = bench.DEFAULTS + ["data.seq_length=131072", "model.max_position_embeddings=131072"]
    assert all_problems(_compose(overrides + bench.PRESETS[preset]), 1) == []


def test_overrides_and_the_planned_memory_reach_the_runs(monkeypatch, tmp_path, capsys) -> None:
    """``main`` with a preset and an override after ``--``: each length's ``train.py`` command line
    ends with the preset's keys and the override, and its dry run's figure lands in the JSON
    (the training run itself replaced by a stub that reports a timeout)."""
    bench = _script("longest_seq")
    seen = []

    class Done:
        returncode, stdout = 0, "largest: stage 0, 59.0 GiB -> 141 GB (H200): fits\n"

    def fake_run(cmd, **kwargs):  # noqa: ANN001, ANN202
        seen.append(cmd)
        if "train.dry_run=true" in cmd:
            return Done()
        raise bench.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["longest_seq.py", "--seqs", "32768", "--preset", "full_recompute",
                                      "--out", str(out), "--", "train.log_interval=1"])
    bench.main()
    dry, run = seen
    assert run[-5:] == bench.PRESETS["full_recompute"] + ["train.log_interval=1"] and "--" not in run
    assert dry == run + ["train.dry_run=true"]
    result = json.loads(out.read_text())
    assert result["preset"] == "full_recompute"
    assert result["runs"] == [{"seq_length": 32768, "status": "timeout", "timeout_s": 240, "planned_gib": 59.0}]
