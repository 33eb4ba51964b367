"""The output layer and the language-model loss over chunks of the sequence, so that the logits
``[s, b, V / TP]`` never exist whole (``train.loss_chunk_tokens``).

megatron's ``GPTModel`` computes ``logits = output_layer(hidden)`` for the whole sequence, then the
loss; the autograd graph keeps the logits (or the fused loss's gradient buffer of their size) until
the backward. At glm5_proxy's vocabulary (154,880) that is 0.3 MB per token in bf16: 40 GB at 128K
tokens. Here :class:`_ChunkedHeadLoss` runs ``chunk`` tokens at a time: the forward computes each
chunk's logits and loss without autograd and keeps only the hidden states; the backward recomputes
each chunk's logits (one more output-layer GEMM, ``2 s h V / TP`` FLOPs), takes the loss's
gradient through them and the GEMM's, and frees them before the next chunk. The peak is one
chunk's logits (and what the loss keeps of them) instead of the sequence's.

Numerics: every token's logits, loss and logit gradient are computed by the same ops as without
chunks (``hidden @ W^T``, ``compute_language_model_loss``); the input gradient of a token is the
same product. Only the weight gradient is a sum over chunks, accumulated in FP32 and rounded to
the weight's dtype once (as the GEMM over the whole sequence rounds its FP32 accumulator once);
that accumulator takes ``4 V h / TP`` bytes during the backward.

Tensor parallelism (vocab-parallel output layer, megatron's ``ColumnParallelLinear``): the hidden
states enter as that layer's input does, gathered over the sequence under sequence parallelism
(backward: reduce-scatter), else copied to the TP region (backward: all-reduce of the input
gradient); every rank then holds its vocabulary slice of each chunk's logits and the loss reduces
over TP as without chunks.

Layouts: hidden ``[s, b, h]`` (the whole sequence on this rank after the gather), weight
``[V / TP, h]``, labels ``[b, s]``, loss ``[b, s]`` FP32.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from kpool_layers.loss import FusedLossGPTModel

LossOfLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(labels [b, c], logits [c, b, V / TP]) -> loss [b, c]`` FP32: the model's
``compute_language_model_loss``, with any logit scaling applied before it."""


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                loss_of_logits: LossOfLogits) -> torch.Tensor:
    """``hidden [c, b, h]``, ``weight [V / TP, h]``, ``labels [b, c]`` -> loss ``[b, c]`` FP32."""
    return loss_of_logits(labels, torch.matmul(hidden, weight.t()))


class _ChunkedHeadLoss(torch.autograd.Function):
    """Per-token loss of ``hidden @ weight^T`` in chunks of ``chunk`` tokens (module docstring);
    saves ``hidden`` and ``weight`` only."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk: int, loss_of_logits: LossOfLogits) -> torch.Tensor:
        s = hidden.shape[0]
        loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for start in range(0, s, chunk):
                end = min(start + chunk, s)
                loss[:, start:end] = _chunk_loss(hidden[start:end], weight, labels[:, start:end], loss_of_logits)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk, ctx.loss_of_logits = chunk, loss_of_logits
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.detach().requires_grad_(True)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            with torch.enable_grad():
                h = hidden[start:end].detach().requires_grad_(True)
                loss = _chunk_loss(h, w, labels[:, start:end], ctx.loss_of_logits)
                grad_h, grad_w = torch.autograd.grad(loss, (h, w), grad_loss[:, start:end])
            grad_hidden[start:end] = grad_h
            grad_weight += grad_w
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def chunked_head_loss(hidden: torch.Tensor, output_layer: torch.nn.Module, weight: Optional[torch.Tensor],
                      labels: torch.Tensor, loss_of_logits: LossOfLogits, chunk: int) -> torch.Tensor:
    """Per-token loss ``[b, s]`` FP32 of megatron's vocab-parallel ``output_layer`` (a
    ``ColumnParallelLinear`` without bias whose output stays split over the vocabulary) applied to
    ``hidden`` (its input: ``[s / TP, b, h]`` under sequence parallelism, else ``[s, b, h]``),
    ``chunk`` tokens of the sequence at a time; ``weight``: the shared embedding's in place of the
    layer's own (None: its own)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 tokens, got {chunk}")
    if output_layer.bias is not None or output_layer.gather_output:
        raise ValueError("the chunked loss needs an output layer without bias whose logits stay "
                         "split over the vocabulary (gather_output=False)")
    weight = output_layer.weight if weight is None else weight
    group = output_layer.tp_group
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, group=group)
    elif group is not None and group.size() > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    return _ChunkedHeadLoss.apply(hidden, weight, labels, chunk, loss_of_logits)


class ChunkedLossMixin:
    """Mixed in before megatron's ``GPTModel`` (or a subclass): with labels, outside inference,
    the main head's logits and loss run through :func:`chunked_head_loss` (megatron's
    ``output_processor`` hook of ``GPTModel._postprocess``). ``loss_chunk_tokens``: the chunk
    length in tokens (>= 1). MTP heads are not chunked (``recipes.config.schema`` refuses MTP with it)."""

    def __init__(self, *args: Any, loss_chunk_tokens: int, **kwargs: Any) -> None:
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {loss_chunk_tokens}")
        super().__init__(*args, **kwargs)
        self.loss_chunk_tokens = loss_chunk_tokens

    def _postprocess(self, **kwargs: Any) -> torch.Tensor:
        if (kwargs.get("labels") is not None and kwargs.get("output_processor") is None
                and not InferenceMode.is_active()):
            kwargs["output_processor"] = self._chunked_output
        return super()._postprocess(**kwargs)

    def _chunked_output(self, *, hidden_states: torch.Tensor, output_layer: torch.nn.Module,
                        output_weight: Optional[torch.Tensor], labels: torch.Tensor,
                        runtime_gather_output: Optional[bool] = None, **_: Any) -> torch.Tensor:
        """megatron's ``output_processor`` contract: the loss ``[b, s]`` of the final hidden
        states ``hidden_states``; the other arguments it passes are not needed here."""
        if runtime_gather_output:
            raise ValueError("the chunked loss keeps the logits split over the vocabulary "
                             "(runtime_gather_output must not be set)")

        def loss_of_logits(chunk_labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            return self.compute_language_model_loss(chunk_labels, self._scale_logits(logits))

        return chunked_head_loss(hidden_states, output_layer, output_weight, labels, loss_of_logits,
                                 self.loss_chunk_tokens)


class ChunkedLossGPTModel(ChunkedLossMixin, GPTModel):
    """megatron's ``GPTModel`` (its unfused loss) with the chunked head (:class:`ChunkedLossMixin`)."""


class ChunkedFusedLossGPTModel(ChunkedLossMixin, FusedLossGPTModel):
    """:class:`~kpool_layers.loss.FusedLossGPTModel` (the Triton loss) with the chunked
    head (:class:`ChunkedLossMixin`)."""


def model_class(fused_loss: bool, loss_chunk_tokens: int) -> type[GPTModel]:
    """The ``GPTModel`` class for the loss: fused (Triton) or megatron's, chunked when
    ``loss_chunk_tokens`` > 0 (then built with ``loss_chunk_tokens=`` that value)."""
    if loss_chunk_tokens:
        return ChunkedFusedLossGPTModel if fused_loss else ChunkedLossGPTModel
    return FusedLossGPTModel if fused_loss else GPTModel
