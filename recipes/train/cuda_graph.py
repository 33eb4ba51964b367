"""The training step's forward-backward, optionally replayed as one CUDA graph
(``train.cuda_graph_impl=full_iteration``; issue #12: the glm5_proxy step is host-bound).

megatron-core's ``FullCudaGraphWrapper`` runs megatron's forward-backward function (all
micro-batches, the gradients' reduction included; not the optimizer) eagerly for
``train.cuda_graph_warmup_steps`` steps, captures the next one and replays the capture from then on:
one graph launch per step instead of thousands of kernel launches. Each step's micro-batches are
copied into static CUDA buffers first (its ``StaticBufferLoader``); the losses it returns are the
capture's output tensors, rewritten by every replay. The model-parallel RNG streams are graph-safe
generators then (:func:`recipes.launch.distributed.init_model_parallel`), registered with the graph.

A replay runs no Python: a step whose forward records something on the host, or reads a
device value on the host, cannot be replayed. :func:`recipes.config.rules._validate_cuda_graph` refuses the
known cases before the build; a capture that fails anyway raises :class:`CaptureError` naming the
key. The whole run (the build included) goes on megatron's capture stream
(:func:`capture_stream`). Steps that must run Python (the top-k drift measurement's hooks) run eagerly with
``eager=True``; their activations then come from the caching allocator beside the graph's pool.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, Callable

import torch

from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader, get_shared_capture_stream
from megatron.core.pipeline_parallel import get_forward_backward_func

from kpool_layers.precision import weight_cache
from recipes.config.schema import ConfigError, CudaGraphImpl, FP8WeightCache, TrainConfig


class CaptureError(ConfigError):
    """The step could not be captured as a CUDA graph (reported as a config error: the key and
    the value that works)."""

    def __init__(self, reason: str) -> None:
        super().__init__("train.cuda_graph_impl", CudaGraphImpl.full_iteration.value,
                         f"none for this configuration (its step could not be captured as a CUDA "
                         f"graph: {reason})")


def capture_stream(train: TrainConfig) -> AbstractContextManager:
    """The stream a graphed run builds the model and runs every step on: the one megatron
    captures on. Autograd runs a parameter's gradient accumulation on the stream its node was made
    on (DDP makes them at its build and keeps them); on the default stream that would make the
    capture depend on the legacy stream, which CUDA refuses."""
    if train.cuda_graph_impl is CudaGraphImpl.none:
        return nullcontext()
    return torch.cuda.stream(get_shared_capture_stream())


def weight_cache_scope(choice: FP8WeightCache) -> Callable[[], AbstractContextManager]:
    """The context one step runs in for ``train.fp8_weight_cache``
    (:func:`kpool_layers.precision.weight_cache.step_scope`, or nothing kept)."""
    if choice is FP8WeightCache.none:
        return nullcontext
    return partial(weight_cache.step_scope, keep_dequantized=choice is FP8WeightCache.dequantized)


class ForwardBackward:
    """megatron's forward-backward function as ``train`` configures it: called with megatron's
    keyword arguments; ``eager=True`` runs this step without the graph. Each call is one step,
    whose FP8 weights are quantized once for all its micro-batches as ``train.fp8_weight_cache``
    says (:func:`weight_cache_scope`). :meth:`close` frees the graph and the static input buffers
    (megatron keeps them on its classes, for the process)."""

    def __init__(self, train: TrainConfig) -> None:
        self._eager = get_forward_backward_func()
        self._step_scope = weight_cache_scope(train.fp8_weight_cache)
        self._graphed = None
        self.just_captured = False  # whether the last call captured the graph (and replayed it)
        if train.cuda_graph_impl is CudaGraphImpl.full_iteration:
            self._graphed = FullCudaGraphWrapper(
                self._eager, cuda_graph_warmup_steps=train.cuda_graph_warmup_steps)

    def __call__(self, *, eager: bool = False, **kwargs: Any) -> Any:
        self.just_captured = False
        if self._graphed is None or eager:
            with self._step_scope():
                return self._eager(**kwargs)
        capturing = self._graphed.curr_iter("training") == self._graphed.cuda_graph_warmup_steps
        try:
            with self._step_scope():
                result = self._graphed(**kwargs)
        except RuntimeError as err:
            if not capturing:
                raise
            raise CaptureError(str(err).splitlines()[0] if str(err) else type(err).__name__) from err
        self.just_captured = capturing
        return result

    def close(self) -> None:
        if self._graphed is None:
            return
        self._graphed.reset_cuda_graph()
        StaticBufferLoader.static_buffers = {"training": [], "validation": []}
        self._graphed = None

