"""Runs shorter than the presets assume: a warmup or a drift interval that does not fit the run
is fitted to it, with one console line each (:func:`fit_to_run_length`).

``train.lr_warmup_steps`` must be below ``train.steps`` (recipes/config/schema.py). The default (3, of
conf/train/default.yaml) and the experiments' warmups are written for their own run lengths; with
``train.steps=2`` the preset warmup cannot fit, so it is clamped to 10% of the run (the default's
3 of 30), rounded down, and the console says so in one line. A warmup set on the command line is
the user's choice and is never changed: validation refuses it with the allowed range instead.

``precision.drift.interval`` (50 in the schema) is longer than the 30-step default run, which then
measured no top-k drift at all. A preset interval longer than the run is set to a third of it
(three measurements, rounded down, at least 1); one set on the command line is kept, and when it is
longer than the run the console says before step 1 that the run logs no ``dsa/*`` drift.
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

WARMUP_KEY = "train.lr_warmup_steps"
DRIFT_KEY = "precision.drift.interval"
DRIFT_MEASUREMENTS = 3
"""How many drift measurements a run gets when the preset interval is longer than the run."""
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


def fit_drift_interval(cfg: DictConfig, overrides: list[str]) -> Optional[str]:
    """Sets ``cfg.precision.drift.interval`` (in place) to ``max(1, train.steps // 3)`` when the
    composed interval is longer than the run and the command line did not set it; returns the
    console line saying so (or, for an interval set on the command line that is longer than the
    run, the line saying that no drift is measured), None when the interval fits or is 0 (off)."""
    interval, steps = int(cfg.precision.drift.interval), int(cfg.train.steps)
    if interval <= steps or interval == 0:
        return None
    if _on_command_line(DRIFT_KEY, overrides):
        return (f"{DRIFT_KEY}={interval} is longer than train.steps={steps}: this run measures "
                f"no top-k drift (no dsa/* metrics); set {DRIFT_KEY} <= {steps} to measure it")
    fitted = max(1, steps // DRIFT_MEASUREMENTS)
    cfg.precision.drift.interval = fitted
    return (f"{DRIFT_KEY}={interval} is longer than train.steps={steps}: top-k drift measured "
            f"every {fitted} steps instead; set {DRIFT_KEY} to choose (0 = off)")


def fit_to_run_length(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """Applies :func:`clamp_warmup` and :func:`fit_drift_interval`; the console lines to print."""
    return [note for note in (clamp_warmup(cfg, overrides), fit_drift_interval(cfg, overrides)) if note]
