"""Top-k drift during training: every ``precision.drift.interval`` steps, how far each DSA layer's
training top-k is from the selection under a reference precision (docs/precision.md).

Per measured step (all ranks take part):

1. :meth:`DriftMonitor.arm` before the forward-backward registers a forward hook on every indexer
   that computes its own top-k (this stage's, :func:`drift_indexers`); the hook records the
   indexer's first forward of the step (:class:`Recorded`: its arguments and what its selection
   scored); no attribute is set on the modules.
2. :meth:`DriftMonitor.measure` after the forward-backward and *before* the optimizer step (the
   weights are still those of the forward) removes the hooks; each indexer recomputes the
   selection from the recorded arguments under the reference numerics (:func:`reference_numerics`)
   without grad (``DSAIndexer.recompute``), and :func:`kpool_layers.dsa.drift.topk_drift` /
   :class:`~kpool_layers.dsa.drift.ScoreDrift` (the score metrics, query chunk by query chunk) compare them. Metrics are averaged over
   data-parallel x context-parallel ranks (:func:`~kpool_layers.dsa.drift.reduce_drift_metrics`) and
   gathered over pipeline stages.
3. :meth:`DriftMonitor.log` on the logging rank: ``dsa/<metric>/layer_<N>`` per layer,
   ``dsa/<metric>`` averaged over layers (metrics.jsonl + wandb), a per-layer ``dsa/drift_table``
   wandb Table on the first and every 10th measurement, and a console line.

Layer numbers ``N`` are the decoder's 1-based layer numbers; MTP layers continue after the last
decoder layer (``num_layers + i``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch.utils.hooks import RemovableHandle

from kpool_layers.dsa.drift import ScoreDrift, reduce_drift_metrics, topk_drift
from kpool_layers.dsa.indexer import DSAIndexer, IndexerOutput, ScoredSelection
from kpool_layers.dsa.numerics import IndexerNumerics, indexer_numerics
from kpool_layers.precision.policy import PrecisionPolicy
from recipes.observe.drift_names import METRICS
from recipes.observe.precision_map import profile_policy
from recipes.config.schema import DriftConfig, DriftReference

TABLE_EVERY = 10
"""A per-layer wandb Table on the first and every ``TABLE_EVERY``-th measurement."""



def reference_numerics(reference: DriftReference | str, policy: PrecisionPolicy) -> IndexerNumerics:
    """The indexer numerics of the reference's profile (:attr:`DriftReference.profile`) with the
    run's (``policy``'s) scale format: ``serving`` = ``serving_match`` (the emulated FP8 serving
    indexer), ``bf16`` / ``fp32`` = those profiles (no quantization)."""
    reference_policy = profile_policy(DriftReference(reference).profile)
    return indexer_numerics(dataclasses.replace(reference_policy, scale_format=policy.scale_format))


def logged_layer_number(name: str, layer_number: int, num_layers: int) -> int:
    """The ``N`` of ``layer_N`` metrics for module ``name`` (qualified in the model) built as
    ``layer_number``: MTP layers (numbered from 1 in their block) continue after the decoder."""
    return layer_number + (num_layers if ".mtp." in f".{name}" else 0)


def drift_indexers(model: torch.nn.Module, num_layers: int) -> dict[int, DSAIndexer]:
    """Indexers of ``model`` (this pipeline stage) keyed by layer number (MTP after the decoder)."""
    return {logged_layer_number(name, module.layer_number, num_layers): module
            for name, module in model.named_modules() if isinstance(module, DSAIndexer)}


@dataclasses.dataclass
class Recorded:
    """One indexer forward of a measured step, recorded by :class:`DriftMonitor`'s hook.

    ``arguments``: the forward's arguments by name (``hidden [s_q, b, hidden]``, ``q_latent
    [s_q, b, q_lora_rank]``, ``rotary_fn``, ``cu_seqlens``; see ``DSAIndexer.forward``), tensors
    detached; ``train``: what the forward's selection scored (``ScoredSelection.of`` its output
    under the indexer's training numerics)."""

    arguments: dict[str, Any]
    train: ScoredSelection

    @classmethod
    def of_forward(cls, indexer: DSAIndexer, args: tuple, kwargs: dict[str, Any],
                   output: IndexerOutput) -> Recorded:
        """The record of ``indexer``'s forward called with ``args`` / ``kwargs`` that returned
        ``output`` (a forward hook's arguments)."""
        bound = inspect.signature(indexer.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {name: value.detach() if isinstance(value, torch.Tensor) else value
                     for name, value in bound.arguments.items()}
        return cls(arguments, ScoredSelection.of(output, indexer.numerics))


def layer_drift(indexer: DSAIndexer, recorded: Recorded,
                numerics: IndexerNumerics) -> dict[str, torch.Tensor]:
    """Drift metrics of the indexer's recorded forward against a recomputation under ``numerics``
    (a collective over the CP group: every CP rank calls it for the same layers)."""
    cfg = indexer.config
    ref = ScoredSelection.of(indexer.recompute(numerics, **recorded.arguments), numerics)
    train = recorded.train
    relu, chunk = cfg.dsa_indexer_scoring_relu, cfg.dsa_indexer_query_chunk_size
    with torch.no_grad():
        tail = indexer.kpool - 1 if cfg.dsa_indexer_kpool_always_select_tail else 0
        out = topk_drift(train.topk_indices, ref.topk_indices, kpool=indexer.kpool, tail=tail)
        scores = ScoreDrift(cfg.dsa_indexer_topk // indexer.kpool, train.q.device)
        for row in range(train.topk_indices.shape[0]):
            for train_part, ref_part in zip(train.score_chunks(row, relu, chunk),
                                            ref.score_chunks(row, relu, chunk), strict=True):
                scores.add(train_part, ref_part)
        out.update(scores.result())
    return out


class DriftMonitor:
    """Arms, measures and logs top-k drift for one model (see the module docstring)."""

    def __init__(self, drift_cfg: DriftConfig, model: torch.nn.Module, num_layers: int) -> None:
        """``drift_cfg``: ``precision.drift``; the run's policy is ``model.config.precision``."""
        self.interval = drift_cfg.interval
        self.reference = drift_cfg.reference.value
        self.numerics = reference_numerics(self.reference, model.config.precision)
        self.indexers = drift_indexers(model, num_layers)
        self._hooks: list[RemovableHandle] = []
        self._recorded: dict[int, Recorded] = {}

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is measured."""
        return self.interval > 0 and step % self.interval == 0

    def arm(self) -> None:
        """Hook every indexer to record its first forward until :meth:`measure`."""
        if self._hooks:
            raise RuntimeError("drift monitor armed twice without measure()")
        self._recorded = {}
        self._hooks = [indexer.register_forward_hook(self._recorder(layer), with_kwargs=True)
                       for layer, indexer in self.indexers.items()]

    def _recorder(self, layer: int) -> Callable[[DSAIndexer, tuple, dict, IndexerOutput], None]:
        """The forward hook (``with_kwargs``) of layer ``layer``'s indexer."""
        def record(indexer: DSAIndexer, args: tuple, kwargs: dict[str, Any], output: IndexerOutput) -> None:
            if layer not in self._recorded:
                self._recorded[layer] = Recorded.of_forward(indexer, args, kwargs, output)
        return record

    def _disarm(self) -> dict[int, Recorded]:
        """Remove the hooks; returns (and forgets) the step's records."""
        for handle in self._hooks:
            handle.remove()
        recorded, self._hooks, self._recorded = self._recorded, [], {}
        missing = sorted(set(self.indexers) - set(recorded))
        if missing:
            raise RuntimeError(f"no forward of the indexers of layers {missing} was recorded (arm() first)")
        return recorded

    def measure(self) -> dict[int, dict[str, float]]:
        """Per-layer metrics of the armed step, averaged over DP and CP (each CP rank measures its
        queries) and gathered over PP (every rank gets every layer); removes the hooks. Call
        before the optimizer step."""
        recorded = self._disarm()
        local = {layer: layer_drift(ix, recorded[layer], self.numerics)
                 for layer, ix in sorted(self.indexers.items())}
        flat = {f"{layer}/{k}": v for layer, metrics in local.items() for k, v in metrics.items()}
        if dist.is_initialized():
            flat = reduce_drift_metrics(flat, ps.get_data_parallel_group(with_context_parallel=True))
        per_layer: dict[int, dict[str, float]] = {}
        for key, value in flat.items():
            layer, metric = key.split("/")
            per_layer.setdefault(int(layer), {})[metric] = float(value)
        if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            gathered: list[Optional[dict]] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(gathered, per_layer, group=ps.get_pipeline_model_parallel_group())
            per_layer = {k: v for part in gathered for k, v in (part or {}).items()}
        return dict(sorted(per_layer.items()))

    def log(self, logger: Any, step: int, per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
        """Scalars (per layer + layer means) to ``logger`` (metrics.jsonl, wandb, console) and the
        periodic per-layer table; returns the scalars."""
        scalars: dict[str, float] = {}
        names = [m for m in METRICS if any(m in v for v in per_layer.values())]
        for metric in names:
            values = [v[metric] for v in per_layer.values() if metric in v]
            for layer, v in per_layer.items():
                if metric in v:
                    scalars[f"dsa/{metric}/layer_{layer}"] = v[metric]
            scalars[f"dsa/{metric}"] = sum(values) / len(values)
        worst = min(per_layer, key=lambda layer: per_layer[layer]["topk_overlap"])
        line = (f"drift step {step:>5} vs {self.reference} | topk_overlap {scalars['dsa/topk_overlap']:.4f} "
                f"(min layer {worst}: {per_layer[worst]['topk_overlap']:.4f}) | exact_rows "
                f"{scalars['dsa/topk_exact_rows']:.4f} | boundary_ties {scalars['dsa/boundary_tie_frac']:.4f}"
                f" | score_rel_err {scalars['dsa/score_rel_err']:.2e}")
        if "dsa/pool_overlap" in scalars:
            line += f" | pool_overlap {scalars['dsa/pool_overlap']:.4f}"
        logger.log(step, scalars, console=line)
        if (step // self.interval - 1) % TABLE_EVERY == 0:
            rows = [[layer] + [v.get(m, float("nan")) for m in names] for layer, v in per_layer.items()]
            logger.log_table(step, "dsa/drift_table", ["layer", *names], rows)
        return scalars
