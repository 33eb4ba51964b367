"""Add one benchmark run to a ``docs/results`` file: the JSON a bench script wrote with ``--out``,
with the run's date, commit, machine and command.

    python scripts/bench/record_result.py RUN.json docs/results/NAME.json \\
        --command "python scripts/bench/attention.py --repeats 3 --out RUN.json" \\
        --machine "1x NVIDIA H200" [--commit abc1234] [--date 2026-12-02] [--replace]

A results file is ``{"about": str, "format": str, "runs": [run, ...]}`` (docs/benchmarks.md;
``tests/test_results_files.py`` checks it), each run ``{"date", "commit", "machine", "command",
...the script's keys}``. ``--commit`` defaults to this checkout's ``HEAD`` (refused when the
working tree has uncommitted changes, which the commit would not hold), ``--date`` to today
(UTC). The new run goes last; ``--replace`` drops the file's earlier runs of the same command
(the page keeps the current measurement only; git keeps the earlier ones). A file that does not
exist yet needs ``--about`` and ``--format``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
RUN_KEYS = ("date", "commit", "machine", "command")


def head_commit(root: Path) -> str:
    """The short ``HEAD`` commit of the checkout at ``root``; refuses a tree with changes."""
    status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, check=True).stdout
    if status.strip():
        raise ValueError("--commit not given and the working tree has uncommitted changes; commit "
                         "them or pass --commit of the measured code")
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def record(results: dict[str, Any], figures: dict[str, Any], run: dict[str, str],
           replace: bool) -> dict[str, Any]:
    """``results`` with ``run`` (the four run keys) and ``figures`` appended as one run."""
    clash = sorted(set(figures) & set(RUN_KEYS))
    if clash:
        raise ValueError(f"the run's JSON already has the keys {clash}; allowed: any but {list(RUN_KEYS)}")
    runs = [r for r in results["runs"] if not (replace and r["command"] == run["command"])]
    return {**results, "runs": runs + [{**run, **figures}]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the JSON a bench script wrote with --out")
    parser.add_argument("results", type=Path, help="the docs/results file to add it to")
    parser.add_argument("--command", required=True, help="the command exactly as run")
    parser.add_argument("--machine", required=True, help='e.g. "1x NVIDIA H200"')
    parser.add_argument("--commit", help="the measured code's commit (default: HEAD)")
    parser.add_argument("--date", help="YYYY-MM-DD (default: today, UTC)")
    parser.add_argument("--replace", action="store_true", help="drop earlier runs of the same command")
    parser.add_argument("--about", help="what the file holds (a new file only)")
    parser.add_argument("--format", dest="fmt", help="what its keys mean (a new file only)")
    args = parser.parse_args(argv)
    figures = json.loads(args.run.read_text())
    if not isinstance(figures, dict):
        parser.error(f"{args.run}: expected a JSON object, got {type(figures).__name__}")
    if args.results.exists():
        results = json.loads(args.results.read_text())
    elif args.about and args.fmt:
        results = {"about": args.about, "format": args.fmt, "runs": []}
    else:
        parser.error(f"{args.results} does not exist: give --about and --format for a new file")
    date = args.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    try:
        commit = args.commit or head_commit(ROOT)
        results = record(results, figures, {"date": date, "commit": commit, "machine": args.machine,
                                            "command": args.command}, args.replace)
    except ValueError as err:
        parser.error(str(err))
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{args.results}: {len(results['runs'])} runs, the last {date} {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
