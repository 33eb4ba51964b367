"""``pip install`` gives a working ``kpool-train`` (conf shipped inside the package), and every
declared runtime dependency is used."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.train_runner import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAMES = {"megatron-core": "megatron", "hydra-core": "hydra"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy (setuptools writes build/ into the source tree)."""
    src = tmp_path_factory.mktemp("src") / "kpool-recipes"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "multirun", "outputs", "__pycache__", "*.egg-info", "build"))
    out = src.parent / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True, timeout=180)
    (path,) = out.glob("*.whl")
    return path


def test_wheel_ships_every_config_and_the_entry_point(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = {f"recipes/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert conf and conf <= names, sorted(conf - names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kpool-train = recipes.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_kpool_train_composes_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=180)
    proc = subprocess.run([str(target / "bin" / "kpool-train"), "--cfg", "job", "train.steps=7"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=subprocess_env(PYTHONPATH=str(target), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert "name: glm5_tiny" in proc.stdout and re.search(r"^  steps: 7$", proc.stdout, re.M)


def test_every_runtime_dependency_is_imported() -> None:
    """A dependency nothing imports (einops and tqdm were) only slows installs and pins versions."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    code = "\n".join(p.read_text() for d in ("recipes", "kpool_layers", "scripts")
                     for p in (ROOT / d).rglob("*.py")) + (ROOT / "train.py").read_text()
    for dep in deps:
        name = re.split(r"[<>=!~ ]", dep, maxsplit=1)[0]
        module = IMPORT_NAMES.get(name, name)
        assert re.search(rf"^\s*(import|from) {module}\b", code, re.M), f"{name} is never imported"
