"""The mHC stream tensor between pipeline stages: its shape for megatron's schedules.

megatron-core 0.19.2's 1F1B schedule (``forward_backward_pipelining_without_interleaving``) sizes
its send/receive buffers with ``get_tensor_shapes``: ``(seq_length / CP [/ TP under sequence
parallelism], micro_batch_size, hidden_size)``, megatron's ``[s, b, h]``. With ``hc_mult = N`` a
stage hands the next one the residual streams ``[s, b, N, h]``
(:class:`kpool_layers.hyper_connections.layer.HyperConnectedTransformerLayer`), so the schedule
gets megatron's own hook for it, ``adjust_tensor_shapes_fn``, which inserts the stream axis into
every shape. The interleaved (virtual pipeline) schedule has no such hook; this recipe does not
build virtual pipelines.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from megatron.core.utils import get_model_config

Shape = tuple[int, ...]


def stream_shapes(hc_mult: int, recv: list[Shape], send: list[Shape]) -> tuple[list[Shape], list[Shape]]:
    """``adjust_tensor_shapes_fn``: every ``(s, b, h)`` -> ``(s, b, hc_mult, h)``."""
    def adjust(shapes: list[Shape]) -> list[Shape]:
        return [(*shape[:-1], hc_mult, shape[-1]) for shape in shapes]
    return adjust(recv), adjust(send)


def schedule_kwargs(model: list[torch.nn.Module] | torch.nn.Module) -> dict[str, Any]:
    """Extra keyword arguments for megatron's ``get_forward_backward_func()(...)`` for ``model``
    (the model chunks it is given): ``adjust_tensor_shapes_fn`` when the model has mHC streams
    and more than one pipeline stage, else none (the no-pipeline schedule refuses the hook)."""
    chunk = model[0] if isinstance(model, list) else model
    config = get_model_config(chunk)
    hc_mult = config.hc_mult
    if hc_mult is None or config.pipeline_model_parallel_size == 1:
        return {}
    return {"adjust_tensor_shapes_fn": partial(stream_shapes, hc_mult)}
