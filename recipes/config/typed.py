"""The composed config as the schema's dataclasses, and back as plain data.

Hydra composes a DictConfig; the checks that need it as composed run on it (every key in the schema,
also with ``+``/``++``, and the rules of :func:`recipes.config.rules.validate`; the checkpoint root, which
reads ``train.save`` before interpolation, :func:`recipes.checkpoint.resume.checkpoint_root`). Then
:func:`to_config` converts it once (``OmegaConf.to_object``: interpolations resolved, enums as
members) into the schema's :class:`~recipes.config.schema.Config`, which every recipe after that point
takes. :func:`plain` is the inverse for what is written down: the config of a checkpoint manifest
and of the wandb run.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from recipes.config.schema import Config


def to_config(cfg: DictConfig) -> Config:
    """The composed (and validated) config as a :class:`~recipes.config.schema.Config` instance."""
    config = OmegaConf.to_object(cfg)
    if not isinstance(config, Config):
        raise TypeError(f"not a composed config of the schema recipes.config.schema.Config: {type(config).__name__}")
    return config


def plain(node: Any) -> dict[str, Any]:
    """A schema dataclass instance (:class:`~recipes.config.schema.Config` or one of its groups) as plain
    data: nested dicts and lists, enums as their values; for the root the same dict as
    ``OmegaConf.to_container(composed, resolve=True, enum_to_str=True)`` of the DictConfig it was
    converted from."""
    return OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True)
