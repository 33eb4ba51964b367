"""Resuming a checkpoint already at or past ``train.steps`` (issue 34; the old bug: it printed
"completed" as if it had trained, and a lower ``train.steps`` cut ``metrics.jsonl`` back to it).
Now the run ends before the build as completed (exit 0, as megatron's loop does), naming the
checkpoint's step and ``train.steps``, and leaves every file as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.launch.result import RunResult
from tests.test_checkpoint_safety import Train, _snapshot, run_copy, three_checkpoints, train  # noqa: F401


@pytest.mark.parametrize("steps,where", [(3, "is at"), (2, "is past")])
def test_resume_at_or_past_train_steps_says_so_before_the_build_and_changes_nothing(
        run_copy: Path, train: Train, monkeypatch: pytest.MonkeyPatch, steps: int, where: str) -> None:  # noqa: F811
    import recipes.loop

    def no_build(cfg: object) -> None:
        raise AssertionError("the model was built for a run with nothing to train")

    monkeypatch.setattr(recipes.loop, "_build", no_build)
    before_files = _snapshot(run_copy / "checkpoints")
    before_metrics = (run_copy / "metrics.jsonl").read_text()
    out = train(run_copy, f"train.steps={steps}", "train.resume=auto")
    ckpt = run_copy / "checkpoints" / "iter_0000003"
    assert (f"nothing to train: checkpoint {ckpt} is at step 3 >= train.steps={steps} (the run "
            f"{where} its last step). To train further raise train.steps, the total step count, "
            f"e.g. train.steps={3 + steps} for {steps} more steps") in out
    assert "completed: 0 steps trained (checkpoint at step 3)" in out
    assert "LR schedule is re-planned" not in out and "step     1/" not in out
    assert _snapshot(run_copy / "checkpoints") == before_files  # no final save over iter_0000003
    assert (run_copy / "metrics.jsonl").read_text() == before_metrics  # steps 1..3 kept
    result = RunResult.read(run_copy)
    assert result is not None and (result.status, result.steps, result.final_loss) == ("completed", 3, None)
    assert json.loads((run_copy / "result.json").read_text())["error"] is None
