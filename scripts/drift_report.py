"""Plot and summarise top-k drift metrics of a run.

    python scripts/drift_report.py RUN_DIR [--out DIR] [--prefix dsa]

RUN_DIR is a run directory (its ``metrics.jsonl`` is read, so ``logging=none`` runs work too), a
``metrics.jsonl`` file, or, for runs without one, a directory holding
``wandb/offline-run-*/run-*.wandb`` (searched recursively), an ``offline-run-*`` directory or a
``.wandb`` file. Keys ``<prefix>/<metric>/layer_<i>`` (as logged
by the trainer, e.g. ``dsa/topk_overlap/layer_1``) are collected per metric, and for each metric
the report writes ``<metric>_lines.png`` (value over steps, one line per layer, each its own
colour and marker), ``<metric>_heatmap.png`` (layer x step, with a labelled colorbar) and a section
of ``drift_report.md`` (per-layer first / last / mean / min; ``topk_overlap`` first). Fractions
(overlaps, row shares) are drawn within [0, 1], ``score_rel_err`` from 0. Output goes to ``RUN_DIR/drift_report`` unless ``--out`` is given.

wandb 0.31 has no Python reader for its ``.wandb`` transaction log (the Go core writes it), so the
file is read here: a LevelDB-style log (7-byte file header ``":W&B"``, magic ``0xBEE1``, version 0;
32 KiB blocks of records with a 7-byte header ``crc32 | length | type``, types full / first /
middle / last, CRC-32 of the type byte followed by the data) whose records are
``wandb.proto.wandb_internal_pb2.Record`` protobufs. History values come from the typed
``HistoryItem.value`` oneof or from ``value_json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
import zlib
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from a checkout: this checkout's recipes
    sys.path.insert(0, str(ROOT))

from matplotlib.figure import Figure  # noqa: E402

from recipes.observe.drift_names import FRACTIONS, metric_order  # noqa: E402
from recipes.observe.plot_style import distinct_styles, fraction_limits  # noqa: E402

HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

Series = dict[str, dict[int, dict[int, float]]]
"""metric -> layer -> step -> value."""


def find_run_files(path: Path) -> list[Path]:
    """The ``.wandb`` files of a run directory, oldest first (offline-run dirs are timestamped)."""
    if path.is_file():
        return [path]
    files = sorted(path.rglob("run-*.wandb"), key=lambda p: p.parent.name)
    files = [f for f in files if f.parent.name.startswith(("offline-run-", "run-"))]
    if not files:
        raise FileNotFoundError(f"no metrics.jsonl in {path} and no wandb/offline-run-*/run-*.wandb under it")
    return files


def iter_records(path: Path) -> Iterator[bytes]:
    """Payloads of the log records of a ``.wandb`` file; stops at a truncated tail (a run that
    was killed mid-write) and raises ``ValueError`` on a bad header or checksum."""
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise ValueError(f"{path}: too short for a wandb log header")
    ident, magic, version = HEADER.unpack_from(data)
    if (ident, magic, version) != (IDENT, MAGIC, VERSION):
        raise ValueError(f"{path}: not a wandb v0 log (header {ident!r} {magic:#x} v{version})")
    off, pending = HEADER.size, b""
    while True:
        if BLOCK - off % BLOCK < RECORD_HEADER.size:
            off += BLOCK - off % BLOCK  # block trailer too small for a header: zero padding
        if off + RECORD_HEADER.size > len(data):
            return
        crc, length, kind = RECORD_HEADER.unpack_from(data, off)
        start = off + RECORD_HEADER.size
        if start + length > len(data) or (crc, length, kind) == (0, 0, 0):
            return
        chunk = data[start : start + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: checksum mismatch at byte {off}")
        off = start + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            raise ValueError(f"{path}: unknown record type {kind} at byte {off}")


def _item_value(item) -> Optional[float]:  # noqa: ANN001 (wandb_internal_pb2.HistoryItem)
    kind = item.WhichOneof("value")
    if kind in ("integer", "number", "boolean"):
        value = getattr(item, kind)
    elif kind == "json":
        value = json.loads(item.json)
    elif kind is None and item.value_json:
        value = json.loads(item.value_json)
    else:
        return None
    return float(value) if isinstance(value, (int, float)) else None  # bool is an int


def read_history(path: Path) -> dict[int, dict[str, float]]:
    """Numeric history of one ``.wandb`` file: step -> {key: value}."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows: dict[int, dict[str, float]] = {}
    for payload in iter_records(path):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = rows.setdefault(record.history.step.num, {})
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            value = _item_value(item)
            if value is not None:
                row[key] = value
    return rows


def drift_series(history: dict[int, dict[str, float]], prefix: str = "dsa") -> Series:
    """``<prefix>/<metric>/layer_<i>`` keys of ``history`` as metric -> layer -> step -> value."""
    pattern = re.compile(rf"^{re.escape(prefix)}/(?P<metric>[^/]+)/layer_(?P<layer>\d+)$")
    series: Series = {}
    for step, row in history.items():
        for key, value in row.items():
            m = pattern.match(key)
            if m and math.isfinite(value):
                series.setdefault(m["metric"], {}).setdefault(int(m["layer"]), {})[step] = value
    return series


def _axis_label(metric: str) -> str:
    return f"{metric} (fraction)" if metric in FRACTIONS else f"{metric} (relative error)"


def _value_limits(metric: str, values: list[float]) -> tuple[float, float]:
    """Fractions (overlaps, row shares) within [0, 1]; a relative error from 0."""
    if metric in FRACTIONS:
        return fraction_limits(values)
    return 0.0, max(max(values) * 1.05, 1e-12)


def lines_figure(metric: str, layers: dict[int, dict[int, float]]) -> Figure:
    """``metric`` over steps, one line per layer, each layer its own colour and marker
    (:func:`recipes.observe.plot_style.distinct_styles`, distinct for any layer count)."""
    order = sorted(layers)
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for layer, style in zip(order, distinct_styles(len(order))):
        xs = sorted(layers[layer])
        ax.plot(xs, [layers[layer][s] for s in xs], label=f"layer {layer}", color=style.color,
                marker=style.marker, markersize=4 if len(xs) < 50 else 0)
    values = [v for per_step in layers.values() for v in per_step.values()]
    ax.set_ylim(*_value_limits(metric, values))
    ax.set(xlabel="step", ylabel=_axis_label(metric), title=f"{metric} per layer")
    ax.legend(fontsize="small", ncol=max(1, math.ceil(len(order) / 12)))
    return fig


def heatmap_figure(metric: str, layers: dict[int, dict[int, float]]) -> Figure:
    """``metric`` as a layer x step image with a labelled colorbar over the same value range as
    :func:`lines_figure`'s axis; steps a layer did not log are blank."""
    import numpy as np

    order = sorted(layers)
    steps = sorted({s for per_step in layers.values() for s in per_step})
    grid = np.full((len(order), len(steps)), np.nan)
    col = {s: j for j, s in enumerate(steps)}
    for i, layer in enumerate(order):
        for s, v in layers[layer].items():
            grid[i, col[s]] = v
    fig = Figure(figsize=(8, max(2.5, 0.3 * len(order) + 1.5)), layout="constrained")
    ax = fig.subplots()
    lo, hi = _value_limits(metric, [v for per_step in layers.values() for v in per_step.values()])
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=lo, vmax=hi)
    ax.set_yticks(range(len(order)), [str(layer) for layer in order])
    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax.set(xlabel="step", ylabel="layer", title=f"{metric} (layer x step)")
    fig.colorbar(image, ax=ax, label=_axis_label(metric))
    return fig


def plot_metric(metric: str, layers: dict[int, dict[int, float]], out: Path) -> list[Path]:
    """``<metric>_lines.png`` and ``<metric>_heatmap.png`` in ``out``; returns their paths."""
    paths = [out / f"{metric}_lines.png", out / f"{metric}_heatmap.png"]
    for path, figure in zip(paths, (lines_figure(metric, layers), heatmap_figure(metric, layers))):
        figure.savefig(path, dpi=100)
    return paths


def summary_markdown(series: Series, source: list[Path]) -> str:
    """Markdown: one table per metric (in :func:`recipes.observe.drift_names.metric_order`, the
    top-k overlap first) with first / last / mean / min (and its step) per layer."""
    lines = ["# Top-k drift report", "", "Source: " + ", ".join(f"`{p}`" for p in source), ""]
    if not series:
        lines.append("No drift metrics found.")
    for metric in metric_order(set(series)):
        layers = series[metric]
        lines += [f"## {metric}", "", f"![lines]({metric}_lines.png) ![heatmap]({metric}_heatmap.png)", ""]
        lines += ["| layer | steps | first | last | mean | min | min step |", "|---|---|---|---|---|---|---|"]
        for layer in sorted(layers):
            per_step = layers[layer]
            steps = sorted(per_step)
            low = min(steps, key=lambda s: per_step[s])
            mean = sum(per_step.values()) / len(per_step)
            lines.append(
                f"| {layer} | {len(steps)} | {per_step[steps[0]]:.4f} | {per_step[steps[-1]]:.4f} "
                f"| {mean:.4f} | {per_step[low]:.4f} | {low} |"
            )
        lines.append("")
    return "\n".join(lines)


class MetricsFileError(ValueError):
    """A ``metrics.jsonl`` line that is not a step record (names the file and line)."""


def read_metrics_jsonl(path: Path) -> dict[int, dict[str, float]]:
    """Numeric history of a ``metrics.jsonl``: step -> {key: value} (records of one step merged;
    a last line cut short by a kill, with no newline after it, is skipped). Any other line that
    is not a JSON object with an integer ``step`` raises :class:`MetricsFileError` naming
    ``path:line``."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows: dict[int, dict[str, float]] = {}
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        cut_short = number == len(lines)  # the text after the last newline
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            if cut_short:
                continue
            raise MetricsFileError(f"{path}:{number}: not a JSON record ({err})") from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise MetricsFileError(f"{path}:{number}: not a step record (a JSON object with an "
                                   "integer 'step')")
        row = rows.setdefault(record["step"], {})
        row.update({k: float(v) for k, v in record.items()
                    if k != "step" and isinstance(v, (int, float))})
    return rows


def read_run(run_dir: Path) -> tuple[dict[int, dict[str, float]], list[Path]]:
    """(history, source files): ``metrics.jsonl`` if the run has one, else its wandb files."""
    jsonl = run_dir if run_dir.name == "metrics.jsonl" else run_dir / "metrics.jsonl"
    if jsonl.is_file():
        return read_metrics_jsonl(jsonl), [jsonl]
    files = find_run_files(run_dir)
    history: dict[int, dict[str, float]] = {}
    for f in files:  # resumed runs: later files override the steps they repeat
        for step, row in read_history(f).items():
            history.setdefault(step, {}).update(row)
    return history, files


def report(run_dir: Path, out: Optional[Path] = None, prefix: str = "dsa") -> Path:
    """Read the run, write the plots and ``drift_report.md`` to ``out``; returns the markdown path."""
    history, files = read_run(run_dir)
    series = drift_series(history, prefix)
    if not series:
        found = sorted({k.split("/", 1)[0] for row in history.values() for k in row if "/layer_" in k})
        print(f"no '{prefix}/<metric>/layer_<i>' keys in {', '.join(map(str, files))}"
              + (f"; per-layer prefixes found: {', '.join(found)} (--prefix)" if found else
                 " (drift is logged when precision.drift.interval > 0)"), file=sys.stderr)
    out = out or (run_dir if run_dir.is_dir() else run_dir.parent) / "drift_report"
    out.mkdir(parents=True, exist_ok=True)
    for metric, layers in series.items():
        plot_metric(metric, layers, out)
    md = out / "drift_report.md"
    md.write_text(summary_markdown(series, files))
    return md


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path,
                        help="run directory, metrics.jsonl, offline-run-* directory or .wandb file")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default RUN_DIR/drift_report)")
    parser.add_argument("--prefix", default="dsa", help="metric key prefix (default: dsa)")
    args = parser.parse_args(argv)
    try:
        print(report(args.run_dir, args.out, args.prefix))
    except (MetricsFileError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
