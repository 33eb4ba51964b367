"""One training step on rollout rows: the replay inputs of every micro batch and the rollout
metrics (docs/replay.md).

Per step the loop calls :meth:`RolloutStep.begin` (``measure``: a drift step, when the replay
overlaps are measured), :meth:`RolloutStep.prepare` in every forward step (the row's THD
``PackedSeqParams`` carrying the recorded top-k, the routers' target experts),
:meth:`RolloutStep.loss` as the loss function, and :meth:`RolloutStep.end` after the
forward-backward for the step's scalars:

* ``rollout/logprob_abs_diff``: mean over loss tokens with a rollout logprob of
  ``|logp_train - logp_rollout|`` (slime's ``train_rollout_logprob_abs_diff``), and its max
  ``rollout/logprob_abs_diff_max``;
* ``rollout/kl``: the k3 estimate of KL(rollout || train) over the same tokens (sampled by the
  rollout), mean of ``exp(d) - 1 - d`` with ``d = logp_train - logp_rollout`` (>= 0);
* on measured steps (the drift interval), for the selections the records hold, with or without
  replay: ``dsa/replay_topk_overlap/layer_<L>`` (the share of recorded keys the indexer's own
  top-k also selects) and ``moe/replay_expert_overlap/layer_<L>`` (the share of recorded experts
  the router would also choose), and their means over layers: where the gap comes from.

Parallelism (:mod:`recipes.replay.parallel`): every rank reads the whole packed row and hands its
layers their part: the top-k of its CP query rows (replicated over TP), the experts of the tokens
its routers see (CP rows, then the SP slice), for the layers of its pipeline stage. The sums are
over micro batches and all ranks: TP ranks repeat the same terms (ratios and maxima unchanged),
CP and SP ranks add their own tokens, pipeline stages their own layers (the overlap tensors are
laid out over the whole model's layers, so every rank reduces the same shape); the loss terms
come from the last stage only.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from kpool_layers.dsa.replay import TopKReplay
from recipes.config.megatron import sequence_parallel
from recipes.replay.dataset import model_layers, packed_seq_params_from_starts
from recipes.replay.parallel import RankSlice, stage_topk_layers
from recipes.replay.records import EXPERTS_PREFIX, TOPK_PREFIX
from recipes.replay.routing import ExpertOverlap, routers, set_targets
from recipes.config.schema import Config, DataKind

LOGPROB_KEY = "rollout logprob"
"""Report entry of a micro batch: float64 ``[|d| sum, |d| max, k3 sum, tokens]``."""


def _layer_tensors(batch: dict[str, torch.Tensor], prefix: str) -> dict[int, torch.Tensor]:
    return {int(k[len(prefix):]): v for k, v in batch.items() if k.startswith(prefix)}


class RolloutStep:
    """The replay and metrics of training steps on ``data=rollout`` (module docstring)."""

    def __init__(self, cfg: Config, model: torch.nn.Module) -> None:
        self.dsa = cfg.model.dsa_topk_replay
        self.moe = cfg.model.moe_router_replay
        self.routers = routers(model)
        self.topk_layers = stage_topk_layers(model)
        self.model_layers = model_layers(cfg.model)
        self.rank = RankSlice.current(sequence_parallel(cfg.parallelism))
        self.experts = ExpertOverlap(self.routers)
        self.measure = False
        self.replays: list[TopKReplay] = []
        self.seen: set[str] = set()  # the record families of this step's micro batches

    def begin(self, measure: bool) -> None:
        """Before a step's forward-backward; ``measure``: record the replay overlaps."""
        self.measure = measure
        self.replays = []
        self.seen = set()
        if measure and self.routers:
            self.experts.arm()

    def prepare(self, batch: dict[str, torch.Tensor]) -> PackedSeqParams:
        """The micro batch's (one whole row ``[1, s]``) ``PackedSeqParams``, with this rank's part
        of its replay attached (:mod:`recipes.replay.parallel`)."""
        packed = packed_seq_params_from_starts(batch["sample_starts"])
        recorded_topk = _layer_tensors(batch, TOPK_PREFIX)
        topk = {layer: self.rank.topk(idx) for layer, idx in recorded_topk.items()
                if layer in self.topk_layers}
        if recorded_topk:
            self.seen.add(TOPK_PREFIX)
        if self.dsa or (self.measure and recorded_topk):
            replay = TopKReplay(topk, measure=self.measure)
            replay.attach(packed)
            self.replays.append(replay)
        recorded_experts = _layer_tensors(batch, EXPERTS_PREFIX)
        experts = {layer: self.rank.router_tokens(idx.reshape(-1, idx.shape[-1]))
                   for layer, idx in recorded_experts.items() if layer in self.routers}
        if recorded_experts:
            self.seen.add(EXPERTS_PREFIX)
        if self.moe:
            set_targets(self.routers, experts)
        if self.measure and experts:
            self.experts.set_batch(experts, self.rank.router_tokens(batch["sample_tokens"].reshape(-1)))
        return packed

    @staticmethod
    def loss(base: Callable[[torch.Tensor, torch.Tensor], tuple], batch: dict[str, torch.Tensor],
             output: torch.Tensor) -> tuple:
        """``base(loss_mask, output)`` (the loop's loss) plus :data:`LOGPROB_KEY` in its report;
        ``output``: the per-token loss ``[1, s]`` (``-logp_train`` of each label)."""
        loss_sum, tokens, report = base(batch["loss_mask"], output)
        mask = (batch["loss_mask"] > 0) & batch["has_rollout_logprobs"]
        d = (-output.detach().double() - batch["rollout_logprobs"].double())[mask]
        absd = d.abs()
        report[LOGPROB_KEY] = torch.stack([
            absd.sum(), absd.max() if d.numel() else d.new_zeros(()),
            (torch.expm1(d) - d).sum(), d.new_tensor(float(d.numel()))])
        return loss_sum, tokens, report

    def end(self, reports: list[dict], device: torch.device) -> dict[str, float]:
        """The step's scalars (module docstring; collective over the world)."""
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        peak = torch.zeros(1, dtype=torch.float64, device=device)
        for r in reports:
            v = r[LOGPROB_KEY].to(device)
            sums += v[[0, 2, 3]]
            peak = torch.maximum(peak, v[1:2])
        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        scalars: dict[str, float] = {}
        if sums[2] > 0:
            scalars = {"rollout/logprob_abs_diff": float(sums[0] / sums[2]),
                       "rollout/logprob_abs_diff_max": float(peak[0]),
                       "rollout/kl": float(sums[1] / sums[2])}
        if self.measure:
            if self.routers:
                self.experts.disarm()
            if TOPK_PREFIX in self.seen:
                scalars.update(self._overlaps("dsa/replay_topk_overlap", self.model_layers.topk_layers,
                                              self._topk_counts(), device))
            if EXPERTS_PREFIX in self.seen:
                scalars.update(self._overlaps(
                    "moe/replay_expert_overlap", self.model_layers.moe_layers,
                    {layer: (self.experts.hits[layer], self.experts.counts[layer])
                     for layer in self.experts.hits}, device))
        return scalars

    def _topk_counts(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for replay in self.replays:
            for layer, (hits, n) in replay.overlaps().items():
                h0, n0 = counts.get(layer, (0, 0))
                counts[layer] = (h0 + hits, n0 + n)
        return counts

    @staticmethod
    def _overlaps(key: str, layers: tuple[int, ...], counts: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  device: torch.device) -> dict[str, float]:
        """Per-layer ``hits / count`` over all ranks for every layer of the model (``layers``;
        ``counts`` holds this rank's stage's, zeros elsewhere), and their mean."""
        if not layers:
            return {}
        zero = (0, 0)
        totals = torch.tensor([[float(counts.get(n, zero)[0]), float(counts.get(n, zero)[1])]
                               for n in layers], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        per_layer = {f"{key}/layer_{n}": float(totals[i, 0] / totals[i, 1].clamp(min=1))
                     for i, n in enumerate(layers)}
        return {**per_layer, key: sum(per_layer.values()) / len(per_layer)}


def rollout_step(cfg: Config, model: torch.nn.Module) -> Optional[RolloutStep]:
    """A :class:`RolloutStep` for ``data=rollout``, else None."""
    return RolloutStep(cfg, model) if cfg.data.kind is DataKind.rollout else None
