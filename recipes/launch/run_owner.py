"""One owner per run directory, and which names a run directory may have.

A training process takes an exclusive ``fcntl.flock`` on ``<run dir>/.owner.lock`` before it reads
or changes anything in the run directory (the checkpoints it resumes, the resume trim of
``metrics.jsonl``) and holds it until it ends. The kernel releases the lock when the process dies
(kill -9 included), so a crashed run never blocks its rerun; the pid the file still names then is
reported as taken over. A second process on a run that is still owned fails at once, naming the
owner's pid. Under torchrun / srun only global rank 0 takes the lock: the other ranks of the launch
are part of the same owner, and torchrun stops them when rank 0 fails.

``flock`` is advisory and per host on some network file systems: it serialises processes on one
host (and on file systems that forward flock, such as Lustre with ``flock`` mounts).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import IO, Optional

from recipes.config.schema import ConfigError

LOCK_FILE = ".owner.lock"


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it can name one directory under the run root, else raise
    :class:`ConfigError` on ``KPOOL_RUN_ID``: no path separator, not ``.`` / ``..``, printable
    characters only (no newline or other control character), not empty."""
    bad = None
    if not run_id:
        bad = "it is empty"
    elif run_id in (".", ".."):
        bad = f"{run_id!r} names a directory outside the run root"
    elif "/" in run_id or (os.altsep and os.altsep in run_id):
        bad = "it holds a path separator"
    elif not run_id.isprintable():
        bad = "it holds a non-printable character (newline, tab, control)"
    if bad is not None:
        raise ConfigError("KPOOL_RUN_ID", run_id, "a directory name: printable, no '/', not '.' or '..'",
                          f"invalid config: KPOOL_RUN_ID={run_id!r}: {bad}; allowed: a directory name "
                          "(printable, no '/', not '.' or '..'), e.g. KPOOL_RUN_ID=my-run-1")
    return run_id


class RunBusy(ConfigError):
    """The run directory is owned by another live process."""


class RunOwner:
    """The held lock of one run directory (see the module doc); :meth:`release` ends ownership."""

    def __init__(self, run_dir: Path, handle: IO[str], took_over: Optional[str]) -> None:
        self.run_dir = run_dir
        self._handle: Optional[IO[str]] = handle
        self.took_over = took_over
        """The owner the lock file still named when this process took the lock over from a dead
        one (``"pid 123 on host"``), else ``None``."""

    def release(self) -> None:
        """Clear the owner record and unlock (an owner that ended normally leaves nothing stale)."""
        if self._handle is None:
            return
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.flush()
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None


def _busy(run_dir: Path, handle: IO[str]) -> RunBusy:
    handle.seek(0)
    owner = handle.read().strip() or "another process"
    handle.close()
    return RunBusy("KPOOL_RUN_ID", run_dir.name, "a run directory no other process is using",
                   f"run directory {run_dir} is in use by {owner} (it holds {run_dir / LOCK_FILE}). "
                   f"Wait for that process to end (then rerun this command to continue the run), "
                   f"or start another run: another KPOOL_RUN_ID, or train.resume=none with no "
                   f"KPOOL_RUN_ID set")


def _locked(handle: IO[str]) -> bool:
    """Take the lock without blocking; ``False`` when another process holds it."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        return False
    return True


def check_free(run_dir: Path) -> None:
    """Raise :class:`RunBusy` when a live process owns ``run_dir``; changes nothing (the launcher
    calls it before Hydra writes into the run directory)."""
    if not (run_dir / LOCK_FILE).is_file():
        return
    with open(run_dir / LOCK_FILE, encoding="utf-8") as handle:
        if not _locked(handle):
            raise _busy(run_dir, handle)
        fcntl.flock(handle, fcntl.LOCK_UN)


def acquire(run_dir: Path) -> RunOwner:
    """Take ownership of ``run_dir`` (created if missing) or raise :class:`RunBusy` at once."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115  (held open for the run: the lock lives as long as the file)
    try:
        locked = _locked(handle)
    except OSError:
        handle.close()
        raise
    if not locked:
        raise _busy(run_dir, handle)
    handle.seek(0)
    previous = handle.read().strip() or None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return RunOwner(run_dir, handle, previous)
