"""``pip install`` gives a working ``kpool-train`` (conf shipped inside the package), and every
declared runtime dependency is used.

The fresh-venv test installs the wheel with no extras. This machine is offline, so the venv cannot
download the dependencies; instead it sees exactly the distributions ``pip install .`` would bring:
the closure of the wheel's requirements without extras, resolved in the development venv and
linked into one directory the fresh venv adds as a site dir (:func:`_core_site`). Distributions
only an extra pulls in (``tokenizers``, ``transformers``, ``submitit`` ...) and the editable install
of the checkout are left out, so an import of any of them fails there as it would for a user.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from packaging.requirements import Requirement

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


def test_wheel_ships_the_tools_the_sbatch_template_and_the_license(wheel: Path) -> None:
    """The installed package lacked scripts/, slurm/train.sbatch, a LICENSE and readme metadata."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    assert {"scripts/drift_report.py", "scripts/convert_checkpoint.py", "scripts/preprocess_data.py",
            "recipes/slurm/train.sbatch"} <= names, sorted(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert re.search(r"^License-Expression: Apache-2.0$", metadata, re.M), metadata[:2000]
    assert re.search(r"^Description-Content-Type: text/markdown", metadata, re.M)
    assert re.search(r"^Version: " + re.escape(_package_version()) + "$", metadata, re.M)
    entry = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for script in CONSOLE_SCRIPTS:
        assert f"{script} = " in entry, entry


def _package_version() -> str:
    """The version's one source: ``recipes.__version__`` (pyproject reads it as a dynamic field)."""
    return re.search(r'^__version__ = "([^"]+)"$', (ROOT / "recipes" / "__init__.py").read_text(), re.M)[1]


def test_build_outputs_are_git_ignored() -> None:
    proc = subprocess.run(["git", "check-ignore", "build/lib/x.py", "dist/x.whl"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.stdout.split() == ["build/lib/x.py", "dist/x.whl"], proc.stdout + proc.stderr


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


CONSOLE_SCRIPTS = ("kpool-train", "kpool-drift-report", "kpool-convert", "kpool-preprocess")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _core_closure(root: str) -> list[md.Distribution]:
    """The installed distributions ``pip install <root>`` needs, extras not requested."""
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen[name] = dist = md.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    del seen[_canonical(root)]  # the wheel itself is installed for real
    return list(seen.values())


def _core_site(target: Path) -> Path:
    """A directory holding links to every top-level file or folder of the core closure's
    distributions (namespace folders such as ``nvidia/`` shared with other distributions are
    linked whole: they hold CUDA libraries, not extras)."""
    target.mkdir()
    for dist in _core_closure("kpool-recipes"):
        site = Path(dist.locate_file(""))
        for rel in dist.files or []:
            top = rel.parts[0]
            if top == ".." or (target / top).exists():
                continue
            if (site / top).exists():
                (target / top).symlink_to(site / top)
    return target


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory) -> Path:
    """A venv (no system site packages) with the wheel installed without extras; the core
    dependencies come from :func:`_core_site` through a ``.pth`` file."""
    base = tmp_path_factory.mktemp("fresh")
    venv = base / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    core = _core_site(base / "core-site")
    # `import site; site.addsitedir` (not a bare path line) so the core dir's own .pth files run.
    (purelib / "kpool_core_deps.pth").write_text(f"import site; site.addsitedir({str(core)!r})\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
                    "--no-deps", str(wheel)], check=True, capture_output=True, timeout=180)
    return venv


def _venv_env(venv: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(OMP_NUM_THREADS="1", WANDB_SILENT="true", **extra)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_fresh_venv_has_no_extras_and_its_requirements_are_met(fresh_venv: Path) -> None:
    """The check the trains-test depends on: the venv really lacks the extras, and pip agrees
    every requirement of the installed wheel is satisfied."""
    py = str(fresh_venv / "bin" / "python")
    probe = ("import importlib.util as u, recipes; "
             "print(recipes.__file__); "
             "print([m for m in ('tokenizers', 'transformers', 'submitit') if u.find_spec(m)])")
    out = subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True,
                         env=_venv_env(fresh_venv), cwd=fresh_venv).stdout.splitlines()
    assert str(fresh_venv) in out[0], out  # the installed wheel, not the checkout
    assert out[1] == "[]", out
    check = subprocess.run([sys.executable, "-m", "pip", "--python", py, "check"],
                           capture_output=True, text=True, timeout=120)
    assert "kpool-recipes" not in check.stdout, check.stdout


def test_pip_install_without_extras_trains_from_another_directory(fresh_venv: Path, tmp_path: Path) -> None:
    """``pip install .`` then ``kpool-train``: failed with ``No module named 'tokenizers'``."""
    proc = subprocess.run(
        [str(fresh_venv / "bin" / "kpool-train"), "model=glm5_tiny", "precision=fp32",
         "data.seq_length=64", "train.steps=2", "logging.mode=disabled"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=_venv_env(fresh_venv, KPOOL_RUN_ROOT=str(tmp_path / "runs"), KPOOL_RUN_ID="pip"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "pip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_kpool_train_version_is_the_package_version(fresh_venv: Path, tmp_path: Path) -> None:
    """Printed Hydra's version before."""
    proc = subprocess.run([str(fresh_venv / "bin" / "kpool-train"), "--version"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=_venv_env(fresh_venv))
    assert proc.returncode == 0 and proc.stdout.strip() == f"kpool-recipes {_package_version()}", proc


def test_a_tokenizer_without_the_data_extra_is_a_config_error_naming_it(fresh_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")  # never parsed: the import fails first
    proc = subprocess.run(
        [str(fresh_venv / "bin" / "kpool-train"), "model=glm5_tiny", "precision=fp32", "train.steps=2",
         "logging.mode=disabled", f"data.tokenizer={tmp_path / 'tokenizer.json'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=_venv_env(fresh_venv, KPOOL_RUN_ROOT=str(tmp_path / "runs"), KPOOL_RUN_ID="tok"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "invalid config: data.tokenizer=" in proc.stderr and "kpool-recipes[data]" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs" / "tok").exists()


@pytest.mark.parametrize("script", CONSOLE_SCRIPTS)
def test_every_console_script_prints_its_help(fresh_venv: Path, script: str, tmp_path: Path) -> None:
    proc = subprocess.run([str(fresh_venv / "bin" / script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=_venv_env(fresh_venv))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]  # no library warnings either
    assert proc.stdout.lower().startswith(("usage", script)), proc.stdout[-2000:]
