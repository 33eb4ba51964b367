"""How many jobs a sweep launches, recorded in its directory so every summary line can say
``k/N jobs completed`` with N = jobs launched (not the jobs finished so far).

Counted as Hydra's basic sweeper expands them: ``hydra.sweeper.params`` first, then the command
line's sweep overrides (``a=1,2 b=3,4`` is 4 jobs). Written once by the launching process
(``on_multirun_start``) to ``<sweep dir>/sweep_jobs.json``, read by every job's summary (with
hydra-submitit-launcher the jobs run in other processes). Another sweeper (Optuna, ...) decides
its job count itself: none is recorded, and the summary counts the job dirs it finds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

JOBS_FILE = "sweep_jobs.json"
_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def launched_jobs(config: DictConfig) -> Optional[int]:
    """The number of jobs the basic sweeper launches for ``config`` (the multirun's config), or
    None for another sweeper."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.sweeper
    if sweeper.get("_target_") != _BASIC_SWEEPER:
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))


def record_launched_jobs(config: DictConfig, sweep_dir: Path) -> None:
    """Writes :data:`JOBS_FILE` when the job count is known."""
    n = launched_jobs(config)
    if n is not None:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / JOBS_FILE).write_text(json.dumps({"jobs": n}) + "\n")


def read_launched_jobs(sweep_dir: Path) -> Optional[int]:
    """The recorded job count, None when none was recorded."""
    try:
        return int(json.loads((sweep_dir / JOBS_FILE).read_text())["jobs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
