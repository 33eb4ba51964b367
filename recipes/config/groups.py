"""The config groups a user picks from (``group=option``): the option files of ``conf/<group>/``
(shipped as ``recipes/conf``), for ``--help`` and for refusing ``<group>=schema``.

``<group>/schema`` is the typed schema node each group's files extend (registered in ConfigStore by
:func:`recipes.config.schema.register_configs`); it is no option: selecting it built the schema's default
values (glm5_tiny for ``model=schema``) under the name of a choice.
"""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SCHEMA_OPTION = "schema"


def group_options(group: str) -> list[str]:
    """The options of ``group`` (``+debug`` too): the ``.yaml`` stems of ``conf/<group>/``, sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def user_groups() -> list[str]:
    """Every group directory of ``conf/`` but Hydra's own (``hydra/``), sorted."""
    return sorted(p.name for p in CONF_DIR.iterdir()
                  if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml")))


def group_lines(choices: dict[str, str] | None = None) -> str:
    """One line per group: its options, the current choice (``choices``, Hydra's
    ``runtime.choices``) marked with ``*``."""
    choices = choices or {}
    width = max(len(g) for g in user_groups()) + 1
    lines = []
    for group in user_groups():
        chosen = choices.get(group)
        options = [f"{o}*" if o == chosen else o for o in group_options(group)]
        lines.append(f"  {group:<{width}} {', '.join(options)}")
    return "\n".join(lines)
