"""FP8-only ``precision.*`` keys under a profile without FP8 (issue 34; the old bug:
``precision=fp32 precision.recipe=tensorwise`` was accepted and did nothing)."""

from __future__ import annotations

import pytest

from recipes.config.fp8_only import FP8_ONLY
from recipes.config.rules import all_problems, validate
from recipes.config.schema import ConfigError
from tests.test_config import _compose

FP8_PROFILES = "(precision=fp8, precision=serving_match) or precision.fp8=true"


@pytest.mark.parametrize("profile,override,default", [
    ("fp32", "precision.recipe=tensorwise", "'blockwise'"),
    ("bf16", "precision.backend=emulate", "'auto'"),
    ("bf16", "precision.scale_format=amax", "'ue8m0'"),
    ("fp32", "precision.mla_proj_disable_quantization=true", "False"),
    ("bf16", "precision.dsa_indexer_qk_proj_disable_quantization=true", "False"),
    ("fp32", "precision.dsa_indexer_weights_proj_disable_quantization=true", "False"),
])
def test_an_fp8_only_key_set_without_fp8_is_an_error_naming_it(profile: str, override: str, default: str) -> None:
    key, value = override.split("=")
    with pytest.raises(ConfigError) as err:
        validate(_compose([f"precision={profile}", override]), 1)
    assert err.value.key == key
    assert str(err.value).startswith(f"invalid config: {key}=")
    assert (f"allowed: {default} (the precision={profile} value) with precision.fp8=false: it only "
            f"affects FP8 GEMMs, which this profile does not run; it needs an FP8 profile "
            f"{FP8_PROFILES}") in str(err.value)


def test_the_dry_run_lists_every_fp8_only_key_at_once() -> None:
    cfg = _compose(["precision=fp32", "precision.recipe=rowwise", "precision.backend=emulate", "train.dry_run=true"])
    keys = [p.key for p in all_problems(cfg, 1)]
    assert "precision.recipe" in keys and "precision.backend" in keys


@pytest.mark.parametrize("overrides", [
    ["precision=fp32"], ["precision=bf16"], ["precision=fp8"], ["precision=serving_match"],
    # FP8 on: every FP8-only key is the user's to set.
    ["precision=fp8", "precision.recipe=tensorwise", "precision.backend=emulate", "precision.scale_format=amax",
     "precision.fp8_backward=bf16"],
    ["precision=bf16", "precision.fp8=true", "precision.mla_proj_disable_quantization=true"],
    # The profile's own values are not the user's: serving_match's disable switches stay.
    ["precision=serving_match", "precision.fp8=false"],
    # The serving-quantized index scoring reads scale_format without FP8.
    ["precision=bf16", "precision.dsa_indexer_kpool_use_quantization=true", "precision.scale_format=amax"],
    # Set to the value the profile has anyway.
    ["precision=bf16", "precision.recipe=blockwise", "precision.backend=auto"],
])
def test_shipped_profiles_and_fp8_settings_with_fp8_pass(overrides: list[str]) -> None:
    validate(_compose(overrides), 1)


def test_every_fp8_only_key_is_a_precision_field() -> None:
    cfg = _compose(["precision=fp32"])
    assert all(key in cfg.precision for key in FP8_ONLY)
