"""A checkpoint written by the code before the sub-package layout resumes after it, to the same
losses: the layout moved modules, not the checkpoint layout, its keys or the classes it records.

The old code is commit ``0fd587e`` (the last one with the flat ``recipes/`` and ``kpool_layers/``),
extracted with ``git archive`` and run from its own tree. It trains the tiny model for 4 steps,
saving at step 2; the current code resumes from that step-2 checkpoint and trains steps 3 and 4,
whose losses must equal the old run's bit for bit (same data order, same state, fp32, CPU: the
same arithmetic as the uninterrupted run, as in ``tests/test_train.py``'s resume test).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from recipes.checkpoint import manifest
from tests.train_runner import ROOT, metrics, run_train, subprocess_env

PRE_LAYOUT = "0fd587e"
COMMON = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "logging.mode=disabled",
          "train.steps=4", "train.keep_checkpoints=5"]


def pre_layout_tree(dest: Path) -> Path:
    """The checkout of :data:`PRE_LAYOUT` under ``dest`` (skips where the clone lacks the commit)."""
    archive = subprocess.run(["git", "archive", "--format=tar", PRE_LAYOUT], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {PRE_LAYOUT} is not in this clone (a shallow clone?): "
                    f"{archive.stderr.decode()[-300:]}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="tar")
    assert (dest / "recipes" / "schema.py").is_file() and not (dest / "recipes" / "config").exists()
    return dest


def test_the_manifest_anchor_is_the_checkout_root() -> None:
    """``git describe`` runs in the checkout root, one level above the package after the move."""
    assert (manifest._ROOT / "pyproject.toml").is_file() and (manifest._ROOT / "recipes").is_dir()


def test_pre_layout_checkpoint_resumes_to_the_same_losses(tmp_path: Path) -> None:
    old = pre_layout_tree(tmp_path / "old")
    env = subprocess_env(KPOOL_RUN_ROOT=str(tmp_path), KPOOL_RUN_ID="old", WANDB_SILENT="true",
                         OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(old))
    # The old tree's packages are the ones imported there, not this checkout's (installed editable).
    where = subprocess.run([sys.executable, "-c", "import recipes, kpool_layers; print(recipes.__file__); "
                            "print(kpool_layers.__file__)"], cwd=old, env=env, capture_output=True, text=True)
    assert where.stdout.split() == [str(old / "recipes" / "__init__.py"), str(old / "kpool_layers" / "__init__.py")]
    done = subprocess.run([sys.executable, str(old / "train.py"), *COMMON, "train.save_interval=2"],
                          cwd=old, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ckpt = tmp_path / "old" / "checkpoints" / "iter_0000002"
    assert ckpt.is_dir()
    before = metrics(tmp_path / "old")
    assert [r["step"] for r in before] == [1, 2, 3, 4]

    out = run_train(tmp_path, "new", COMMON + [f"train.resume={ckpt}"])
    assert "resumed from" in out.stdout
    after = metrics(tmp_path / "new")
    assert [r["step"] for r in after] == [3, 4]
    assert [r["loss"] for r in after] == [r["loss"] for r in before[2:]]
