"""megatron's activation recompute as ``train.recompute_*`` keys: the megatron fields they set, and
the combinations refused before anything is built.

megatron-core recomputes activations in backward instead of keeping them: ``full`` checkpoints
whole transformer layers (``recompute_method`` uniform: every ``recompute_num_layers`` layers as one
unit; block: the first ``recompute_num_layers`` layers of each pipeline stage), ``selective``
checkpoints the submodules named in ``recompute_modules``.
"""

from __future__ import annotations

from typing import Any, Optional

MEGATRON_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""megatron-core 0.19.2's ``recompute_modules`` for a GPT model (``gdn_norm_out`` belongs to its
GatedDeltaNet layers, which GLM-5 has none of)."""


def recompute_fields(train: Any) -> dict[str, Any]:
    """``train``'s recompute keys -> megatron ``TransformerConfig`` fields (unset ones keep
    megatron's defaults)."""
    granularity = train.recompute_granularity
    fields: dict[str, Any] = {
        "recompute_granularity": None if granularity is None else granularity.value,
        "recompute_method": None if train.recompute_method is None else train.recompute_method.value,
        "recompute_num_layers": train.recompute_num_layers,
    }
    if train.recompute_modules is not None:
        fields["recompute_modules"] = list(train.recompute_modules)
    return fields


SELECTIVE_MODULES = ("mlp", "moe", "shared_experts")
"""The ``recompute_modules`` that recompute in this project's layers (``tests/test_recompute.py``
counts the second forward of each and compares loss and gradients with no recompute)."""

REFUSED_MODULES = {
    "core_attn": "the sparse MLA layer (kpool_layers.mla.attention) keeps its own core attention, "
                 "which megatron's core_attn checkpoint does not wrap (nothing would be recomputed)",
    "mla_up_proj": "the sparse MLA layer (kpool_layers.mla.attention) computes its up-projections "
                   "itself, outside megatron's mla_up_proj checkpoint (nothing would be recomputed)",
    "moe_act": "megatron recomputes the expert activation only in its own grouped MLP; "
               "kpool_layers.moe.experts does not checkpoint it and SequentialMLP is refused",
    "layernorm": "megatron-core 0.19.2's layernorm checkpoint fails here "
                 "(NameError: FP8GlobalStateManager)",
}
"""The ``recompute_modules`` refused, and why."""


def _name(value: Any) -> Optional[str]:
    """An enum member's value, a plain string as it is (the composed config holds either)."""
    return None if value is None else str(getattr(value, "value", value))


def problems(train: Any, num_layers: int, pipeline_size: int, num_moe_experts: Optional[int],
             moe_first_k_dense_layers: int, mtp_num_layers: int) -> list[tuple[str, Any, str]]:
    """``(key, value, allowed)`` of each recompute (and ``train.loss_chunk_tokens``) setting that
    cannot work with ``train`` (the composed ``train`` group) and the model's layer counts: a
    setting megatron would ignore or reject, or one that recomputes nothing in these layers."""
    found: list[tuple[str, Any, str]] = []
    granularity = _name(train.recompute_granularity)
    method, layers, modules = train.recompute_method, train.recompute_num_layers, train.recompute_modules
    if train.loss_chunk_tokens and mtp_num_layers:
        found.append(("train.loss_chunk_tokens", train.loss_chunk_tokens,
                      "0 with model.mtp_num_layers > 0 (megatron computes the MTP heads' logits whole)"))
    if granularity != "full":
        for key, value in (("recompute_method", method), ("recompute_num_layers", layers)):
            if value is not None:
                found.append((f"train.{key}", _name(value) if key == "recompute_method" else value,
                              "null unless train.recompute_granularity=full"))
    if granularity != "selective" and modules is not None:
        found.append(("train.recompute_modules", list(modules),
                      "null unless train.recompute_granularity=selective"))
    if granularity == "full":
        if method is None:
            found.append(("train.recompute_method", None, "uniform or block with train.recompute_granularity=full"))
        per_stage = num_layers // pipeline_size
        if layers is None or layers > per_stage:
            found.append(("train.recompute_num_layers", layers,
                          f"1..{per_stage} (layers per pipeline stage) with train.recompute_granularity=full"))
    if granularity == "selective":
        allowed = f"a non-empty list of {', '.join(SELECTIVE_MODULES)}"
        if not modules:
            found.append(("train.recompute_modules", None if modules is None else list(modules),
                          allowed + " (megatron's default, core_attn, recomputes nothing here)"))
        for name in modules or ():
            if name in REFUSED_MODULES:
                found.append(("train.recompute_modules", list(modules), f"{allowed}: {name} is refused, "
                              + REFUSED_MODULES[name]))
            elif name not in SELECTIVE_MODULES:
                found.append(("train.recompute_modules", list(modules), f"{allowed} ({name!r} is none)"))
            elif name in ("moe", "shared_experts") and num_moe_experts is None:
                found.append(("train.recompute_modules", list(modules),
                              f"{allowed} but moe and shared_experts, which a dense model has none of"))
            elif name == "mlp" and num_moe_experts is not None and moe_first_k_dense_layers == 0:
                found.append(("train.recompute_modules", list(modules),
                              f"{allowed} but mlp, which a model without dense layers has none of"))
    return found
