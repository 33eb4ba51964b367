"""A bounded wait for the other ranks, named by the training step.

A rank whose peer stalls (or died without the launcher noticing, or runs another step) used to wait
in a collective forever. ``train.collective_timeout_s`` bounds it twice: it is the process group's
timeout (:func:`recipes.launch.distributed.init_process_group`: gloo raises in the waiting
collective, NCCL's watchdog aborts it), and :class:`StepWatchdog` says which step it was. Every
rank marks the start and end of each step; when a step has run ``timeout_s`` without ending, the
watchdog prints once ``rank R: no progress in step S for T s (a collective is waiting for another
rank)`` from its thread (so a rank that an NCCL abort ends, or that stalls outside a collective,
still says it), and :meth:`StepWatchdog.check` turns the error of the timed-out collective into a
:class:`CollectiveTimeout` with the same words. A collective that timed out after ``timeout_s``
started inside the step, so the step has run at least ``timeout_s``: that is the test for it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

DEFAULT_TIMEOUT_S = 600.0
"""megatron's default ``--distributed-timeout-minutes`` (10)."""


class CollectiveTimeout(RuntimeError):
    """A step made no progress for ``train.collective_timeout_s``: a collective waited that long
    for another rank."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StepWatchdog:
    """Watches the steps of one rank (a daemon thread polling every ``min(1, timeout_s / 10)`` s);
    ``say`` prints its one line per overdue step (stderr by default)."""

    def __init__(self, timeout_s: float, rank: int, say: Callable[[str], None] = _stderr) -> None:
        self.timeout_s, self.rank, self._say = timeout_s, rank, say
        self._lock = threading.Lock()
        self._step: Optional[int] = None
        self._started = 0.0
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kpool-step-watchdog", daemon=True)
        self._thread.start()

    def message(self, step: int) -> str:
        return (f"rank {self.rank}: no progress in step {step} for {self.timeout_s:g} s "
                "(a collective is waiting for another rank)")

    def begin(self, step: int) -> None:
        """Step ``step`` (1-based, the one being trained) starts now."""
        with self._lock:
            self._step, self._started, self._reported = step, time.monotonic(), False

    def end(self) -> None:
        """The step begun last has ended (trained, logged and saved)."""
        with self._lock:
            self._step = None

    def check(self, err: BaseException) -> None:
        """Raise :class:`CollectiveTimeout` (from ``err``) when ``err`` ended a step that had run
        ``timeout_s`` or longer; return otherwise (the caller re-raises ``err``)."""
        with self._lock:
            step = self._overdue()
            if step is None:
                return
            self._report(step)
        first = (str(err).strip().splitlines() or [""])[0]
        raise CollectiveTimeout(f"{self.message(step)}; raise train.collective_timeout_s if the step "
                                f"is legitimately slower: {type(err).__name__}: {first}") from err

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _overdue(self) -> Optional[int]:
        if self._step is None or time.monotonic() - self._started < self.timeout_s:
            return None
        return self._step

    def _report(self, step: int) -> None:
        if not self._reported:
            self._reported = True
            self._say(self.message(step))

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            with self._lock:
                step = self._overdue()
                if step is not None:
                    self._report(step)
