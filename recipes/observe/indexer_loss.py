"""The DSA indexer KL loss in the step metrics (``model.dsa_indexer_loss_coeff > 0``).

Every computing layer accumulates its KL (before the coefficient) over the micro batches of a step
(:func:`kpool_layers.mla.attention.collect_indexer_losses`). :meth:`IndexerLossMonitor.collect` reduces
them as the language-model loss is: averaged over data-parallel ranks, gathered over pipeline
stages (TP ranks hold the same value; only TP rank 0 contributes). Logged as
``dsa/indexer_loss`` (mean over computing layers) with every step line and, every
``precision.drift.interval`` steps (never when it is 0), ``dsa/indexer_loss/layer_N`` per layer.
Layer numbers ``N`` are 1-based decoder layers; MTP layers continue after the last one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from kpool_layers.mla.attention import collect_indexer_losses
from recipes.observe.drift import logged_layer_number
from recipes.config.schema import ModelConfig

KEY = "dsa/indexer_loss"


class IndexerLossMonitor:
    """Collects, reduces and names the indexer loss of one model (all ranks call :meth:`collect`)."""

    def __init__(self, model_cfg: ModelConfig, drift_interval: int) -> None:
        self.enabled = bool(model_cfg.dsa_indexer_loss_coeff)
        self.num_layers = model_cfg.num_layers
        self.total_layers = self.num_layers + model_cfg.mtp_num_layers
        self.layer_interval = drift_interval

    def per_layer_due(self, step: int) -> bool:
        """Whether step ``step`` logs ``dsa/indexer_loss/layer_N``."""
        return self.enabled and self.layer_interval > 0 and step % self.layer_interval == 0

    def collect(self, model: torch.nn.Module) -> dict[int, float]:
        """Per-layer KL since the last call, reduced over DP and PP (every rank gets every
        layer); resets the layers' records. A collective: call on every rank at the same steps."""
        local = collect_indexer_losses(model)  # resets the records on every rank
        sums = torch.zeros(2, self.total_layers, dtype=torch.float64)
        if ps.get_tensor_model_parallel_rank() == 0:  # TP ranks hold the same values
            for name, value in local.items():
                number = logged_layer_number(name, model.get_submodule(name).layer_number, self.num_layers)
                sums[:, number - 1] += torch.tensor([value, 1.0], dtype=torch.float64)
        if torch.cuda.is_available():
            sums = sums.cuda()
        dist.all_reduce(sums)
        sums = sums.cpu()
        return {n + 1: float(sums[0, n] / sums[1, n]) for n in range(self.total_layers) if sums[1, n] > 0}

    def step_scalars(self, model: torch.nn.Module, step: int, logged: bool) -> dict[str, float]:
        """The scalars of step ``step`` (``logged``: its step line is written); empty when the
        loss is off or nothing is due. Collects only then, so a logged value averages the steps
        since the last logged one."""
        with_layers = self.per_layer_due(step)
        if not self.enabled or not (logged or with_layers):
            return {}
        return self.scalars(self.collect(model), with_layers)

    @staticmethod
    def scalars(per_layer: dict[int, float], with_layers: bool) -> dict[str, float]:
        """``dsa/indexer_loss`` (mean over layers) and, ``with_layers``, one key per layer."""
        if not per_layer:
            return {}
        out = {KEY: sum(per_layer.values()) / len(per_layer)}
        if with_layers:
            out.update({f"{KEY}/layer_{n}": v for n, v in per_layer.items()})
        return out
