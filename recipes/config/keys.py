"""Every config key must exist in the schema (``recipes/config/schema.py``), also with ``+``/``++``.

Hydra's struct mode rejects ``model.foo=1`` but lets ``+model.foo=1`` and ``++model.foo=1`` add a
key nothing reads (a typo that silently does nothing). :func:`check_overrides` checks command-line
overrides before Hydra composes (so a typo gets "did you mean" instead of Hydra's struct error) and
:func:`check_config_keys` checks a composed config. Keys under :data:`OPEN_PREFIXES` are not
checked: Hydra's own ``hydra.*`` (launcher, sweeper, job settings).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterator, Optional

from omegaconf import DictConfig

from recipes.config.groups import SCHEMA_OPTION, group_options
from recipes.config.schema import Config, ConfigError

OPEN_PREFIXES = ("hydra",)
"""Declared extension points: top-level nodes whose keys the schema does not describe."""

GROUPS = ("model", "precision", "parallelism", "data", "train", "logging", "experiment", "debug")
"""Config groups: ``group=option`` selects a file of ``conf/<group>/``."""


class UnknownKeyError(ConfigError):
    """A key the schema does not have, with the closest existing key."""

    def __init__(self, key: str, value: Any) -> None:
        self.suggestion = suggest(key)
        hint = (f"did you mean {self.suggestion}?" if self.suggestion
                else "`python train.py --cfg job` prints every key.")
        super().__init__(key, value, f"keys of the schema (recipes/config/schema.py); {hint}",
                         f"unknown config key {key} (in {key}={value!r}): {hint} Unknown keys are "
                         "errors, also with + or ++, because nothing would read them.")


def schema_keys(schema: type = Config, prefix: str = "") -> Iterator[tuple[str, bool]]:
    """(dotted key, is a node) of every field of ``schema`` and its nested dataclasses."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        node = dataclasses.is_dataclass(hints[f.name])
        yield key, node
        if node:
            yield from schema_keys(hints[f.name], key + ".")


def suggest(key: str) -> Optional[str]:
    """The existing key closest to ``key``: one ending in it (``drift.interval`` ->
    ``precision.drift.interval``), one with the same last part under another group, the closest
    spelling (``train.step`` -> ``train.steps``), one whose last part contains it (``kpool`` ->
    ``model.dsa_indexer_kpool``), or the closest last part."""
    keys = [k for k, node in schema_keys() if not node]
    leaf = key.rsplit(".", 1)[-1]
    for candidates in ([k for k in keys if k.endswith("." + key)],
                       [k for k in keys if k.rsplit(".", 1)[-1] == leaf],
                       difflib.get_close_matches(key, keys, n=1, cutoff=0.75),
                       [k for k in keys if len(leaf) >= 4 and leaf in k.rsplit(".", 1)[-1]]):
        if candidates:
            return candidates[0]
    close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1, cutoff=0.75)
    return next((k for k in keys if close and k.rsplit(".", 1)[-1] == close[0]), None)


def _open(key: str) -> bool:
    return key.replace("/", ".").split(".", 1)[0] in OPEN_PREFIXES


def _check_value(key: str, value: Any, known: dict[str, bool]) -> None:
    if _open(key):
        return
    if key not in known:
        raise UnknownKeyError(key, value)
    if known[key] and isinstance(value, dict):  # a node given as a dict: check its keys
        for sub, sub_value in value.items():
            _check_value(f"{key}.{sub}", sub_value, known)


def check_overrides(overrides: list[str]) -> None:
    """Raise :class:`UnknownKeyError` for an override whose key is not in the schema.

    ``group=option`` selections and ``hydra.*`` / ``hydra/...`` pass; a syntax error is left to
    Hydra's own message.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    known = dict(schema_keys())
    for override in parsed:
        key = override.key_or_group
        value = None if override.is_sweep_override() else override.value()
        if key in GROUPS and value == SCHEMA_OPTION:
            raise ConfigError(key, value, f"one of {group_options(key)} (`{key}/schema` is the "
                              "group's typed schema, not an option)")
        if key in GROUPS and (value is None or isinstance(value, str)):
            continue
        _check_value(key, value, known)


def check_config_keys(cfg: DictConfig) -> None:
    """Raise :class:`UnknownKeyError` for a key of a composed config that the schema lacks."""
    known = dict(schema_keys())

    def walk(node: DictConfig, prefix: str) -> None:
        for name in node.keys():
            key = prefix + str(name)
            if _open(key):
                continue
            if key not in known:
                value = node[name]
                while isinstance(value, DictConfig) and len(value):  # name the added leaf
                    first = next(iter(value.keys()))
                    key, value = f"{key}.{first}", value[first]
                raise UnknownKeyError(key, value)
            if known[key]:
                walk(node[name], key + ".")

    walk(cfg, "")
