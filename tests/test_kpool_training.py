"""KPool end to end through train.py: the tiny model trains with kpool=4 (+ tail), and a Hydra
multirun over kpool writes the sweep summary with an invalid value marked failed."""

from __future__ import annotations

import csv
from pathlib import Path

from tests.train_runner import metrics, run_train

FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled"]


def test_kpool4_with_tail_trains_and_loss_falls(tmp_path: Path) -> None:
    run_train(tmp_path, "kpool4", FAST + ["model.dsa_indexer_kpool=4",
                                          "model.dsa_indexer_kpool_always_select_tail=true",
                                          "train.steps=20"])
    rows = metrics(tmp_path / "kpool4")
    assert len(rows) == 20
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 1.0


def test_multirun_over_kpool_summarises_and_fails_the_invalid_job(tmp_path: Path) -> None:
    out = run_train(tmp_path, "sweep", ["-m", *FAST, "train.steps=4", "train.lr_warmup_steps=1",
                                        "model.dsa_indexer_kpool=2,3"], check=False)
    sweep = tmp_path / "sweep"
    with open(sweep / "summary.csv") as f:
        rows = {r["label"]: r for r in csv.DictReader(f)}
    assert rows["model.dsa_indexer_kpool=2"]["status"] == "completed"
    failed = rows["model.dsa_indexer_kpool=3"]
    assert failed["status"] == "failed" and "model.dsa_indexer_kpool=3" in failed["error"]
    assert (sweep / "summary.md").is_file() and (sweep / "summary.png").stat().st_size > 0
    # One job dir per value, named by its overrides (Hydra's override_dirname).
    (job2,) = [p for p in sweep.iterdir() if "model.dsa_indexer_kpool=2" in p.name]
    assert (job2 / "metrics.jsonl").is_file()
    assert out.returncode != 0  # Hydra's basic sweeper re-raises the failed job's error


def test_packed_documents_train_as_thd(tmp_path: Path) -> None:
    """``data.reset_attention_mask=true``: each micro batch runs as packed THD documents."""
    run_train(tmp_path, "packed", FAST + ["data.reset_attention_mask=true", "data.reset_position_ids=true",
                                          "train.micro_batch_size=1", "train.global_batch_size=2",
                                          "model.dsa_indexer_kpool=2", "train.steps=6"])
    rows = metrics(tmp_path / "packed")
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
