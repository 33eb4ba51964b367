"""Which run directory a launch uses: a rerun of the same command resumes its last unfinished run.

``python train.py ARGS`` after a run of the same ``ARGS`` (same overrides but ``train.resume``,
same run root) that did not complete reuses that run's id, so its directory, checkpoints and
metrics continue (``train.resume=auto`` loads the latest checkpoint). ``train.resume=none`` starts
a fresh run. Ids set by ``KPOOL_RUN_ID`` or SLURM are used as they are (once checked to name one
directory under the run root, :func:`recipes.launch.run_owner.check_run_id`). Every rank of one launch
picks the same run: only runs whose ``.hydra/overrides.yaml`` predates the launch (the torchrun
agent's start, or this process's) are candidates, so rank 0 writing the new run's files does not
change the choice of the other ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from recipes.launch.distributed import launch_start, run_id
from recipes.launch.run_owner import check_run_id
from recipes.launch.result import RunResult

IGNORED = ("train.resume",)
"""Override keys that do not make a command different."""


def run_root() -> Path:
    """Where runs go (``hydra.run.dir`` in conf/config.yaml): ``$KPOOL_RUN_ROOT`` or ``runs``."""
    return Path(os.environ.get("KPOOL_RUN_ROOT") or "runs")


def _command(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in IGNORED)


def _completed(run: Path) -> bool:
    result = RunResult.read(run)
    return result is not None and result.status == "completed"


def find_unfinished(root: Path, overrides: list[str], before: float) -> Optional[Path]:
    """The newest run under ``root`` started before ``before`` (a timestamp) with the same
    overrides (but :data:`IGNORED`) that did not complete; ``None`` if there is none."""
    command, found = _command(overrides), []
    for marker in root.glob("*/.hydra/overrides.yaml"):
        run = marker.parent.parent
        started = marker.stat().st_mtime
        if started < before and not _completed(run) and _command(list(OmegaConf.load(marker))) == command:
            found.append((started, run))
    return max(found)[1] if found else None


def select_run(overrides: list[str]) -> str:
    """Sets ``KPOOL_RUN_ID`` to the run this launch uses (see the module doc) and returns the
    console's first line: which run, and how to resume it."""
    explicit = os.environ.get("KPOOL_RUN_ID") or os.environ.get("SLURM_JOB_ID")
    fresh = "train.resume=none" in overrides
    previous = None if explicit or fresh else find_unfinished(run_root(), overrides, launch_start())
    if previous is not None:
        os.environ["KPOOL_RUN_ID"] = previous.name
        return (f"resuming run {previous.name} (the last unfinished run of this command) in "
                f"{previous}; train.resume=none starts a fresh run")
    rid = check_run_id(run_id())
    os.environ["KPOOL_RUN_ID"] = rid
    if any(o.lower() in ("train.dry_run=true", "++train.dry_run=true", "+train.dry_run=true") for o in overrides):
        return f"dry run of run {rid}: plans the run and writes no run directory"
    return (f"run {rid} in {run_root() / rid}; to resume it, rerun this command "
            f"(or set KPOOL_RUN_ID={rid})")
