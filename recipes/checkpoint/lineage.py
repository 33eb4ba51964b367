"""A save never replaces another lineage's checkpoint.

Checkpoints are named by step (``iter_0000005``), so two runs sharing a save directory
(``train.overwrite=true``) would write the same names. A checkpoint belongs to the lineage its
manifest records (recipes.checkpoint.manifest); one without a readable manifest belongs to no run
that is training now. Before training, :func:`check_planned_saves` refuses a run whose planned saves
would land on another lineage's checkpoint; :func:`check_save_target` guards each save itself (a
preemption save at an unplanned step included). Both run on every rank (the checkpoint root is
shared), so every rank raises together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from recipes.checkpoint.manifest import CheckpointError, read_manifest
from recipes.config.schema import TrainConfig


def lineage_of(path: Path) -> Optional[str]:
    """The lineage ``path``'s manifest records; ``None`` without a readable manifest."""
    try:
        return (read_manifest(path) or {}).get("lineage")
    except CheckpointError:
        return None


def planned_steps(train: TrainConfig, start_step: int) -> list[int]:
    """The steps after ``start_step`` at which a run that completes saves (interval and final)."""
    steps = {s for s in range(start_step + 1, train.steps + 1)
             if train.save_interval and s % train.save_interval == 0}
    if train.save_final and train.steps > start_step:
        steps.add(train.steps)
    return sorted(steps)


def _foreign(root: Path, names: list[str], lineage: str) -> list[Path]:
    return [root / n for n in names if (root / n).exists() and lineage_of(root / n) != lineage]


def check_planned_saves(root: Path, names: list[str], lineage: str) -> None:
    """Raise :class:`CheckpointError` when a checkpoint named in ``names`` (the directory names of
    the planned saves) exists under ``root`` and is not of ``lineage``."""
    foreign = _foreign(root, names, lineage)
    if foreign:
        shown = ", ".join(p.name for p in foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        raise CheckpointError(
            f"{root} holds checkpoints of another run where this run would save ({shown}): a save "
            "never replaces another run's checkpoint, train.overwrite=true included. Save elsewhere "
            "(train.save or another KPOOL_RUN_ID), or move those checkpoints away")


def check_save_target(final: Path, lineage: str) -> None:
    """Raise :class:`CheckpointError` when ``final`` exists and belongs to another lineage."""
    if _foreign(final.parent, [final.name], lineage):
        raise CheckpointError(
            f"{final} belongs to another run (lineage {lineage_of(final) or 'unknown: no manifest'}); "
            "not replaced, this state is not saved. Save elsewhere (train.save or another KPOOL_RUN_ID)")
