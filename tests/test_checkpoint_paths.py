"""Paths and disk (issue 34): ``latest`` names a directory inside the root, a checkpoint written
with a manifest is never loaded without it, preflight counts ``keep_checkpoints + 1``, a full
disk mid-save says so and leaves no ``.tmp``."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from recipes.checkpoint.manifest import MANIFEST, CheckpointError
from recipes.config.schema import ConfigError
from tests.test_checkpoint_safety import (  # noqa: F401
    CONF,
    FAST,
    Train,
    run_copy,
    shutil_usage,
    three_checkpoints,
    train,
)


def to_config_of(overrides: list[str]):  # noqa: ANN201 (recipes.config.schema.Config)
    """The schema Config of the test's fast tiny setup with ``overrides``."""
    from hydra import compose, initialize_config_dir

    from recipes.config.typed import to_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=[*FAST, *overrides]))


@pytest.mark.parametrize("marker", [b"\xff\xfe\x00", b"../../etc", b"/", b"", b"iter_0000002/../iter_0000001"])
def test_malformed_or_outside_latest_falls_back_to_the_newest_complete_checkpoint(
        run_copy: Path, train: Train, marker: bytes) -> None:  # noqa: F811
    """The old bug: a non-UTF-8 ``latest`` was a traceback; one naming a directory outside the
    root got a misleading refusal."""
    (run_copy / "checkpoints" / "latest").write_bytes(marker)
    out = train(run_copy, "train.steps=4")
    assert "does not exist as a checkpoint directory in" in out
    assert "taking the newest complete checkpoint iter_0000003" in out
    assert "at step 3" in out


def test_a_checkpoint_whose_manifest_was_deleted_is_not_loaded_unverified(
        run_copy: Path, train: Train) -> None:  # noqa: F811
    """The old bug: deleting the manifest switched off every integrity check."""
    (run_copy / "checkpoints" / "iter_0000003" / MANIFEST).unlink()
    out = train(run_copy, "train.steps=4")
    assert "skipping damaged checkpoint" in out and "iter_0000003/kpool_manifest.json: missing" in out
    assert "at step 2" in out  # the previous, verified one
    with pytest.raises(CheckpointError, match="written with one"):
        train(run_copy, "train.steps=5", f"train.resume={run_copy / 'checkpoints' / 'iter_0000003'}")


def test_preflight_counts_the_kept_checkpoints_and_the_one_being_written(
        train: Train, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from recipes.plan import preflight

    size = preflight.checkpoint_bytes(to_config_of([]))
    room_for_two = int(2.5 * size)  # keep_checkpoints=2 holds 3 at the peak
    monkeypatch.setattr(preflight.shutil, "disk_usage",
                        lambda _: shutil_usage(total=10**12, used=10**12 - room_for_two, free=room_for_two))
    with pytest.raises(ConfigError, match="times 3 held at once"):
        train(tmp_path / "r", "train.steps=1", "train.save_interval=1", "train.keep_checkpoints=2")
    root = tmp_path / "r2" / "checkpoints"
    for step in (1, 2):  # two already there: one more fits
        (root / f"iter_{step:07d}").mkdir(parents=True)
    assert preflight.checkpoints_to_fit(to_config_of(["train.keep_checkpoints=2"]), root) == 1


def test_a_full_disk_mid_save_says_so_and_removes_the_partial_checkpoint(
        train: Train, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The old bug: a torch ``enforce fail`` and a ``.tmp`` left filling the disk."""
    from recipes.checkpoint import store as checkpoint

    def full_disk(state, directory: str) -> None:  # noqa: ANN001
        (Path(directory) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(directory) / "__0_0.distcp"))

    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", full_disk)
    root = tmp_path / "run" / "checkpoints"
    with pytest.raises(CheckpointError, match=f"no space left on device: {root} "):
        train(tmp_path / "run", "train.steps=1", "train.save_interval=1")
    assert [p.name for p in root.iterdir()] == []  # no iter_0000001.tmp, no latest
    assert shutil.disk_usage(tmp_path).free > 0


@pytest.mark.parametrize("save", ["/", "/etc/kpool_ckpt", "/usr/../etc/kpool_ckpt"])
def test_saving_into_the_root_or_a_system_directory_needs_an_opt_in(save: str) -> None:
    """The old behaviour: ``train.save=/`` or ``/etc/...`` wrote there without a word."""
    from recipes.plan.preflight import check_not_system_dir, preflight

    with pytest.raises(ConfigError, match="train.save_in_system_dir=true") as err:
        preflight(to_config_of([f"train.save={save}"]), Path(save))
    assert err.value.key == "train.save"
    assert not Path("/etc/kpool_ckpt").exists()
    check_not_system_dir(Path(save), allowed=True)  # the opt-in
