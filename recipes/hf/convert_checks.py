"""Up-front checks of ``scripts/convert_checkpoint.py``'s paths, and its one-line errors.

* ``export`` never writes into its own source: ``--hf-out`` equal to or inside ``--ckpt`` (or
  ``--ckpt`` inside ``--hf-out``, which ``--force`` would replace) is refused before anything is
  read.
* ``--ckpt`` must be one checkpoint, not a run directory or a checkpoint root (the error names the
  checkpoint to pass instead, the one ``latest`` names when there is one).
* An output directory (``--out``, ``--hf-out``) must be creatable: the nearest existing directory
  above it is writable (the conversion writes a temporary directory next to it first); the error
  names the flag and the path given, not the temporary directory.
* :func:`one_line` turns any error of a conversion into one line naming its file.
"""

from __future__ import annotations

import os
from pathlib import Path


class ConversionInputError(ValueError):
    """A path given to the converter that cannot work."""


def check_export_paths(ckpt: str | os.PathLike, hf_out: str | os.PathLike) -> None:
    """Raise :class:`ConversionInputError` when ``hf_out`` and ``ckpt`` overlap."""
    src, dst = Path(ckpt).resolve(), Path(hf_out).resolve()
    if dst == src or src in dst.parents:
        raise ConversionInputError(f"--hf-out {hf_out} is {'' if dst == src else 'inside '}--ckpt {ckpt}: "
                                   "the export would replace its own source; choose another --hf-out")
    if dst in src.parents:
        raise ConversionInputError(f"--ckpt {ckpt} is inside --hf-out {hf_out}: --force would remove the "
                                   "checkpoint being exported; choose another --hf-out")


def check_single_checkpoint(ckpt: str | os.PathLike) -> None:
    """Raise :class:`ConversionInputError` when ``ckpt`` is missing, or is a run directory or a
    checkpoint root instead of one checkpoint directory."""
    path = Path(ckpt)
    if not path.is_dir():
        raise ConversionInputError(f"--ckpt {ckpt}: no such checkpoint directory")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    inner = sorted(p.name for p in root.glob("iter_*") if p.is_dir() and ".tmp" not in p.name)
    if inner or (root / "latest").is_file():
        try:
            named = (root / "latest").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            named = ""
        pick = root / (named if named in inner else (inner[-1] if inner else "iter_NNNNNNN"))
        kind = "a run directory" if root != path else "a checkpoint root"
        raise ConversionInputError(f"--ckpt {ckpt} is {kind}, not one checkpoint: pass one of its "
                                   f"checkpoints, e.g. --ckpt {pick}")


def check_output_dir(target: str | os.PathLike, flag: str) -> None:
    """Raise :class:`ConversionInputError` naming ``flag`` and ``target`` when ``target`` cannot be
    written: the nearest existing path above it is a file, or a directory this user cannot write."""
    above = Path(target).absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConversionInputError(f"{flag} {target}: cannot create it, {above} is a file, not a "
                                   f"directory; choose another {flag}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConversionInputError(f"{flag} {target}: cannot create it, {above} is not writable by "
                                   f"this user; choose another {flag}")


def one_line(err: BaseException) -> str:
    """``error: <Type>: <message>`` on one line; the file an ``OSError`` names is included; a
    message that wraps a traceback (torch DCP) is cut to its last line."""
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in str(err):
        text = f"{err.strerror or err}: {err.filename}"
    else:
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        text = lines[-1].strip() if len(lines) > 1 and "Traceback" in str(err) else " ".join(lines)
    return f"error: {type(err).__name__}: {text}"
