"""The console a user sees: no library warnings, step lines with elapsed time and ETA, and one
summary line at the end."""

from __future__ import annotations

import re
from pathlib import Path

from tests.train_runner import run_train


def test_console_is_quiet_and_ends_with_a_summary(tmp_path: Path) -> None:
    out = run_train(tmp_path, "quiet", ["model=glm5_tiny", "precision=fp32", "data.seq_length=64",
                                        "train.steps=2", "train.lr_warmup_steps=1",
                                        "logging.mode=disabled", "train.save_final=false"])
    assert "Warning" not in out.stderr and "warn" not in out.stdout + out.stderr, out.stderr
    assert "WARNING" not in out.stdout + out.stderr  # megatron's log warnings: rank log file only
    rank_log = (tmp_path / "quiet" / "train_rank0.log").read_text()
    assert "WARNING" in rank_log  # kept there
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(re.search(r"\| [\d.]+s elapsed, ETA [\d.]+s$", s) for s in steps)
    # The rank log held warnings but no step lines; it keeps the console's own lines (once each).
    logged = [line.split("[kpool.console][INFO] - ", 1)[1] for line in rank_log.splitlines()
              if "[kpool.console][INFO] - " in line]
    assert [line for line in logged if line.startswith("step ")] == steps
    assert logged[-1] == out.stdout.strip().splitlines()[-1]  # the summary line
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"completed: 2 steps, 512 tokens, [\d.]+s, final loss \d+\.\d{{4}}, "
                        rf"run dir {re.escape(str(tmp_path / 'quiet'))}", last), last
