"""recipes.observe.sweep: sweep summary from job dirs, and end to end through a Hydra multirun."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

from recipes.observe.sweep import find_job_dirs, record_job_result, write_summary

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(kpool: int, steps: int) -> str:
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 8.0 / step + kpool, "grad_norm": 1.0, "lr": 1e-4,
                  "tokens_per_s": 1000.0 * kpool + step, "step_time_s": 0.5,
                  "peak_mem_gib": 10.0 + step}
        lines.append(json.dumps(record))
    return "\n".join(lines) + "\n"


def _job(sweep: Path, num: int, overrides: list[str], metrics: str | None,
         result: dict | None) -> Path:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (job / "metrics.jsonl").write_text(metrics)
    if result is not None:
        (job / "result.json").write_text(json.dumps(result))
    return job


def _rows(sweep: Path) -> dict[str, dict[str, str]]:
    with (sweep / "summary.csv").open() as f:
        return {row["label"]: row for row in csv.DictReader(f)}


def test_summary_from_fake_job_dirs(tmp_path):
    sweep = tmp_path / "sweep"
    const = "trainer.steps=4"
    for num, kpool in ((0, 2), (10, 4)):
        _job(sweep, num, [f"model.dsa_indexer_kpool={kpool}", const], _metrics(kpool, 4),
             {"status": "completed", "error": None, "final_loss": 2.0 + kpool, "steps": 4,
              "overrides": [f"model.dsa_indexer_kpool={kpool}", const]})
    _job(sweep, 2, ["model.dsa_indexer_kpool=8", const], _metrics(8, 2) + '{"st',
         {"status": "failed", "error": "CUDA out of memory", "final_loss": None, "steps": 2,
          "overrides": ["model.dsa_indexer_kpool=8", const]})
    _job(sweep, 3, ["model.dsa_indexer_kpool=16", const], None, None)

    assert [p.name for p in find_job_dirs(sweep)] == ["0", "2", "3", "10"]
    write_summary(sweep)
    rows = _rows(sweep)
    assert list(rows) == [f"model.dsa_indexer_kpool={k}" for k in (2, 8, 16, 4)]
    done = rows["model.dsa_indexer_kpool=4"]
    assert (done["job"], done["status"], done["steps"], done["error"]) == ("10", "completed", "4", "")
    assert float(done["final_loss"]) == 6.0 and float(done["min_loss"]) == 6.0
    assert float(done["tokens_per_s"]) == 4002.5  # median over steps
    assert float(done["peak_mem_gib"]) == 14.0
    failed = rows["model.dsa_indexer_kpool=8"]
    assert (failed["status"], failed["error"], failed["steps"]) == ("failed", "CUDA out of memory", "2")
    assert float(failed["min_loss"]) == 12.0
    assert "indexer_time_share" not in failed  # nothing measures it: no empty column or panel
    missing = rows["model.dsa_indexer_kpool=16"]
    assert missing["status"] == "missing" and "result.json" in missing["error"]
    assert missing["overrides"] == f"model.dsa_indexer_kpool=16 {const}"

    md = (sweep / "summary.md").read_text()
    assert md.count("| model.dsa_indexer_kpool=") == 4
    failed_section = md.split("## Failed jobs")[1]
    assert "kpool=8` (2, failed): CUDA out of memory" in failed_section
    assert "kpool=16` (3, missing)" in failed_section
    assert "kpool=4`" not in failed_section
    png = (sweep / "summary.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert not [p for p in sweep.iterdir() if p.name.endswith(".tmp")]


def test_record_job_result_from_hydra_job_return(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(_metrics(1, 3))
    failed = JobReturn(overrides=["x=3"], status=JobStatus.FAILED)
    failed.return_value = ValueError("diverged")
    record_job_result(tmp_path, failed)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"status": "failed", "error": "ValueError: diverged", "overrides": ["x=3"],
                      "final_loss": 8.0 / 3 + 1, "steps": 3}
    completed = JobReturn(overrides=["x=3"], status=JobStatus.COMPLETED)
    record_job_result(tmp_path, completed)  # an existing result.json is kept
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"
    (tmp_path / "result.json").unlink()
    record_job_result(tmp_path, completed)
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "completed"


APP = '''
import json, os
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg):
    out = HydraConfig.get().runtime.output_dir
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for step in range(1, 4):
            f.write(json.dumps({"step": step, "loss": 6.0 / step + cfg.x, "grad_norm": 1.0,
                                "lr": 1e-3, "tokens_per_s": 100.0 * cfg.x, "step_time_s": 0.1,
                                "peak_mem_gib": 1.0 + cfg.x}) + "\\n")
    if cfg.x == 3:
        raise RuntimeError(f"boom at x={cfg.x}")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"status": "completed", "error": None, "final_loss": 2.0 + cfg.x, "steps": 3,
                   "overrides": list(HydraConfig.get().overrides.task)}, f)

if __name__ == "__main__":
    main()
'''


def test_hydra_multirun_with_failing_job(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(textwrap.dedent(f"""\
        x: 0
        seed: 1
        hydra:
          sweep:
            dir: {tmp_path / "multirun"}
          callbacks:
            sweep_summary:
              _target_: recipes.observe.sweep.SweepSummaryCallback
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "app.py", "-m", "x=1,2,3", "seed=5"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "boom at x=3" in proc.stderr  # the basic sweeper re-raises
    sweep = tmp_path / "multirun"
    rows = _rows(sweep)
    assert {k: v["status"] for k, v in rows.items()} == {
        "x=1": "completed", "x=2": "completed", "x=3": "failed"}
    assert rows["x=3"]["error"] == "RuntimeError: boom at x=3"
    assert rows["x=3"]["steps"] == "3" and float(rows["x=3"]["final_loss"]) == 5.0
    assert float(rows["x=2"]["final_loss"]) == 4.0
    assert rows["x=2"]["overrides"] == "x=2 seed=5"
    assert "RuntimeError: boom at x=3" in (sweep / "summary.md").read_text()
    # The sweep stops at the failed job; its last line still says where the summary is.
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"sweep summary (2/3 jobs completed): {sweep / 'summary.md'} (and summary.csv, summary.png)"
    assert (sweep / "summary.png").read_bytes().startswith(PNG_MAGIC)


def test_peak_memory_is_per_job_not_per_process() -> None:
    """The basic launcher runs a sweep's jobs in one process: a small job after a big one must not
    report the big one's peak."""
    import torch

    from recipes.observe.metrics import peak_memory_gib, reset_peak_memory

    cpu = torch.device("cpu")
    big = torch.ones(2**28 // 4 * 3)  # 768 MiB
    big_peak = peak_memory_gib(cpu)
    del big
    reset_peak_memory(cpu)
    assert peak_memory_gib(cpu) < big_peak - 0.5


def test_wandb_keys_are_grouped_and_sweeps_share_a_group(tmp_path, monkeypatch):
    import wandb

    from recipes.observe.metrics import MetricsLogger
    from recipes.config.schema import LoggingConfig, WandbMode

    logged, init = [], {}

    class FakeRun:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: init.update(kwargs) or FakeRun())
    cfg = LoggingConfig(mode=WandbMode.offline, project="p")
    logger = MetricsLogger(tmp_path, cfg, {}, enabled=True, group="2026-12-01_10-00-00_42")
    logger.log(1, {"loss": 2.0, "grad_norm": 1.0, "lr": 0.1, "tokens_per_s": 5.0, "mfu": 0.1,
                   "peak_mem_gib": 3.0, "dsa/topk_overlap": 0.9})
    logger.close()
    assert init["group"] == "2026-12-01_10-00-00_42"
    assert logged == [(1, {"train/loss": 2.0, "train/grad_norm": 1.0, "train/lr": 0.1,
                           "throughput/tokens_per_s": 5.0, "throughput/mfu": 0.1,
                           "memory/peak_mem_gib": 3.0, "dsa/topk_overlap": 0.9})]
    # metrics.jsonl keeps the flat names
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.0


def _drift_metrics(kpool: int, steps: int) -> str:
    """Step records as the trainer logs them with precision.drift.interval=2 (a drift record after
    the step's record, its layer mean under dsa/topk_overlap)."""
    lines = []
    for record in _metrics(kpool, steps).splitlines():
        lines.append(record)
        step = json.loads(record)["step"]
        if step % 2 == 0:
            lines.append(json.dumps({"step": step, "dsa/topk_overlap": 1.0 - 0.01 * step * kpool,
                                     "dsa/topk_overlap/layer_1": 1.0}))
    return "\n".join(lines) + "\n"


def test_summary_figure_shows_every_job_failed_ones_in_red(tmp_path):
    """summary.png left failed jobs out (its title promised them in red), labelled jobs by raw
    override strings, had no loss-axis label and no drift panel."""
    from matplotlib.colors import to_hex

    from recipes.observe.plot_style import FAILED_COLOR
    from recipes.observe.sweep import read_sweep, summary_figure

    sweep = tmp_path / "sweep"
    const = "train.steps=4"
    for num, kpool in ((0, 1), (1, 2)):
        overrides = [f"model.dsa_indexer_kpool={kpool}", const]
        _job(sweep, num, overrides, _drift_metrics(kpool, 4),
             {"status": "completed", "error": None, "final_loss": 2.0, "steps": 4, "overrides": overrides})
    _job(sweep, 2, ["model.dsa_indexer_kpool=4", const], _drift_metrics(4, 2),
         {"status": "failed", "error": "CUDA out of memory", "final_loss": None, "steps": 2,
          "overrides": ["model.dsa_indexer_kpool=4", const]})
    _job(sweep, 3, ["model.dsa_indexer_kpool=3", const], None,
         {"status": "failed", "error": "ConfigError", "final_loss": None, "steps": 0,
          "overrides": ["model.dsa_indexer_kpool=3", const]})
    jobs, rows = read_sweep(sweep)
    fig = summary_figure(jobs, rows)
    loss_ax, tps_ax, mem_ax, drift_ax = fig.axes[:4]
    labels = [f"dsa_indexer_kpool={k}" for k in (1, 2, 4, 3)]
    assert fig.get_suptitle() == "sweep: 2 of 4 jobs completed"

    assert loss_ax.get_xlabel() == "step" and loss_ax.get_ylabel().startswith("loss")
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert legend == [labels[0], labels[1], f"{labels[2]} (failed)", f"{labels[3]} (failed)"]
    colors = [to_hex(line.get_color()) for line in loss_ax.get_lines()]
    assert colors[2:] == [FAILED_COLOR, FAILED_COLOR] and FAILED_COLOR not in colors[:2]
    assert colors[0] != colors[1]
    assert [line.get_linestyle() for line in loss_ax.get_lines()] == ["-", "-", "--", "--"]

    for ax in (tps_ax, mem_ax):  # every job a bar, in job order, red when not completed
        assert [t.get_text() for t in ax.get_yticklabels()] == labels
        bars = [to_hex(p.get_facecolor()) for p in ax.patches]
        assert len(bars) == 4 and bars[2:] == [FAILED_COLOR] * 2 and FAILED_COLOR not in bars[:2]
        assert ax.get_xlabel()
    assert any("failed: no tokens_per_s" in t.get_text() for t in tps_ax.texts)  # the job without metrics

    assert drift_ax.get_ylabel() == "top-k overlap (mean over layers)"
    # overlaps 0.92 (kpool 4 at step 2, kpool 2 at step 4) .. 0.98 (kpool 1 at step 2); margin
    # max(5% of the span, 0.005) = 0.005 (plot_style.fraction_limits)
    assert drift_ax.get_ylim() == pytest.approx((0.915, 0.985))
    assert len(drift_ax.get_lines()) == 3  # the failed job's steps too

    no_drift = tmp_path / "plain"
    _job(no_drift, 0, ["x=1"], _metrics(1, 2), None)
    _job(no_drift, 1, ["x=2"], _metrics(2, 2), None)
    assert len(summary_figure(*read_sweep(no_drift)).axes) == 3  # no empty drift panel


def test_short_labels_are_the_swept_keys_and_values(tmp_path):
    from recipes.observe.sweep import Job, short_labels

    def job(name: str, overrides: list[str]) -> Job:
        return Job(tmp_path / name, overrides, "completed", None, 1, 1.0)

    jobs = [job("0", ["model.dsa_indexer_kpool=2", "+train.x.lr=0.1", "model.lr=1", "seed=3"]),
            job("1", ["model.dsa_indexer_kpool=4", "+train.x.lr=0.2", "model.lr=2", "seed=3"]),
            job("2", ["model.dsa_indexer_kpool=4", "+train.x.lr=0.2", "model.lr=2",
                      "seed=3", "data.paths=[" + "a" * 40 + "]"])]
    assert short_labels(jobs) == [
        "dsa_indexer_kpool=2, model.lr=1, train.x.lr=0.1",
        "dsa_indexer_kpool=4, model.lr=2, train.x.lr=0.2",
        "paths=[aaaaaaaaaaaaaaaaaaaaaa\u2026, dsa_indexer_kpool=4, model.lr=2, train.x.lr=0.2"]
    assert short_labels([job("7", []), job("8", [])]) == ["7", "8"]


def test_summary_of_a_sweep_without_jobs_yet(tmp_path):
    import warnings

    (tmp_path / "sweep").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "No artists with labels found"
        assert write_summary(tmp_path / "sweep") == []
    assert (tmp_path / "sweep" / "summary.png").read_bytes().startswith(PNG_MAGIC)
