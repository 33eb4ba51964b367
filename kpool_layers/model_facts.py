"""Per-layer facts of a GLM-5.x decoder, from plain numbers: which layers compute their own DSA
top-k (IndexShare), which are MoE, which KPool sizes are valid.

The one definition of each fact. :class:`kpool_layers.config.GLMTransformerConfig` exposes them as
methods (``computes_topk``, ``topk_source_layer``, ``is_moe``); the recipes (schema, dry run, HF
mapping and config) call these functions with their ``model`` group's numbers. Nothing here
imports megatron; the tests check the rules against megatron's ``is_dsa_skip_topk_layer``,
``source_dsa_compute_layer`` and ``get_moe_layer_pattern``.

Layer numbers are 1-based decoder layers (megatron's ``layer_number``); MTP layers number from 1
again in their own block.
"""

from __future__ import annotations

from typing import Optional, Union

KPOOL_ALLOWED = (1, 2, 4, 8, 16, 32, 64)
"""Powers of two that divide 64 (the serving engines' index-cache page size)."""

MoeLayerFreq = Union[int, list[int]]
"""megatron's ``moe_layer_freq``: one MoE layer every N layers, or a 0/1 pattern per layer."""


def _first_shared_layer(skip_topk_offset: int) -> int:
    """IndexShare counts from layer ``max(offset, 1)`` (offset 0 still starts at layer 1)."""
    return max(skip_topk_offset, 1)


def computes_topk(layer_number: int, topk_freq: int, skip_topk_offset: int) -> bool:
    """Whether layer ``layer_number`` runs its own indexer: every layer up to ``max(offset, 1)``,
    then every ``topk_freq``-th layer from there (``topk_freq = 1``: every layer)."""
    start = _first_shared_layer(skip_topk_offset)
    return max(layer_number - start, 0) % topk_freq == 0


def topk_source_layer(layer_number: int, topk_freq: int, skip_topk_offset: int) -> int:
    """The computing layer whose top-k layer ``layer_number`` uses (itself when it computes)."""
    start = _first_shared_layer(skip_topk_offset)
    if layer_number <= start:
        return layer_number
    return layer_number - (layer_number - start) % topk_freq


def topk_layers(num_layers: int, topk_freq: int, skip_topk_offset: int) -> list[int]:
    """The layers (of ``1..num_layers``) that compute their own top-k."""
    return [n for n in range(1, num_layers + 1) if computes_topk(n, topk_freq, skip_topk_offset)]


def moe_layer_freq(num_layers: int, num_moe_experts: Optional[int],
                   first_k_dense_layers: int) -> MoeLayerFreq:
    """megatron's ``moe_layer_freq`` for GLM-5.x's layout: ``first_k_dense_layers`` dense layers,
    then MoE (``1``, i.e. all layers MoE, when the model has no experts: they are then dense)."""
    if not num_moe_experts:
        return 1
    return [0] * first_k_dense_layers + [1] * (num_layers - first_k_dense_layers)


def is_moe(layer_number: int, num_moe_experts: Optional[int], freq: MoeLayerFreq) -> bool:
    """Whether layer ``layer_number`` is an MoE layer under megatron's ``moe_layer_freq``
    ``freq``; never without experts. MTP layers copy the last decoder layer's kind."""
    if not num_moe_experts:
        return False
    if isinstance(freq, int):
        return (layer_number - 1) % freq == 0
    return bool(freq[layer_number - 1])


def kpool_problem(kpool: int, topk: Optional[int]) -> Optional[tuple[str, int, str]]:
    """``(field, value, allowed)`` of the first KPool rule that ``kpool`` / ``topk`` break (None
    when both are valid; ``topk`` None is not checked)."""
    if kpool not in KPOOL_ALLOWED:
        return ("dsa_indexer_kpool", kpool,
                f"{list(KPOOL_ALLOWED)} (powers of two dividing 64, the serving index-cache page)")
    if topk is not None and (topk < 1 or topk % kpool != 0):
        return "dsa_indexer_topk", topk, f"a positive multiple of dsa_indexer_kpool={kpool}"
    return None
