"""``--help`` was Hydra's stock page listing ``schema`` as an option of every group,
``model=schema`` silently built glm5_tiny, and there was no way to ask what one key means."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from recipes.config.groups import group_options, user_groups
from tests.train_runner import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=subprocess_env(OMP_NUM_THREADS="1"))


def test_help_names_the_app_shows_examples_every_group_option_and_where_runs_go() -> None:
    out = _train("--help")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "powered by Hydra" not in text and text.startswith("kpool-train: ")
    assert len(re.findall(r"^  kpool-train \S", text, re.M)) == 5
    for group in user_groups():
        line = re.search(rf"^  {group} +(.+)$", text, re.M)
        assert line, group
        assert [o.rstrip("*") for o in line[1].split(", ")] == group_options(group)
        assert "schema" not in line[1]
    assert re.search(r"^  model +.*glm5_tiny\*", text, re.M)  # the default choice is marked
    assert "runs/<id>" in text and "resumes its last unfinished run" in text


def test_selecting_a_groups_schema_node_is_a_config_error() -> None:
    out = _train("model=schema", "--cfg", "job")
    assert out.returncode == 2, out.stdout[-2000:]
    assert "model='schema'" in out.stderr and "glm5_tiny" in out.stderr and "Traceback" not in out.stderr


def test_describe_prints_type_range_default_and_doc() -> None:
    out = _train("--describe", "precision.drift.interval")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "precision.drift.interval: int",
        "  range:   [0, inf)",
        "  default: 50 (schema; a conf/ preset may set another)",
        "  doc:     steps between measurements; 0 = off",
        "  in:      precision.drift: Top-k drift logging (``precision.drift.*``, see docs/precision.md).",
    ]
    enum = _train("--describe", "model.normalization").stdout
    assert "choices: RMSNorm, LayerNorm" in enum
    wrong = _train("--describe", "train.lr_warmup")
    assert wrong.returncode == 1 and "did you mean train.lr_warmup_steps?" in wrong.stderr
