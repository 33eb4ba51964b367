"""Finite checkpoints only (issue 34): non-finite settings are refused, an update that made the
weights NaN/inf is never saved and ``latest`` never names it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from recipes.launch.distributed import register_resolvers
from recipes.train.nonfinite import NonFiniteError, check_weights_finite
from recipes.config.schema import ConfigError, numeric_fields, register_configs
from recipes.config.rules import validate
from tests.train_runner import run_train

CONF = Path(__file__).resolve().parents[1] / "conf"
FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=32", "logging.mode=disabled",
        "train.lr_warmup_steps=0", "train.micro_batch_size=2", "train.global_batch_size=2",
        "precision.drift.interval=0"]
register_resolvers()
register_configs()
FLOAT_KEYS = [key for key, f in numeric_fields() if isinstance(f.default, float)]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_setting_refuses_inf_and_nan(key: str, value: str) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=glm5_tiny", f"{key}={value}"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert err.value.key == key and "a finite number" in str(err.value)


def test_weight_check_names_the_step_and_the_first_bad_tensor() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    check_weights_finite(model, 7, "keeps")  # finite: no error
    with torch.no_grad():
        model[0].weight.fill_(3e38)  # huge but finite: max-abs does not overflow
    check_weights_finite(model, 7, "keeps")
    with torch.no_grad():
        model[1].bias[1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 7 .*1 parameter tensor.*first: 1\.bias"):
        check_weights_finite(model, 7, "keeps")


def test_update_that_makes_the_weights_nonfinite_is_never_saved(tmp_path: Path) -> None:
    """The old bug: ``train.lr=inf`` saved iter_0000001 with NaN/inf tensors and pointed
    ``latest`` at it. ``train.lr=1e38`` is finite (the range check accepts it) and its first
    update leaves every fp32 parameter tensor of the tiny model with NaN/inf (measured: 118 of
    118), from a finite loss and finite gradients."""
    proc = run_train(tmp_path, "huge_lr", [*FAST, "train.steps=2", "train.save_interval=1",
                                           "train.lr=1e38", "train.min_lr=0"], check=False)
    assert proc.returncode != 0
    assert "the weights after the update of step 1 are not finite" in proc.stderr
    root = tmp_path / "huge_lr" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == []  # no iter_*, no .tmp, no latest
