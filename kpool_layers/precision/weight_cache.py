"""FP8 weights quantized once per training step instead of once per micro-batch.

The optimizer changes the weights only after all micro-batches of a step, so a weight's e4m3
values and scales, and the operand the backward multiplies by, are the same in every micro-batch
of the step. Inside :func:`step_scope` the first forward of a weight quantizes it and keeps the
result (:class:`QuantizedWeight`), with ``keep_dequantized`` its first backward keeps the
backward's weight operand derived from it (:func:`derived_weight`), and the step's later
micro-batches reuse them. Outside a scope (evaluation, the drift measurement, export, tests)
nothing is kept: every call quantizes. The numerics are the same bits either way; only repeated
quantize / dequantize / transpose kernels go.

The backward's weight operand depends on ``precision.fp8_backward``: the dequantized copy in the
compute dtype for the straight-through BF16 backward; for the FP8 dgrad (``Q(dy) @ Q(w)``, which
multiplies by the e4m3 weight itself) the e4m3 bytes of ``w^T`` made row-major for ``F.scaled_mm``
(key ``"e4m3_t"``, backend ``torch``) or the FP32 dequantized copy (backend ``emulate``).

This is what megatron's ``is_first_microbatch`` does for Transformer Engine's FP8 weight caches.
megatron's schedules drive that flag only when ``config.fp8`` is set, which this project leaves
unset (there is no Transformer Engine), so :class:`recipes.train.cuda_graph.ForwardBackward` opens the
scope around each step's forward-backward instead. A captured CUDA graph replays what the capture
did: quantize in the first micro-batch, reuse in the others.

A kept weight is checked against the parameter's version counter at every use: a weight changed in
place inside the scope is quantized again. Memory, per element of an FP8 weight: the e4m3 copy
(1 byte), which every micro-batch holds from its forward to its backward anyway, so keeping it
for the step adds nothing to the peak; the kept backward operand, held from the step's first
backward to its end, adds its size to the peak: 2 bytes for the dequantized bf16 copy (BF16
backward), 1 byte for the transposed e4m3 copy (FP8 backward on ``torch``; without the cache each
FP8 dgrad makes that 1-byte copy and frees it), 4 for the FP32 copy of ``emulate``
(``train.fp8_weight_cache`` chooses, :class:`recipes.train.cuda_graph.ForwardBackward` applies it).

Layouts: whatever the caller quantizes (``w [N, K]`` for a linear, ``[E * N, K]`` for stacked
experts); the scales are those of :func:`kpool_layers.precision.fp8.quantize` for that layout.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional

import torch

_Key = tuple[int, str, str]


@dataclasses.dataclass
class _Scope:
    weights: dict[_Key, "QuantizedWeight"]
    """The step's weights by (parameter id, recipe, scale format)."""
    keep_dequantized: bool


_scope: Optional[_Scope] = None
"""The open scope; None outside one."""


@dataclasses.dataclass(eq=False)
class QuantizedWeight:
    """A weight's e4m3 values ``q`` and ``scale`` (:func:`kpool_layers.precision.fp8.quantize`'s); kept for
    the step when ``source`` is set, with the backward operands derived from it when those are kept."""

    q: torch.Tensor
    scale: torch.Tensor
    source: Optional[torch.Tensor] = None
    """The parameter it was quantized from (referenced: its id stays unique while the scope lives)."""
    version: int = -1
    """``source._version`` at quantization."""
    derived: Optional[dict[Hashable, torch.Tensor]] = None
    """The backward operands derived from ``q`` (:func:`derived_weight`: dequantized copies by dtype,
    ``"e4m3_t"`` the transposed e4m3 bytes); None: not kept."""


@contextmanager
def step_scope(keep_dequantized: bool = False) -> Iterator[None]:
    """Keep quantized weights for the duration of one training step, and with
    ``keep_dequantized`` the backward operands derived from them (module docstring)."""
    global _scope
    _scope = _Scope({}, keep_dequantized)
    try:
        yield
    finally:
        _scope = None


def quantized_weight(
    weight: torch.Tensor, recipe: str, scale_format: str,
    quantize: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> QuantizedWeight:
    """``weight`` quantized by ``quantize()`` under ``recipe`` and ``scale_format``: taken from the
    open scope when this parameter, unchanged since, was quantized there, else quantized (and kept
    if a scope is open and ``weight`` is a parameter)."""
    if _scope is None or not isinstance(weight, torch.nn.Parameter):
        return QuantizedWeight(*quantize())
    key = (id(weight), recipe, scale_format)
    kept = _scope.weights.get(key)
    if kept is None or kept.version != weight._version:
        kept = QuantizedWeight(*quantize(), source=weight, version=weight._version,
                               derived={} if _scope.keep_dequantized else None)
        _scope.weights[key] = kept
    return kept


def derived_weight(
    weight: Optional[QuantizedWeight], key: Hashable, derive: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """A backward operand ``derive()`` of a quantized weight, named ``key`` (a dtype for a
    dequantized copy in that dtype, ``"e4m3_t"`` for the transposed e4m3 bytes): once per scope
    where ``weight`` keeps its derived operands, every time for a weight that does not (or None)."""
    if weight is None or weight.derived is None:
        return derive()
    if key not in weight.derived:
        weight.derived[key] = derive()
    return weight.derived[key]
