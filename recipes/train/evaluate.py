"""The validation loss (``train.eval_interval``, ``train.eval_iters``): ``val/loss`` and
``val/ppl`` in the record of the step they follow.

Every ``eval_interval`` steps and after the last step, the model runs forward only, in eval mode
without autograd (megatron's ``get_forward_backward_func()(..., forward_only=True)``, eagerly even
in a CUDA-graphed run), over the same ``eval_iters`` global batches of ``data.split``'s validation
part each time: the curve compares steps on one fixed set. The validation batches come from their
own dataset and iterator, so the training data iterator, and with it resume, is untouched; eval
mode and ``torch.no_grad`` leave no trace in the training state (no dropout RNG drawn, no MoE
expert-bias token counts, no indexer-loss records, no gradients).

The loss is the training loss's token mean (masked tokens excluded) over all the evaluation's
tokens: each micro batch's ``[sum, count]`` from the last pipeline stage's TP-rank-0 ranks, summed
over the world (the data-parallel replicas' batches and CP ranks' tokens), so every rank gets the
same value.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from kpool_layers.hyper_connections import pipeline
from recipes.config.schema import Config
from recipes.observe.metrics import VAL_LOSS as KEY

PPL_KEY = "val/ppl"

ForwardStep = Callable[[Iterator[dict], torch.nn.Module], tuple[torch.Tensor, Callable]]
"""megatron's ``forward_step_func(data_iterator, model)``: the loop's ``forward_step`` bound to
its device and packing."""


class Validator:
    """Computes ``val/loss`` for one run. ``batches()`` returns a fresh iterator over this rank's
    micro batches of the validation set (``eval_iters * num_microbatches`` of them are read);
    ``reduce(reports, device)`` is the loop's global token-mean of megatron's loss reports."""

    def __init__(self, cfg: Config, num_microbatches: int,
                 batches: Callable[[], Iterator[dict]],
                 reduce: Callable[[list[dict], torch.device], float]) -> None:
        self.interval = cfg.train.eval_interval
        self.steps = cfg.train.steps
        self.num_microbatches = cfg.train.eval_iters * num_microbatches
        self.seq_length = cfg.data.seq_length
        self.micro_batch_size = cfg.train.micro_batch_size
        self._batches, self._reduce = batches, reduce

    def due(self, step: int) -> bool:
        """Whether the validation loss is computed after step ``step`` (1-based)."""
        return self.interval > 0 and (step % self.interval == 0 or step == self.steps)

    def loss(self, model: torch.nn.Module, forward_step: ForwardStep, device: torch.device) -> float:
        """The token-mean validation loss of ``model`` (a collective: every rank calls it at the
        same steps); the model is back in training mode afterwards."""
        model.eval()
        try:
            with torch.no_grad():
                reports = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=self._batches(), model=[model],
                    num_microbatches=self.num_microbatches, seq_length=self.seq_length,
                    micro_batch_size=self.micro_batch_size, forward_only=True,
                    **pipeline.schedule_kwargs(model))
        finally:
            model.train()
        return self._reduce(reports, device)

    def scalars(self, step: int, model: torch.nn.Module, forward_step: ForwardStep,
                device: torch.device) -> dict[str, float]:
        """``{val/loss, val/ppl}`` when due after ``step``, else empty (``val/ppl`` is
        ``exp(val/loss)``, inf when that overflows)."""
        if not self.due(step):
            return {}
        loss = self.loss(model, forward_step, device)
        return {KEY: loss, PPL_KEY: _exp(loss)}


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
