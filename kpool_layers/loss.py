"""The language-model loss over vocab-parallel logits in two Triton kernels
(:mod:`kpool_layers.kernels.cross_entropy_triton`), and the ``GPTModel`` that uses it.

megatron-core 0.19.2's native fused loss (``fused_vocab_parallel_cross_entropy``, without
Transformer Engine) widens the ``[s, b, V]`` logits to FP32, keeps ``exp(x - max)`` in FP32 for the
backward and goes over the vocabulary in several compiled kernels (docs/benchmarks.md,
"Language-model loss", times both). Here the forward reads the
logits once (running maximum and rescaled sum per row) and the backward writes
``(softmax - onehot) * grad`` over the logits, which are all it keeps (in their own dtype).

Math, that of megatron's ``VocabParallelCrossEntropy`` in FP32: with ``m`` the row maximum over the
whole vocabulary and ``S = sum_v exp(x_v - m)`` (each tensor-parallel rank sums its slice against
its own maximum; the partial sums are rescaled to the all-reduced maximum and all-reduced),
``loss = log S - (x_label - m)`` where a rank holds the label, ``log S`` where none does (a label
outside ``[0, V)``), and ``d loss / d x_v = exp(x_v - m - log S) - [v == label]``. The sums run in
another order than megatron's (per lane, then across lanes), so loss and logit gradients differ
from megatron's by FP32 rounding before the gradient is rounded to the logits' dtype (the bounds
are derived in tests/test_cross_entropy_fusion.py).

Layouts: logits ``[s, b, V / TP]`` (this rank's vocabulary slice, as megatron's output layer
gives them), labels ``[b, s]``, loss ``[b, s]`` FP32, as
``LanguageModule.compute_language_model_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel

from kpool_layers.kernel_routes import KernelBackend, Machine, Route, needs_cuda, register
from kpool_layers.kernels import cross_entropy_triton


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``logits [T, V_local]``, ``labels [T]`` int64 -> per-token loss ``[T]`` FP32 (module
    docstring); the backward returns the logit gradient in the logits' own storage."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, tp_group: Any) -> torch.Tensor:
        world = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
        rank = dist.get_rank(tp_group) if world > 1 else 0
        v_local = logits.shape[-1]
        vocab_start = rank * v_local
        row_max, sumexp, target = cross_entropy_triton.row_stats(logits, labels, vocab_start)
        if world > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            partial = torch.stack([sumexp * torch.exp(row_max - global_max), target])
            dist.all_reduce(partial, group=tp_group)
            row_max, (sumexp, target) = global_max, partial
        held = (labels >= 0) & (labels < v_local * world)
        lse = row_max + torch.log(sumexp)
        loss = lse - torch.where(held, target, row_max)
        ctx.save_for_backward(logits, labels, lse)
        ctx.vocab_start = vocab_start
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        grads = cross_entropy_triton.logit_grads(logits, labels, ctx.vocab_start, lse, grad_loss)
        return grads, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group: Any = None
                                 ) -> torch.Tensor:
    """Per-token loss ``[...]`` FP32 of ``logits [..., V / TP]`` (this rank's vocabulary slice,
    tensor-parallel group ``tp_group``; None: the whole vocabulary) against ``labels [...]``
    (module docstring). The logits' storage holds their gradient after the backward: nothing else
    may read them then."""
    lead = labels.shape
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    loss = _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1).long(), tp_group)
    return loss.view(lead)


class FusedLossGPTModel(GPTModel):
    """megatron's ``GPTModel`` whose language-model loss (the main head's and the MTP heads') is
    :func:`vocab_parallel_cross_entropy`; built by ``recipes.train.model`` where
    ``config.cross_entropy_loss_fusion`` (``train.cross_entropy_fusion`` on a GPU)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``labels [b, s]``, ``logits [s, b, V / TP]`` -> loss ``[b, s]`` FP32."""
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()


LOSS = register(Route("loss", (
    KernelBackend("triton", lambda: FusedLossGPTModel, "two Triton kernels over the vocab-parallel logits",
                  declines=(needs_cuda,)),
    KernelBackend("megatron", lambda: GPTModel, "megatron-core's unfused vocab-parallel cross entropy"),
), summary="language-model loss (the GPTModel class that computes it)", config_key="train.cross_entropy_fusion"))
"""``loss``: each backend's ``load`` gives the model class whose loss it computes;
``train.cross_entropy_fusion=false`` asks for ``megatron``."""


def loss_backend(fusion: bool, on_gpu: bool) -> str:
    """The :data:`LOSS` backend for ``train.cross_entropy_fusion`` = ``fusion`` on a machine with
    (``on_gpu``) or without a GPU: ``triton`` exactly when both, recorded in the route."""
    return LOSS.resolve(None if fusion else "megatron", Machine(cuda=on_gpu)).backend
