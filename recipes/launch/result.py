"""``result.json``: how a run ended, one record type with one writer and one reader.

Written into the run directory when training ends (completed, failed or preempted; rank 0 only,
:mod:`recipes.loop`), or completed from Hydra's job return by the sweep callback for a job that
died before writing one (:mod:`recipes.observe.sweep`). Read by the sweep summary, by "rerun resumes the
last unfinished run" (:mod:`recipes.launch.run_dir`) and by the SLURM tests. Always valid JSON: a
non-finite loss is ``null``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from recipes.train.nonfinite import json_safe

RESULT_FILE = "result.json"
Status = Literal["completed", "failed", "preempted"]


@dataclass(frozen=True)
class RunResult:
    """How a run ended: ``status``, the error (``"<Type>: <message>"``, None unless failed), the
    command-line overrides, the last step's loss (None if none or non-finite) and the number of
    optimizer steps done."""

    status: Status
    error: Optional[str]
    overrides: list[str]
    final_loss: Optional[float]
    steps: int

    @classmethod
    def failed(cls, error: BaseException | str, overrides: list[str]) -> RunResult:
        """A run of ``train.py`` that failed before or during training (no step counted; the
        metrics say how far it got)."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return cls("failed", text, list(overrides), None, 0)

    def write(self, run_dir: Path) -> None:
        """``run_dir/result.json``, atomically (a reader never sees half a file)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(json_safe(dataclasses.asdict(self)), indent=1, allow_nan=False) + "\n")
        tmp.replace(run_dir / RESULT_FILE)

    @classmethod
    def read(cls, run_dir: Path) -> Optional[RunResult]:
        """The run's result, or None when it has none (still running, killed) or it is unreadable."""
        try:
            data = json.loads((run_dir / RESULT_FILE).read_text())
            fields = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
            return cls(**{**fields, "overrides": list(fields["overrides"] or []),
                          "steps": int(fields["steps"] or 0)})
        except (OSError, ValueError, TypeError):
            return None
