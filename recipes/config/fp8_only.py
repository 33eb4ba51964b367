"""``precision.*`` keys that only change FP8 GEMMs, refused when the run has none.

Under ``precision.fp8=false`` no linear is quantized (:meth:`PrecisionPolicy.quantized` is False
for every role), so the FP8 recipe, the FP8 GEMM backend, the FP8 backward (``fp8_backward``) and the per-role
"keep unquantized" switches do nothing; ``scale_format`` also sets the serving-quantized index scoring and so matters
without FP8 when ``precision.dsa_indexer_kpool_use_quantization=true``. Such a key set to another
value than its profile's (``conf/precision/<precision.name>.yaml``, else the schema default) was
accepted and ignored; :func:`check_fp8_only_keys` makes it a
:class:`~recipes.config.schema.ConfigError` naming the key. A key the profile itself sets (e.g.
``precision=serving_match precision.fp8=false``) is not the user's setting and passes.
"""

from __future__ import annotations

import enum
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kpool_layers.precision.policy import PrecisionPolicy
from recipes.config.groups import CONF_DIR, group_options
from recipes.config.schema import ConfigError

FP8_ONLY = ("recipe", "backend", "scale_format", "dsa_indexer_qk_proj_disable_quantization",
            "mla_proj_disable_quantization", "dsa_indexer_weights_proj_disable_quantization", "fp8_backward")
"""The ``precision.*`` fields read only by FP8 GEMMs (``scale_format``: unless the index scoring
is serving-quantized)."""


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _profile_value(profile: str, key: str) -> Any:
    """``key``'s value in the precision profile ``profile`` (its yaml, else the schema default)."""
    default = _plain(getattr(PrecisionPolicy(), key))
    if profile not in group_options("precision"):
        return default
    return _plain(OmegaConf.load(CONF_DIR / "precision" / f"{profile}.yaml").get(key, default))


def check_fp8_only_keys(precision: DictConfig) -> list[ConfigError]:
    """The FP8-only keys of the composed ``precision`` group set away from their profile's value
    while ``precision.fp8`` is false, one error each (empty with FP8 on)."""
    if precision.fp8:
        return []
    profile = str(precision.name)
    fp8_profiles = [o for o in group_options("precision")
                    if OmegaConf.load(CONF_DIR / "precision" / f"{o}.yaml").get("fp8", False)]
    errors = []
    for key in FP8_ONLY:
        if key == "scale_format" and precision.dsa_indexer_kpool_use_quantization:
            continue  # the serving-quantized index scoring uses it without FP8
        value, expected = _plain(precision[key]), _profile_value(profile, key)
        if value != expected:
            errors.append(ConfigError(
                f"precision.{key}", value,
                f"{expected!r} (the precision={profile} value) with precision.fp8=false: it only "
                f"affects FP8 GEMMs, which this profile does not run; it needs an FP8 profile "
                f"({', '.join(f'precision={o}' for o in fp8_profiles)}) or precision.fp8=true"))
    return errors
