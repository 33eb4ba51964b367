"""``kpool-train`` flags answered before Hydra sees the command line: ``--version`` (the package's
version, :data:`recipes.__version__`; Hydra's own ``--version`` would print Hydra's)."""

from __future__ import annotations

import recipes


def answer_info_flags(argv: list[str]) -> bool:
    """Prints the answer to an info flag in ``argv`` and returns True (the command then exits);
    returns False when there is none."""
    if "--version" in argv:
        print(f"kpool-recipes {recipes.__version__}")
        return True
    return False
