"""Graceful stop on preemption and time-limit signals, and self-requeue under SLURM.

SLURM announces the end of a job with a signal (``#SBATCH --signal=USR1@120`` in
``slurm/train.sbatch``; SIGTERM on ``scancel`` or preemption); Ctrl-C (SIGINT) is handled the same
way (a second Ctrl-C interrupts at once). :class:`PreemptionGuard` turns that
signal into a flag; the training loop asks :meth:`PreemptionGuard.should_stop` once per step on
every rank, which agrees on the answer across ranks (MAX all-reduce) so that all ranks stop after
the same step; the loop then saves a checkpoint and calls :meth:`PreemptionGuard.requeue`, which
puts the job back in the queue (same job id, hence same run dir) where ``train.resume=auto`` picks
the checkpoint up::

    guard = PreemptionGuard()
    for step in ...:
        train_step()
        if guard.should_stop():
            save_checkpoint()
            requeued = guard.requeue()
            break
    RunResult(...).write(run_dir)   # rank 0
    if requeued:
        raise Requeued()   # not a normal return: see :class:`Requeued`
    raise Preempted("preempted ..., resume with ...")   # outside SLURM: exit status 1
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

from recipes.launch.console import say

log = logging.getLogger(__name__)

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


class Requeued(SystemExit):
    """Ends the process with status 0 after the job was requeued, without returning a result.

    A normal return would be wrong under hydra-submitit-launcher: submitit pickles the returned
    value as the sweep element's result, the launcher stops waiting and the sweep summary records
    the element as preempted while its requeued run is still to come. A ``SystemExit`` is not an
    ``Exception``: Hydra's job runner and submitit let it through, no result is written, and the
    launcher keeps waiting for the requeued run. Under ``sbatch`` it is simply exit status 0.
    """

    def __init__(self) -> None:
        super().__init__(0)


class Preempted(SystemExit):
    """Ends a run that stopped on a signal and was not requeued (outside SLURM) with exit status 1
    and a message saying how to resume; ``result.json`` already says ``preempted``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def _parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """Maps names such as ``"SIGUSR1"`` or ``"USR1"`` to signals; ValueError on anything else."""
    if isinstance(names, str):
        raise ValueError(f"signals must be a sequence of names, got the string {names!r}")
    parsed = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None:
            raise ValueError(f"unknown signal {name!r}: use names such as 'SIGUSR1' or 'SIGTERM'")
        if sig in _UNCATCHABLE:
            raise ValueError(f"{full} cannot be caught")
        parsed.append(sig)
    return parsed


def _global_rank() -> int:
    """This process's global rank: from torch.distributed, else RANK, else SLURM_PROCID, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _collective_device() -> torch.device:
    """The device a tensor must live on for a collective on the default process group."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PreemptionGuard:
    """Records preemption signals and turns them into a step-synchronous stop and a requeue.

    Args:
        signals: names of the signals that mean "stop soon" (``"SIGUSR1"`` or ``"USR1"`` form).
        enabled: when False no handler is installed and :meth:`should_stop` is always False
            (no collective); must be the same on every rank.

    Must be constructed in the main thread (Python only installs signal handlers there). The
    handlers replace any earlier ones for these signals, including submitit's SIGTERM bypass.
    """

    def __init__(
        self, signals: Sequence[str] = ("SIGUSR1", "SIGTERM", "SIGINT"), enabled: bool = True
    ) -> None:
        parsed = _parse_signals(signals)
        self._enabled = enabled
        self._received: Optional[str] = None
        self._announced = False
        self._previous: dict[signal.Signals, object] = {}
        if enabled:
            for sig in parsed:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        """Signal handler: remembers the first signal (it runs between bytecodes); a second SIGINT
        (Ctrl-C twice) interrupts at once."""
        if self._received is None:
            self._received = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def close(self) -> None:
        """Restore the handlers that were installed before this guard."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def signal_name(self) -> Optional[str]:
        """The first signal this process received (e.g. ``"SIGUSR1"``), None if none.

        Another rank's signal can make :meth:`should_stop` true while this stays None.
        """
        return self._received

    def should_stop(self) -> bool:
        """Whether any rank received a signal. Collective when torch.distributed is initialized:
        call it once per step on every rank."""
        if not self._enabled:
            return False
        stop = self._received is not None
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(stop)], dtype=torch.int32, device=_collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop and not self._announced:
            self._announced = True
            say(self.notice(), show=_global_rank() == 0)
        return stop

    def notice(self) -> str:
        """The console line announcing the stop (printed once by global rank 0, kept in every
        rank's log file): which signal this rank received, or that another rank received one."""
        if self._received is None:
            return "preemption: another rank received a stop signal; stopping after this step"
        return f"preemption: {self._received} received on rank {_global_rank()}; stopping after this step"

    def requeue(self) -> bool:
        """Requeues this SLURM job; call after the checkpoint is saved.

        Global rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` when SLURM_JOB_ID is set. Returns
        whether the requeue was issued; collective (rank 0's answer is broadcast) when
        torch.distributed is initialized, so call it on every rank. A failing scontrol is logged
        and gives False: the job then simply ends, its checkpoint still on disk.
        """
        issued = False
        job_id = os.environ.get("SLURM_JOB_ID")
        if job_id and _global_rank() == 0:
            issued = self._scontrol_requeue(job_id)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(issued)], dtype=torch.int32, device=_collective_device())
            dist.broadcast(flag, src=0)
            issued = bool(flag.item())
        return issued

    @staticmethod
    def _scontrol_requeue(job_id: str) -> bool:
        """Runs ``scontrol requeue <job_id>``; True on success, logs and returns False otherwise."""
        try:
            proc = subprocess.run(
                ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            log.error("scontrol requeue %s failed: %s", job_id, err)
            return False
        if proc.returncode != 0:
            log.error(
                "scontrol requeue %s exited %d: %s", job_id, proc.returncode, proc.stderr.strip()
            )
            return False
        say(f"requeued SLURM job {job_id}; it resumes from the latest checkpoint", show=True)
        return True
