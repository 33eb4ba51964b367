"""``kpool-train`` flags answered before Hydra sees the command line: ``--version`` (the package's
version, :data:`recipes.__version__`; Hydra's own ``--version`` would print Hydra's) and
``--describe KEY`` (a schema key's type, range, default and doc); and the ``kpool_groups``
resolver of the ``--help`` page (conf/hydra/help/kpool.yaml)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from enum import Enum
from typing import Any, Optional

from omegaconf import OmegaConf

import recipes
from recipes.config import schema
from recipes.config.groups import group_lines


def register_help_resolver() -> None:
    """``${kpool_groups:}``: one line per config group with its options (the current one marked)."""
    def lines() -> str:
        from hydra.core.hydra_config import HydraConfig

        try:
            choices = dict(HydraConfig.get().runtime.choices)
        except ValueError:  # outside a composed Hydra run
            choices = {}
        return group_lines(choices)

    if not OmegaConf.has_resolver("kpool_groups"):
        OmegaConf.register_new_resolver("kpool_groups", lines)


def _field(key: str) -> tuple[type, dataclasses.Field, Any]:
    """The dataclass owning ``key`` (dotted, from the root :class:`~recipes.config.schema.Config`), the
    field and its type hint; KeyError naming the key when the schema has none."""
    owner: type = schema.Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(owner)}
        if part not in fields:
            raise KeyError(key)
        hint = typing.get_type_hints(owner)[part]
        if i == len(parts) - 1:
            return owner, fields[part], hint
        if not dataclasses.is_dataclass(hint):
            raise KeyError(key)
        owner = hint
    raise KeyError(key)


def _doc(owner: type, name: str) -> Optional[str]:
    """The comment after the field's line in recipes/config/schema.py (the class itself, or the frozen
    class a mutable group schema copies), None when there is none."""
    pattern = re.compile(rf"^\s+{re.escape(name)}:[^#\n]*#\s*(.+)$", re.M)
    candidates = [owner, *(c for c in vars(schema).values()
                           if inspect.isclass(c) and dataclasses.is_dataclass(c) and c is not owner
                           and {f.name for f in dataclasses.fields(c)} <= {f.name for f in dataclasses.fields(owner)})]
    for cls in candidates:
        try:
            found = pattern.search(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        if found:
            return found[1].strip()
    return None


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = args[0] if optional and len(args) == 1 else hint
    text = getattr(base, "__name__", str(base)).replace("typing.", "")
    return f"{text} or null" if optional else text


def describe(key: str) -> str:
    """``KEY: type, range or choices, default, doc`` of a schema key; KeyError when unknown."""
    owner, f, hint = _field(key)
    lines = [f"{key}: {_type_name(hint)}"]
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if "range" in f.metadata:
        lines.append(f"  range:   {f.metadata['range']}")
    if inspect.isclass(base) and issubclass(base, Enum):
        lines.append(f"  choices: {', '.join(m.value for m in base)}")
    default = f.default_factory() if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING else f.default
    if dataclasses.is_dataclass(default):
        lines.append(f"  a group: see --describe {key}.<key>")
    else:
        lines.append(f"  default: {default.value if isinstance(default, Enum) else default!r} (schema; a conf/ preset may set another)")
    doc = _doc(owner, f.name)
    if doc:
        lines.append(f"  doc:     {doc}")
    group = key.rsplit(".", 1)[0] if "." in key else "(root)"
    lines.append(f"  in:      {group}: {(owner.__doc__ or '').strip().splitlines()[0]}")
    return "\n".join(lines)


def answer_info_flags(argv: list[str]) -> bool:
    """Prints the answer to an info flag in ``argv`` and returns True (the command then exits);
    returns False when there is none."""
    if "--version" in argv:
        print(f"kpool-recipes {recipes.__version__}")
        return True
    if "--describe" in argv:
        i = argv.index("--describe")
        if i + 1 >= len(argv):
            raise SystemExit("usage: kpool-train --describe KEY (e.g. train.lr_warmup_steps)")
        key = argv[i + 1]
        try:
            print(describe(key))
        except KeyError:
            from recipes.config.keys import suggest

            hint = suggest(key)
            raise SystemExit(f"error: no config key {key}" + (f"; did you mean {hint}?" if hint else ""))
        return True
    return False
