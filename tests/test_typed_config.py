"""Issue #13: the composed config is converted once (``recipes.config.typed.to_config``) after the
validation, the recipes take the schema's dataclasses, and what is written down (the checkpoint
manifest's and the wandb run's config) is the same dict as before the conversion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import recipes.loop
from recipes.checkpoint.manifest import read_manifest
from recipes.config.schema import Config, DataConfig, DriftConfig, LoggingConfig, ModelConfig
from recipes.config.typed import plain, to_config
from tests.test_checkpoint_safety import CONF, FAST, _run

Calls = dict[str, list[tuple[Any, ...]]]


def _composed_as_before(cfg: DictConfig) -> dict[str, Any]:
    """What the recipes wrote before the conversion: the DictConfig as plain data, through JSON
    (as a manifest holds it)."""
    return json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))


def _spy(monkeypatch: pytest.MonkeyPatch, calls: Calls, *names: str) -> None:
    """Record the positional arguments of every call of ``recipes.loop.<name>``."""
    for name in names:
        original = getattr(recipes.loop, name)

        def wrapper(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls.setdefault(_name, []).append(args)
            return _original(*args, **kwargs)

        monkeypatch.setattr(recipes.loop, name, wrapper)


def test_a_run_converts_once_and_the_recipes_get_the_dataclasses(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    calls: Calls = {}
    _spy(monkeypatch, calls, "to_config", "preflight", "_build", "_batches", "packed_eod_id",
         "flop_model", "check_indexed_data", "MetricsLogger", "DriftMonitor", "IndexerLossMonitor")
    monkeypatch.setenv("KPOOL_TEST_SAVE", str(tmp_path / "saved"))
    _run(monkeypatch, tmp_path / "run", ("train.steps=1", "train.save=${oc.env:KPOOL_TEST_SAVE}",
                                         "logging.tags=[a,b]"))
    assert len(calls["to_config"]) == 1
    (composed,), = calls["to_config"]
    for name in ("preflight", "_build", "_batches", "packed_eod_id", "flop_model"):
        assert [type(args[0]) for args in calls[name]] == [Config], name
    assert type(calls["check_indexed_data"][0][0]) is DataConfig
    assert type(calls["MetricsLogger"][0][1]) is LoggingConfig
    assert type(calls["DriftMonitor"][0][0]) is DriftConfig
    assert type(calls["IndexerLossMonitor"][0][0]) is ModelConfig
    expected = _composed_as_before(composed)
    assert expected["train"]["save"] == str(tmp_path / "saved")
    assert calls["MetricsLogger"][0][2] == expected  # the wandb run's config
    assert read_manifest(tmp_path / "saved" / "iter_0000001")["config"] == expected


def test_a_dry_run_gets_the_dataclass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: Calls = {}
    _spy(monkeypatch, calls, "to_config", "dry_run")
    _run(monkeypatch, tmp_path / "dry", ("train.dry_run=true",))
    assert len(calls["to_config"]) == 1
    assert [type(args[0]) for args in calls["dry_run"]] == [Config]


def _options() -> list[str]:
    return [f"{group}={p.stem}" for group in ("model", "precision", "parallelism", "data", "logging", "experiment")
            for p in sorted((CONF / group).glob("*.yaml"))]


@pytest.mark.parametrize("override", _options() + ["data.paths=[a,b]", "model.num_moe_experts=null",
                                                   "train.lr=1", "train.save=${oc.env:HOME}/ckpt"])
def test_the_written_config_is_the_composed_one(override: str) -> None:
    """Same keys, order, values and types (1 stays 1.0 in a float field) as the DictConfig gave."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*FAST, override])
    written = plain(to_config(cfg))
    assert json.dumps(written) == json.dumps(_composed_as_before(cfg))
