"""Resume with a changed ``train.lr`` / ``train.min_lr`` follows the new values and says so
(issue 34; the old bug: a ``KeyError`` that called every intact checkpoint "unusable")."""

from __future__ import annotations

from pathlib import Path

from tests.test_checkpoint_safety import Train, run_copy, three_checkpoints, train  # noqa: F401
from tests.train_runner import metrics


def test_resume_with_a_new_lr_follows_it_and_says_so(run_copy: Path, train: Train) -> None:  # noqa: F811
    out = train(run_copy, "train.steps=5", "train.lr=1e-3", "train.min_lr=1e-4", "train.lr_decay_style=constant")
    assert "unusable" not in out
    assert "resumed from" in out and "at step 3" in out
    assert "train.lr changed" in out
    lrs = [r["lr"] for r in metrics(run_copy) if r["step"] > 3]
    assert lrs == [1e-3, 1e-3]
