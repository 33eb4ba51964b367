"""The precision benchmark's summary and plot (scripts/bench/precision.py, plot_precision.py) on a
constructed metrics.jsonl whose answers are known."""

from __future__ import annotations

import importlib.util
import json
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def metrics(tmp_path: Path) -> Path:
    """Steps 1-8: step 1 slow (warm-up), steps 4 and 8 drift-measured (1.5 s), others 1.0 s."""
    lines = []
    for step in range(1, 9):
        time = 5.0 if step == 1 else (1.5 if step % 4 == 0 else 1.0)
        lines.append({"step": step, "loss": 10.0 - step, "step_time_s": time})
        if step % 4 == 0:
            lines.append({"step": step, "dsa/topk_overlap": 0.9 + step / 100, "dsa/topk_exact_rows": 0.5,
                          "dsa/score_rel_err": 0.01, "dsa/boundary_tie_frac": 0.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_summary_excludes_warmup_and_drift_steps_from_the_timing(metrics):
    bench = _script("precision")
    out = bench.summarise(metrics, Namespace(warmup=1))
    assert out["step_time_s"] == 1.0
    assert out["drift_overhead"] == pytest.approx(0.5)
    assert out["drift_overhead_at_default_interval"] == pytest.approx(0.5 / bench.DEFAULT_DRIFT_INTERVAL)
    assert (out["first_loss"], out["final_loss"], out["steps_done"]) == (9.0, 2.0, 8)
    assert out["topk_overlap"] == pytest.approx((0.94 + 0.98) / 2)
    assert out["overlap_by_step"] == [[4, pytest.approx(0.94)], [8, pytest.approx(0.98)]]
    text = bench.table([{"profile": "bf16", "status": "completed", **out},
                        {"profile": "fp8", "status": "partial", **{**out, "step_time_s": 1.5}},
                        {"profile": "serving_match", "status": "failed", "error": "boom\nValueError: x"}])
    assert "1.50" in text and "(stopped at step 8)" in text and "FAILED: ValueError: x" in text


def test_plot_merges_files_and_writes_a_png(metrics, tmp_path):
    bench, plot = _script("precision"), _script("plot_precision")
    summary = {"profile": "bf16", "status": "completed", **bench.summarise(metrics, Namespace(warmup=1))}
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"results": [summary, {"profile": "fp8", "status": "failed", "error": "e"}]}))
    second.write_text(json.dumps({"results": [{**summary, "profile": "fp8"}]}))
    assert list(plot.load([first, second])) == ["bf16", "fp8"]
    assert plot.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    png = tmp_path / "out.png"
    assert plot.main([str(first), str(second), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_use_the_experiment_asked_for():
    """``--experiment`` picks the preset of the runs (glm5_proxy_h200 by default), every profile
    gets the same overrides, and the FP8 profiles the backend."""
    bench = _script("precision")
    args = Namespace(steps=200, seed=1, drift_interval=10, logging_mode="disabled", override=["x=1"],
                     backend="torch", small=False, seq_length=4096, experiment="glm5_width_h200")
    assert bench._overrides(args, "bf16")[:2] == ["experiment=glm5_width_h200", "data.seq_length=4096"]
    assert bench._overrides(args, "fp8")[-2:] == ["x=1", "precision.backend=torch"]
    assert "--experiment" in bench.__doc__
    variant = bench._overrides(args, "fp8_bf16_backward")
    assert variant[:2] == ["experiment=glm5_width_h200", "data.seq_length=4096"]
    assert "precision=fp8" in variant and "precision.fp8_backward=bf16" in variant
    assert variant[-1] == "precision.backend=torch"
