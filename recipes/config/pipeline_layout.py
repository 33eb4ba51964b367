"""Decoder layers per pipeline stage, as megatron-core splits them, and the IndexShare stage rule.

megatron splits ``num_layers`` evenly over the PP stages, or, with
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``, puts those on the
first / last stage and splits the rest evenly over the middle ones (GLM-5.2's 78 layers need this
for PP = 4 or 8). Under IndexShare (``model.dsa_indexer_topk_freq`` > 1) every stage must start on a
layer that computes its own top-k: a stage cannot reuse a top-k that another stage computed.
"""

from __future__ import annotations

from typing import Optional

from kpool_layers import model_facts


def stage_layers(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> Optional[list[int]]:
    """Layers of each stage, or ``None`` if megatron cannot split ``num_layers`` that way."""
    if pp == 1:
        return [num_layers] if first is None and last is None else None
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle == 0:
        return [first, last] if rest == 0 else None
    if rest < middle or rest % middle:
        return None
    each = rest // middle
    return [first or each] + [each] * (pp - 2) + [last or each]


def stage_starts(layers: list[int]) -> list[int]:
    """The 1-indexed first layer of each stage but the first."""
    starts, total = [], 0
    for count in layers[:-1]:
        total += count
        starts.append(total + 1)
    return starts


def shares_across_stages(layers: list[int], freq: int, offset: int) -> Optional[int]:
    """The first stage start that would reuse another stage's top-k, or ``None``."""
    return next((s for s in stage_starts(layers) if not model_facts.computes_topk(s, freq, offset)), None)


def shares_across_stages_pattern(layers: list[int], pattern: model_facts.LayerPattern) -> Optional[int]:
    """The first DSA layer whose top-k source (:class:`kpool_layers.model_facts.LayerPattern`)
    lies in an earlier stage than its own, or ``None``."""
    start = 1
    for count in layers:
        for n in range(start, start + count):
            if not pattern.is_linear_attention(n) and pattern.topk_source_layer(n) < start:
                return n
        start += count
    return None


def suggest_layout(num_layers: int, pp: int, freq: int, offset: int) -> Optional[tuple[int, int]]:
    """(first, last) stage sizes that split ``num_layers`` over ``pp`` stages under the IndexShare
    rule with the smallest largest stage (then the most even first/last); ``None`` if none does."""
    best = None
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            layers = stage_layers(num_layers, pp, first, last)
            if layers is None or shares_across_stages(layers, freq, offset) is not None:
                continue
            score = (max(layers), abs(first - last))
            if best is None or score < best[0]:
                best = (score, (first, last))
    return best[1] if best else None
