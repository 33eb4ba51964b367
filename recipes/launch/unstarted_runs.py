"""A launch that never trains leaves no run directory: a config error or a dry run.

Otherwise the rerun of the same command would find the directory, see no completed result and
announce that it resumes "the last unfinished run" of a run that never started
(:mod:`recipes.launch.run_dir`). Only single runs are cleaned (a sweep lists its failed jobs from their
``result.json``), only by the global rank 0, and only when the directory holds nothing but what a
launch writes before step 1: Hydra's ``.hydra/``, the rank log files, ``result.json`` and the
owner lock (:mod:`recipes.launch.run_owner`, released before the directory is removed). A
directory with anything else (metrics, checkpoints of an earlier launch) is kept.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

from recipes.launch.console import env_rank
from recipes.launch.result import RESULT_FILE
from recipes.launch.run_owner import LOCK_FILE

_LAUNCH_FILES = (".hydra", RESULT_FILE, LOCK_FILE)


def _only_launch_files(run_dir: Path) -> bool:
    return all(p.name in _LAUNCH_FILES or p.suffix == ".log" for p in run_dir.iterdir())


def remove_if_unstarted(run_dir: Path) -> bool:
    """Removes ``run_dir`` (rank 0) when it holds only launch files; returns whether it did."""
    if env_rank() != 0 or not run_dir.is_dir() or not _only_launch_files(run_dir):
        return False
    shutil.rmtree(run_dir)
    return True


@contextlib.contextmanager
def discard_if_unstarted(run_dir: Path, *, single_run: bool, dry_run: bool) -> Iterator[None]:
    """Around a single run: removes its directory after a dry run or when a
    :class:`~recipes.config.schema.ConfigError` leaves the block (which it re-raises)."""
    from recipes.config.schema import ConfigError

    try:
        yield
    except ConfigError:
        if single_run:
            remove_if_unstarted(run_dir)
        raise
    if single_run and dry_run:
        remove_if_unstarted(run_dir)
