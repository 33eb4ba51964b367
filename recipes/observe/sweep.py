"""Summary of a Hydra multirun sweep: ``summary.csv``, ``summary.md`` and ``summary.png``.

Each training job writes into its Hydra output dir (``hydra.runtime.output_dir``):

* ``metrics.jsonl``: one JSON object per logged step with ``step``, ``loss``, ``grad_norm``,
  ``lr``, ``tokens_per_s``, ``step_time_s`` and ``peak_mem_gib`` (the job's own peak: the loop
  resets it when a job starts, as the basic launcher runs all jobs in one process), and
  ``val/loss`` on the steps that evaluated (``train.eval_interval``);
* ``result.json``: ``{"status": "completed" | "failed", "error", "overrides", "final_loss",
  "steps"}``.

:class:`SweepSummaryCallback` (conf: ``hydra.callbacks.sweep_summary._target_:
recipes.observe.sweep.SweepSummaryCallback``) completes ``result.json`` from Hydra's job return and
rewrites the sweep summary at the end of *every* job, because Hydra's basic sweeper raises after
a failed job and never reaches ``on_multirun_end``, and because with hydra-submitit-launcher
``on_job_end`` runs inside the SLURM job while the launching process may be gone.
``on_multirun_end`` rewrites it once more when it is reached; each rewrite prints its path. Jobs of a sweep end concurrently,
so every file is written to a temporary name and moved into place with ``os.replace``.

A job dir (one holding ``.hydra/overrides.yaml`` or ``result.json``) without ``result.json`` is
listed as ``missing``: still running when the summary was written, or killed (OOM, time limit).
Jobs are labelled by the overrides that differ between jobs, e.g. ``model.dsa_indexer_kpool=4``
(``summary.png``: shorter, :func:`short_labels`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf

from recipes.launch.result import RESULT_FILE, RunResult
from recipes.observe.drift_names import OVERLAP
from recipes.observe.metrics import VAL_LOSS
from recipes.observe.plot_style import FAILED_COLOR, LineStyle, distinct_styles, fraction_limits
from recipes.observe.sweep_jobs import read_launched_jobs, record_launched_jobs

log = logging.getLogger(__name__)

LABEL_VALUE_CHARS = 24
"""Longest override value shown whole in a plot label."""
COMPLETED_BAR = "#4c72b0"
"""The bar colour of completed jobs (not completed: :data:`FAILED_COLOR`)."""

METRICS_FILE = "metrics.jsonl"
CSV_COLUMNS = (
    "job", "label", "status", "steps", "final_loss", "min_loss", "final_val_loss", "tokens_per_s", "step_time_s",
    "peak_mem_gib", "error", "overrides",
)


@dataclass
class Job:
    """What one job dir holds."""

    directory: Path
    overrides: list[str]
    status: str
    error: str | None
    steps: int
    final_loss: float | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a ``metrics.jsonl``; skips lines that do not parse (e.g. a line being
    written while the summary is built)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def _hydra_overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.is_file() else []


def load_job(job_dir: Path) -> Job:
    """The status, error, overrides and metrics of one job dir."""
    metrics = read_metrics(job_dir / METRICS_FILE)
    result = RunResult.read(job_dir)
    last_loss = metrics[-1].get("loss") if metrics else None
    last_step = int(metrics[-1]["step"]) if metrics else 0
    if result is None:
        return Job(job_dir, _hydra_overrides(job_dir), "missing",
                   f"no {RESULT_FILE} (still running, or killed before it ended)",
                   last_step, last_loss, metrics)
    return Job(job_dir, [str(o) for o in result.overrides or _hydra_overrides(job_dir)],
               result.status, result.error, result.steps or last_step, result.final_loss, metrics)


def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Job dirs under ``sweep_dir`` (any depth), ordered numerically where names are numbers."""
    found = {p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}
    found |= {p.parent for p in sweep_dir.rglob(RESULT_FILE)}
    found.discard(sweep_dir)

    def key(path: Path) -> tuple:
        rel = path.relative_to(sweep_dir).parts
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in rel)

    return sorted(found, key=key)


def label_jobs(jobs: list[Job]) -> None:
    """Sets each job's label to its overrides that are not the same in all jobs (all of its
    overrides if none differ, its dir name if it has none)."""
    def key(override: str) -> str:
        return override.split("=", 1)[0]

    per_job = [{key(o): o for o in job.overrides} for job in jobs]
    keys = {k for overrides in per_job for k in overrides}
    varying = {k for k in keys if len({overrides.get(k) for overrides in per_job}) > 1}
    for job in jobs:
        shown = [o for o in job.overrides if key(o) in varying] or job.overrides
        job.label = ",".join(shown) or job.directory.name


def _median(metrics: list[dict[str, Any]], key: str) -> float | None:
    values = [float(m[key]) for m in metrics if m.get(key) is not None]
    return statistics.median(values) if values else None


def summary_row(job: Job, sweep_dir: Path) -> dict[str, Any]:
    """One summary row: medians over logged steps of tokens/s and step time, the maximum peak
    memory, the minimum loss and the last ``val/loss`` (empty when the job computed none)."""
    losses = [float(m["loss"]) for m in job.metrics if m.get("loss") is not None]
    peaks = [float(m["peak_mem_gib"]) for m in job.metrics if m.get("peak_mem_gib") is not None]
    return {
        "job": job.directory.relative_to(sweep_dir).as_posix(),
        "label": job.label,
        "status": job.status,
        "steps": job.steps,
        "final_loss": job.final_loss,
        "min_loss": min(losses) if losses else None,
        "final_val_loss": next((m[VAL_LOSS] for m in reversed(job.metrics) if m.get(VAL_LOSS) is not None), None),
        "tokens_per_s": _median(job.metrics, "tokens_per_s"),
        "step_time_s": _median(job.metrics, "step_time_s"),
        "peak_mem_gib": max(peaks) if peaks else None,
        "error": job.error if job.status != "completed" else None,
        "overrides": " ".join(job.overrides),
    }


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Calls ``write`` on a unique temporary path next to ``path``, then renames it over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _csv_text(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _markdown_text(rows: list[dict[str, Any]]) -> str:
    columns = [c for c in CSV_COLUMNS if c not in ("error", "overrides")]
    lines = [
        "# Sweep summary",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows),
    ]
    failed = [row for row in rows if row["status"] != "completed"]
    if failed:
        lines += ["", "## Failed jobs", ""]
        lines += [f"- `{row['label']}` ({row['job']}, {row['status']}): {_cell(row['error'])}"
                  for row in failed]
    return "\n".join(lines) + "\n"


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def short_labels(jobs: list[Job]) -> list[str]:
    """Plot labels: each job's swept keys and values, ``key=value`` joined by ``, ``, with the key's
    last dotted component (``model.dsa_indexer_kpool=4`` -> ``dsa_indexer_kpool=4``; the whole key
    where two swept keys share that component) and values cut to :data:`LABEL_VALUE_CHARS`; the
    full overrides stay in ``summary.csv``. A job with no swept key is labelled by its dir name."""
    per_job = [{_override_key(o): o.split("=", 1)[1] if "=" in o else "" for o in job.overrides}
               for job in jobs]
    keys = {k for overrides in per_job for k in overrides}
    swept = sorted(k for k in keys if len({overrides.get(k) for overrides in per_job}) > 1)
    tails = [k.rsplit(".", 1)[-1] for k in swept]
    names = {k: tail if tails.count(tail) == 1 else k for k, tail in zip(swept, tails)}

    def value(text: str) -> str:
        return text if len(text) <= LABEL_VALUE_CHARS else text[:LABEL_VALUE_CHARS - 1] + "\u2026"

    return [", ".join(f"{names[k]}={value(overrides[k])}" for k in swept if k in overrides)
            or job.directory.name for job, overrides in zip(jobs, per_job)]


def _bar(ax: Any, labels: list[str], rows: list[dict[str, Any]], key: str, title: str, unit: str) -> None:
    """Every job as a bar (top to bottom in job order): blue-grey when completed, red otherwise;
    a job without the value gets an empty bar and its status in red text."""
    y = list(range(len(rows)))
    values = [row[key] or 0.0 for row in rows]
    ax.barh(y, values, color=[COMPLETED_BAR if row["status"] == "completed" else FAILED_COLOR for row in rows])
    for i, row in enumerate(rows):
        if row[key] is None:
            ax.text(0, i, f" {row['status']}: no {key}", va="center", color=FAILED_COLOR, fontsize="small")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()  # first job on top
    ax.set(title=title, xlabel=unit)


def summary_figure(jobs: list[Job], rows: list[dict[str, Any]]) -> Figure:
    """The figure of ``summary.png``: loss per step (``val/loss`` as markers), median tokens/s,
    peak memory and, when a job logged it, the top-k overlap per step (``dsa/topk_overlap``, the
    layer mean). Every job appears in every panel; jobs that did not complete are red (dashed
    lines), the others get distinct colours and markers (:func:`distinct_styles`)."""
    labels = short_labels(jobs)
    drift = any(m.get(OVERLAP) is not None for job in jobs for m in job.metrics)
    fig = Figure(figsize=(22 if drift else 16, 5.5), layout="constrained")
    axes = fig.subplots(1, 4 if drift else 3)
    loss_ax, tps_ax, mem_ax = axes[:3]
    styles = iter(distinct_styles(sum(job.status == "completed" for job in jobs)))
    for job, label in zip(jobs, labels):
        ok = job.status == "completed"
        style = next(styles) if ok else LineStyle(FAILED_COLOR, "x")
        kwargs = {"color": style.color, "marker": style.marker, "markersize": 4,
                  "linestyle": "-" if ok else "--", "label": label if ok else f"{label} ({job.status})"}
        _curve(loss_ax, job, "loss", kwargs)
        val = [(m["step"], m[VAL_LOSS]) for m in job.metrics if m.get(VAL_LOSS) is not None]
        if val:
            loss_ax.plot(*zip(*val), color=style.color, marker="D", linestyle="none", markersize=6,
                         markerfacecolor="none", label=f"{label} val/loss")
        if drift:
            _curve(axes[3], job, OVERLAP, kwargs)
        if not job.metrics:  # in the legend all the same, with what happened
            loss_ax.plot([], [], **kwargs)
    loss_ax.set(title="loss", xlabel="step", ylabel="loss (train; val/loss: open diamonds)")
    if loss_ax.lines:  # a sweep dir with no job yet has none
        loss_ax.legend(fontsize="small")
    if drift:
        overlaps = [float(m[OVERLAP]) for job in jobs for m in job.metrics if m.get(OVERLAP) is not None]
        axes[3].set_ylim(*fraction_limits(overlaps))
        axes[3].set(title="top-k drift", xlabel="step", ylabel="top-k overlap (mean over layers)")
        axes[3].legend(fontsize="small")
    _bar(tps_ax, labels, rows, "tokens_per_s", "tokens/s (median; red: not completed)", "tokens/s")
    _bar(mem_ax, labels, rows, "peak_mem_gib", "peak memory (red: not completed)", "GiB")
    done = sum(row["status"] == "completed" for row in rows)
    fig.suptitle(f"sweep: {done} of {len(rows)} jobs completed")
    return fig


def _curve(ax: Any, job: Job, key: str, kwargs: dict[str, Any]) -> None:
    points = [(m["step"], m[key]) for m in job.metrics if m.get(key) is not None]
    if points:
        ax.plot(*zip(*points), **kwargs)


def read_sweep(sweep_dir: Path) -> tuple[list[Job], list[dict[str, Any]]]:
    """The labelled jobs of ``sweep_dir`` and their summary rows."""
    jobs = [load_job(d) for d in find_job_dirs(sweep_dir)]
    label_jobs(jobs)
    return jobs, [summary_row(job, sweep_dir) for job in jobs]


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Writes ``summary.csv``, ``summary.md`` and ``summary.png`` into ``sweep_dir`` from its
    job dirs; returns the rows."""
    jobs, rows = read_sweep(sweep_dir)
    _atomic_write(sweep_dir / "summary.csv", lambda p: p.write_text(_csv_text(rows)))
    _atomic_write(sweep_dir / "summary.md", lambda p: p.write_text(_markdown_text(rows)))
    _atomic_write(sweep_dir / "summary.png",
                  lambda p: summary_figure(jobs, rows).savefig(p, format="png", dpi=100))
    return rows


def record_job_result(output_dir: Path, job_return: JobReturn) -> None:
    """Completes ``result.json`` from Hydra's job return: a failed job (the task raised) gets
    ``status: failed`` with the exception; a completed job that wrote none gets one from its
    metrics. A ``result.json`` the job wrote itself is kept unless Hydra saw it fail. A run whose
    directory is gone (a dry run's, :mod:`recipes.launch.unstarted_runs`) gets none."""
    if not output_dir.is_dir():
        return
    existing = RunResult.read(output_dir)
    failed = job_return.status == JobStatus.FAILED
    if existing is not None and (not failed or existing.status == "failed"):
        return
    metrics = read_metrics(output_dir / METRICS_FILE)
    error = job_return._return_value if failed else None  # return_value re-raises on failure
    RunResult("failed" if failed else "completed",
              f"{type(error).__name__}: {error}" if failed else None,
              list(job_return.overrides or []), metrics[-1].get("loss") if metrics else None,
              int(metrics[-1]["step"]) if metrics else 0).write(output_dir)


def _announce(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The line saying where the summary is and how many of the launched jobs completed
    (:mod:`recipes.observe.sweep_jobs`; the jobs found when the count was not recorded)."""
    done = sum(row["status"] == "completed" for row in rows)
    total = read_launched_jobs(sweep_dir) or len(rows)
    return (f"sweep summary ({done}/{total} jobs completed): {sweep_dir / 'summary.md'} "
            "(and summary.csv, summary.png)")


def _sweep_dir(config: DictConfig, output_dir: Path) -> Path:
    """The sweep dir of a job: its output dir without ``hydra.sweep.subdir`` (what ``run_job``
    joined), so it matches the dir the job really wrote to."""
    subdir = Path(str(config.hydra.sweep.subdir))
    if output_dir.parts[-len(subdir.parts):] == subdir.parts:
        return Path(*output_dir.parts[: -len(subdir.parts)])
    return Path(str(config.hydra.sweep.dir)).resolve()


class SweepSummaryCallback(Callback):
    """Hydra callback that keeps ``summary.{csv,md,png}`` of the sweep up to date (module doc).

    Summary errors are logged, never raised: they must not fail a training job. The summary line
    is printed after every job (a sweep that stops at a failed job also ends with it) and at the
    end of the sweep only when it says something new. :attr:`failed_jobs` (after the sweep) is
    how many jobs did not complete: ``kpool-train -m`` exits non-zero then.
    """

    failed_jobs: int = 0
    _last_line: str | None = None

    def _print(self, line: str, only_if_new: bool = False) -> None:
        if not (only_if_new and line == SweepSummaryCallback._last_line):
            print(line, flush=True)
        SweepSummaryCallback._last_line = line

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            record_launched_jobs(config, Path(str(config.hydra.sweep.dir)).resolve())
        except Exception:
            log.exception("could not count the sweep's jobs")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        output_dir = Path(str(config.hydra.runtime.output_dir))
        try:
            record_job_result(output_dir, job_return)
            if config.hydra.mode == RunMode.MULTIRUN:
                sweep_dir = _sweep_dir(config, output_dir)
                self._print(_announce(sweep_dir, write_summary(sweep_dir)))
        except Exception:
            log.exception("could not write the sweep summary for job %s", output_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        try:
            rows = write_summary(sweep_dir)
            SweepSummaryCallback.failed_jobs = sum(row["status"] != "completed" for row in rows)
            self._print(_announce(sweep_dir, rows), only_if_new=True)
        except Exception:
            log.exception("could not write the sweep summary in %s", sweep_dir)
