"""Plot results of ``scripts/bench/precision.py``: loss curves and top-k overlap against the
drift reference, one line per profile, from one or more result JSONs: files written by
``precision.py --out`` or a ``docs/results`` file whose ``runs`` each hold such ``results``
(profiles run in separate commands are merged; a later run's profile replaces an earlier one of the
same name).

    python scripts/bench/plot_precision.py a.json b.json --out precision.png [--smooth 10]

Left: training loss, moving average over ``--smooth`` steps (all profiles saw the same batches
in the same order). Right: ``dsa/topk_overlap`` (layer mean) at each drift step. Also prints
the mean loss over the last ``--tail`` steps and the mean overlap per profile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional


def load(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Completed or partial results by profile name, in first-seen order."""
    merged: dict[str, dict[str, Any]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for run in data["runs"] if "runs" in data else [data]:
            for result in run["results"]:
                if result["status"] != "failed":
                    merged[result["profile"]] = result
    return merged


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="precision.py --out JSON files")
    parser.add_argument("--out", type=Path, required=True, help="PNG file")
    parser.add_argument("--smooth", type=int, default=10)
    parser.add_argument("--tail", type=int, default=50)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load(args.results)
    if not results:
        parser.error("no completed profile in the given files")
    fig, (ax_loss, ax_overlap) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        losses = r["losses"]
        ax_loss.plot(range(1, len(losses) + 1), moving_average(losses, args.smooth), label=name)
        steps, overlap = zip(*r["overlap_by_step"]) if r.get("overlap_by_step") else ((), ())
        ax_overlap.plot(steps, overlap, marker="o", ms=3, label=name)
        tail = losses[-args.tail:]
        print(f"{name:<14} loss mean of last {len(tail)} steps {statistics.fmean(tail):.4f}  "
              f"overlap mean {r['topk_overlap']:.4f}  step {r['step_time_s']:.3f} s")
    ax_loss.set(xlabel="step", ylabel=f"loss (moving average, {args.smooth} steps)", title="training loss")
    ax_overlap.set(xlabel="step", ylabel="dsa/topk_overlap (layer mean)", title="top-k overlap vs drift reference")
    for ax in (ax_loss, ax_overlap):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
