"""A quiet console: library warnings filtered, logs of other ranks kept in their log files, the
project's own lines (:func:`say`) printed as they are and kept in every rank's log file, and
config errors printed as one paragraph.

Imports nothing heavy: ``train.py`` calls :func:`quiet` before megatron-core (or torch) is
imported. Processes that megatron spawns (the checkpoint writer) re-run ``train.py``'s top level,
so they get the same filters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Iterator

_installed = False

CONSOLE_LOGGER = "kpool.console"
"""The logger :func:`say` keeps its lines in; :class:`ConsoleFilter` keeps it off the console (the
line was printed already), so its records reach the rank's log file (``train_rank<N>.log``) only."""


def env_rank() -> int:
    """The global rank from torchrun (``RANK``) or srun (``SLURM_PROCID`` in a job step); 0 alone."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    return 0


def quiet() -> None:
    """Install the warning filters, once per process: on rank 0 megatron-core's notes about optional packages it does not find (Transformer Engine,
    apex, absl), torch.distributed's deprecations, the distributed checkpoint's load warnings
    (:data:`DCP_LOAD_WARNINGS`) and the CPU shim's non-leaf ``.grad`` access are dropped. Other ranks show no warnings (rank 0 shows the same ones)."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime"
    if env_rank() != 0:
        warnings.simplefilter("ignore")
        return
    install_filters()


DCP_LOAD_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent "
                  r"is to load in a single process"),
    (UserWarning, r"The argument order of load has been changed"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
"""What torch's distributed checkpointing warns on every load or resume through megatron's
dist_checkpointing (one process: the first two; megatron's ShardedTensor: the third, attributed to
whichever frame calls it). Matched by message, so other warnings of these modules still show."""


def install_filters() -> None:
    """The rank-0 filters of :func:`quiet` (see there), also for tests."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")
    for category, message in DCP_LOAD_WARNINGS:
        warnings.filterwarnings("ignore", category=category, message=message)


def say(line: str, show: bool) -> None:
    """A console line of the project's own (a step line, a checkpoint note, the preemption notice):
    printed as it is, without a log format, when ``show`` (the rank that talks to the user), and
    on every rank kept in that rank's log file as an INFO record of :data:`CONSOLE_LOGGER` (when
    logging has handlers: Hydra's job logging)."""
    if show:
        print(line, flush=True)
    logging.getLogger(CONSOLE_LOGGER).info(line)


class ConsoleFilter(logging.Filter):
    """For the console handler (conf/config.yaml ``hydra.job_logging``): rank 0 shows its own
    records and libraries' errors; other ranks only errors; :func:`say`'s records never (they were
    printed). Everything still goes to the rank's log file."""

    def __init__(self) -> None:
        super().__init__()
        self.rank = env_rank()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == CONSOLE_LOGGER:
            return False
        if record.levelno >= logging.ERROR:
            return True
        library = record.name.split(".", 1)[0] in ("megatron", "torch", "wandb")
        return self.rank == 0 and not library


@contextlib.contextmanager
def config_errors(exit_on_error: bool) -> Iterator[None]:
    """Print a :class:`recipes.config.schema.ConfigError` as one paragraph (rank 0), no traceback, and
    exit with status 2; with ``exit_on_error=False`` (a sweep job) the paragraph is printed and
    the sweep goes on (the job's ``result.json`` and the sweep summary list it as failed, and the
    sweep exits non-zero at its end). With ``HYDRA_FULL_ERROR=1`` it propagates."""
    from recipes.config.schema import ConfigError

    try:
        yield
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if env_rank() == 0:
            print(f"Error: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback.)", file=sys.stderr, flush=True)
        if exit_on_error:
            sys.exit(2)


def duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3.4s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
