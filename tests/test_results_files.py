"""The measured-results files under ``docs/results/``: one layout for all of them.

Each file is ``{"about": str, "format": str, "runs": [run, ...]}``; every run names its ``date``
(``YYYY-MM-DD``), ``commit`` (7 to 40 hex digits of this repository's history), ``machine`` and
``command``, then its figures. Keys are named after what they hold, never after when or how the
figures were produced (no ``session``, ``call1_...``).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.test_bench_precision import _script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))
RUN_KEYS = ("date", "commit", "machine", "command")
WORK_PERIOD_KEY = re.compile(
    r"session|^call\d|_call\d|(^|_)(fourth|fifth|sixth|seventh|eighth|ninth|tenth)(_|$)",
    re.IGNORECASE,
)


def _keys(value: Any) -> Iterator[str]:
    """Every dictionary key at any depth of ``value``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _keys(item)
    elif isinstance(value, list):
        for item in value:
            yield from _keys(item)


def test_there_are_results_files() -> None:
    assert RESULTS, "docs/results/*.json is empty"


def check_layout(data: Any, name: str) -> None:
    """Asserts the results-file layout of the module docstring on ``data`` (file ``name``)."""
    assert isinstance(data, dict) and set(data) == {"about", "format", "runs"}, (
        f"{name}: top-level keys {sorted(data)}, expected about, format, runs")
    assert isinstance(data["about"], str) and data["about"].strip()
    assert isinstance(data["format"], str) and data["format"].strip()
    assert isinstance(data["runs"], list) and data["runs"], f"{name}: runs is empty"
    for i, run in enumerate(data["runs"]):
        missing = [k for k in RUN_KEYS if not (isinstance(run.get(k), str) and run[k].strip())]
        assert not missing, f"{name}: runs[{i}] lacks {missing}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]), f"{name}: runs[{i}].date {run['date']!r}"
        assert re.fullmatch(r"[0-9a-f]{7,40}", run["commit"]), f"{name}: runs[{i}].commit {run['commit']!r}"
    dates = [run["date"] for run in data["runs"]]
    assert dates == sorted(dates), f"{name}: runs not oldest first: {dates}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_layout(path: Path) -> None:
    check_layout(json.loads(path.read_text()), path.name)


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_no_work_period_keys(path: Path) -> None:
    bad = sorted({k for k in _keys(json.loads(path.read_text())) if WORK_PERIOD_KEY.search(k)})
    assert not bad, f"{path.name}: keys named after when the work was done: {bad}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_commits_are_in_the_history(path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for run in json.loads(path.read_text())["runs"]:
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", run["commit"] + "^{commit}"],
                               capture_output=True)
        assert found.returncode == 0, f"{path.name}: commit {run['commit']} is not in this repository"


def test_plot_precision_reads_the_precision_results_file() -> None:
    """``plot_precision.load`` takes the ``runs`` layout: the three profiles of the stored runs."""
    results = _script("plot_precision").load([ROOT / "docs" / "results" / "precision_glm5_proxy_h200.json"])
    assert list(results) == ["bf16", "fp8", "serving_match"]
    assert all(len(r["losses"]) == 200 for r in results.values())


def test_record_result_adds_a_run_in_the_layout(tmp_path: Path) -> None:
    """``record_result.py`` appends a script's JSON as a run the layout check accepts; ``--replace``
    drops the earlier run of the same command; a figure named like a run key is refused."""
    record = _script("record_result")
    results, run = tmp_path / "r.json", tmp_path / "run.json"
    run.write_text(json.dumps({"rows": [{"s": 4096, "ms": 1.5}]}))
    common = ["--machine", "1x NVIDIA H200", "--commit", "1118988", "--command", "python x.py --out run.json"]
    assert record.main([str(run), str(results), *common, "--date", "2026-12-01",
                        "--about", "x timings", "--format", "rows: per s"]) == 0
    assert record.main([str(run), str(results), *common, "--date", "2026-12-02"]) == 0
    data = json.loads(results.read_text())
    check_layout(data, results.name)
    assert [r["date"] for r in data["runs"]] == ["2026-12-01", "2026-12-02"]
    assert data["runs"][1] == {"date": "2026-12-02", "commit": "1118988", "machine": "1x NVIDIA H200",
                               "command": "python x.py --out run.json", "rows": [{"s": 4096, "ms": 1.5}]}
    assert record.main([str(run), str(results), *common, "--date", "2026-12-03", "--replace"]) == 0
    assert [r["date"] for r in json.loads(results.read_text())["runs"]] == ["2026-12-03"]
    run.write_text(json.dumps({"commit": "x"}))
    with pytest.raises(SystemExit):
        record.main([str(run), str(results), *common])
    with pytest.raises(SystemExit):  # a new file without --about / --format
        record.main([str(run), str(tmp_path / "new.json"), *common])
