"""``train.py precision=serving_match`` on CPU (emulated FP8) with top-k drift every 2 steps in
wandb offline mode: the precision map in the run dir, the drift metrics in metrics.jsonl and in the
wandb run file (read back with scripts/drift_report.py's reader), and the drift report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.train_runner import ROOT, metrics, run_train

LAYERS = [1, 2, 3, 4]


def test_serving_match_training_logs_drift_to_wandb(tmp_path: Path) -> None:
    from scripts.drift_report import drift_series, find_run_files, read_history

    run_dir = tmp_path / "sm"
    out = run_train(tmp_path, "sm", [
        "model=glm5_tiny", "precision=serving_match", "precision.backend=emulate",
        "precision.drift.interval=2", "data.seq_length=64", "train.steps=4",
        "train.lr_warmup_steps=1", "logging.mode=offline",
    ])
    assert "precision serving_match: backend emulate" in out.stdout
    assert "drift step     2 vs serving | topk_overlap 1.0000" in out.stdout

    rows = json.loads((run_dir / "precision_map.json").read_text())
    by_role = {r["role"]: r for r in rows}
    assert by_role["moe.expert_fc1"]["quantized"] and by_role["moe.expert_fc1"]["backend"] == "emulate"
    assert not by_role["indexer.q"]["quantized"] and by_role["indexer.weights"]["dtype"] == "float32"

    records = [r for r in metrics(run_dir) if "dsa/topk_overlap" in r]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert r["dsa/topk_overlap"] == 1.0 and r["dsa/score_rel_err"] == 0.0
        assert {f"dsa/topk_exact_rows/layer_{i}" for i in LAYERS} <= set(r)
        assert 0.0 <= r["dsa/boundary_tie_frac"] <= 1.0

    (run_file,) = find_run_files(run_dir)
    series = drift_series(read_history(run_file))
    assert {"topk_overlap", "topk_exact_rows", "topk_mismatch_frac", "topk_jaccard",
            "boundary_tie_frac", "score_rel_err"} <= set(series)
    assert sorted(series["topk_overlap"]) == LAYERS
    assert all(series["topk_overlap"][i] == {2: 1.0, 4: 1.0} for i in LAYERS)

    subprocess.run([sys.executable, str(ROOT / "scripts" / "drift_report.py"), str(run_dir)],
                   check=True, cwd=ROOT, capture_output=True, timeout=120)
    report = run_dir / "drift_report"
    assert (report / "topk_overlap_lines.png").stat().st_size > 1000
    assert (report / "topk_overlap_heatmap.png").stat().st_size > 1000
    assert "| 4 | 2 | 1.0000 | 1.0000 |" in (report / "drift_report.md").read_text()
