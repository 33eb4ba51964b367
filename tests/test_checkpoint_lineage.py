"""``train.overwrite=true`` never replaces another run's checkpoint (issue 34).

The old bug: run B, a fresh run with ``train.overwrite=true`` into run A's save directory, saved
its own ``iter_0000002`` / ``iter_0000003`` over A's (the README promises "theirs are kept").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.checkpoint.lineage import check_save_target, planned_steps
from recipes.checkpoint.manifest import CheckpointError, write_manifest
from recipes.config.schema import TrainConfig
from tests.test_checkpoint_safety import (  # noqa: F401
    Train,
    _snapshot,
    run_copy,
    three_checkpoints,
    train,
)


def test_overwrite_run_whose_saves_would_replace_theirs_is_refused_before_training(
        run_copy: Path, train: Train, tmp_path: Path) -> None:  # noqa: F811
    root = run_copy / "checkpoints"  # A's iter_0000001..3
    before = _snapshot(root)
    with pytest.raises(CheckpointError) as err:
        train(tmp_path / "b", "train.steps=3", "train.save_interval=1", f"train.save={root}",
              "train.resume=none", "train.overwrite=true")
    assert "iter_0000001, iter_0000002, iter_0000003" in str(err.value)
    assert "never replaces another run's checkpoint" in str(err.value)
    assert "step 1" not in train.out  # refused before the first step
    assert _snapshot(root) == before  # A's bytes (sizes and mtimes) all survive


def test_a_save_never_replaces_another_lineages_checkpoint(tmp_path: Path) -> None:
    theirs = tmp_path / "iter_0000004"
    theirs.mkdir()
    (theirs / "data").write_text("A")
    write_manifest(theirs, config={}, lineage="A", step=4)
    with pytest.raises(CheckpointError, match="belongs to another run \\(lineage A\\)"):
        check_save_target(theirs, "B")  # e.g. B preempted at step 4
    check_save_target(theirs, "A")  # its own run re-saving the step replaces it
    check_save_target(tmp_path / "iter_0000005", "B")  # a new name is fine
    bare = tmp_path / "iter_0000006"  # no manifest: nobody's that trains now
    bare.mkdir()
    with pytest.raises(CheckpointError, match="unknown: no manifest"):
        check_save_target(bare, "A")


def test_planned_steps_are_the_interval_saves_and_the_final_one() -> None:
    t = TrainConfig(steps=7, save_interval=3, save_final=True)
    assert planned_steps(t, 0) == [3, 6, 7]
    assert planned_steps(t, 6) == [7]
    assert planned_steps(t, 7) == []
    assert planned_steps(TrainConfig(steps=4, save_interval=0, save_final=False), 0) == []
