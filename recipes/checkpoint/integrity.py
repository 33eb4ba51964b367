"""What makes a checkpoint directory trustworthy before it is resumed.

* ``latest`` names one directory inside the checkpoint root: a marker that is empty, not UTF-8,
  holds a path separator or ``..``, or names nothing there counts as missing (the resume then
  takes the newest complete checkpoint and says why).
* A checkpoint written by this code always has its manifest: every save records
  :data:`MANIFEST_EXPECTED` in the checkpoint's common state, so a checkpoint that holds it and
  lacks ``kpool_manifest.json`` (deleted or lost) is an error, never loaded unverified. Only a
  checkpoint that predates manifests is accepted without one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from recipes.checkpoint.manifest import MANIFEST, CheckpointError, read_manifest
from recipes.checkpoint.manifest import verify as verify_files

LATEST = "latest"
MANIFEST_EXPECTED = "kpool_manifest_expected"
"""Key of the common (non-sharded) checkpoint state saved with every checkpoint since manifests."""


def latest_name(root: str | os.PathLike) -> Optional[str]:
    """The text of ``root/latest`` (undecodable bytes replaced), ``None`` without a marker."""
    marker = Path(root) / LATEST
    try:
        return marker.read_bytes().decode("utf-8", errors="replace").strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The checkpoint directory ``latest`` names inside ``root``; ``None`` when the marker is
    missing, malformed (not UTF-8, empty, a path) or names no directory there."""
    marker = Path(root) / LATEST
    try:
        name = marker.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not name or name in (".", "..") or "/" in name or (os.altsep and os.altsep in name) \
            or not name.isprintable():
        return None
    path = Path(root) / name
    return path if path.is_dir() and not path.is_symlink() else None


def _expects_manifest(directory: Path) -> bool:
    """Whether the checkpoint's common state records :data:`MANIFEST_EXPECTED` (one small object
    read from the dist checkpoint); an unreadable one counts as not, and the load then reports it."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        common = dist_checkpointing.load_common_state_dict(str(directory))
    except (Exception, CheckpointException):  # noqa: BLE001
        return False
    return isinstance(common, dict) and bool(common.get(MANIFEST_EXPECTED))


def verify(directory: str | os.PathLike) -> Optional[dict[str, Any]]:
    """:func:`recipes.checkpoint.manifest.verify`, and an error for a checkpoint written with a
    manifest that no longer has it. Returns the manifest (``None``: predates manifests)."""
    directory = Path(directory)
    manifest = verify_files(directory)
    if manifest is None and _expects_manifest(directory):
        raise CheckpointError(f"{directory / MANIFEST}: missing, and this checkpoint was written with "
                              "one (its files cannot be verified); restore it or use another checkpoint")
    return manifest


def predates_manifests(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a checkpoint without a manifest (loaded weights get checked)."""
    return read_manifest(directory) is None
