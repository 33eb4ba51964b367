"""Runs shorter than the presets assume: a warmup that does not fit the run is clamped to it.

``train.lr_warmup_steps`` must be below ``train.steps`` (recipes/schema.py). The default (3, of
conf/train/default.yaml) and the experiments' warmups are written for their own run lengths; with
``train.steps=2`` the preset warmup cannot fit, so it is clamped to 10% of the run (the default's
3 of 30), rounded down, and the console says so in one line. A warmup set on the command line is
the user's choice and is never changed: validation refuses it with the allowed range instead.
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

WARMUP_KEY = "train.lr_warmup_steps"
WARMUP_FRACTION = 0.1
"""The clamped warmup's share of the run: conf/train/default.yaml's 3 warmup steps of 30."""


def _on_command_line(key: str, overrides: list[str]) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def clamp_warmup(cfg: DictConfig, overrides: list[str]) -> Optional[str]:
    """Clamps ``cfg.train.lr_warmup_steps`` (in place) to ``floor(0.1 * train.steps)`` when the
    composed warmup is not below ``train.steps`` and the command line did not set it; returns the
    console line saying so, or None when nothing changed."""
    train = cfg.train
    warmup, steps = int(train.lr_warmup_steps), int(train.steps)
    if warmup < steps or steps < 1 or _on_command_line(WARMUP_KEY, overrides):
        return None
    clamped = int(steps * WARMUP_FRACTION)
    train.lr_warmup_steps = clamped
    return (f"{WARMUP_KEY}={warmup} does not fit train.steps={steps}: warmup clamped to {clamped} "
            f"steps ({WARMUP_FRACTION:.0%} of the run); set {WARMUP_KEY} to choose")
