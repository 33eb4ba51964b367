"""A resume follows the current LR / weight-decay settings (``train.lr``, ``train.min_lr``,
``train.weight_decay``) from the saved step.

megatron's optimizer pairs each saved param group with the current one by a tuple of its settings,
``max_lr`` / ``min_lr`` / ``start_wd`` / ``end_wd`` among them
(``megatron.core.optimizer.optimizer.param_group_identifier_keys``), so a changed ``train.lr``
found no saved group (a ``KeyError``) and every intact checkpoint was reported unusable.
:func:`follow_current_settings` rewrites those values in the loaded state to the current ones
before it is loaded; :func:`schedule_notes` says on the console what changed.
"""

from __future__ import annotations

from typing import Any, Iterator

SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
"""The param-group settings the scheduler sets from the config (and megatron matches groups by)."""
CONFIG_KEYS = ("lr", "min_lr", "weight_decay")


def _saved_groups(state: Any) -> Iterator[dict[str, Any]]:
    """Every param group of a loaded (possibly chained, nested) optimizer state dict."""
    if isinstance(state, dict):
        groups = state.get("param_groups")
        if isinstance(groups, list):
            yield from (g for g in groups if isinstance(g, dict))
        for key, value in state.items():
            if key != "param_groups":
                yield from _saved_groups(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _saved_groups(value)


def follow_current_settings(saved_state: Any, current_groups: list[dict[str, Any]]) -> None:
    """In place: each of :data:`SCHEDULE_KEYS` that holds one value over all saved groups and one
    (other) value over all current groups gets the current value in the saved groups, so the
    groups pair up again. Keys with several values per side (per-group overrides) are left as
    they are: megatron then pairs groups by them as before."""
    saved = list(_saved_groups(saved_state))
    for key in SCHEDULE_KEYS:
        before = {g.get(key) for g in saved}
        now = {g.get(key) for g in current_groups}
        if len(before) == 1 and len(now) == 1 and before != now:
            (value,) = now
            for group in saved:
                group[key] = value


def schedule_notes(saved_config: dict[str, Any], current_config: dict[str, Any]) -> list[str]:
    """A console line for each of ``train.lr`` / ``train.min_lr`` / ``train.weight_decay`` that
    differs between a checkpoint's saved config and the current one."""
    saved, now = saved_config.get("train") or {}, current_config.get("train") or {}
    return [f"train.{key} changed {saved[key]} -> {now.get(key)}: the schedule follows the new value "
            "from the saved step" for key in CONFIG_KEYS if key in saved and saved[key] != now.get(key)]
