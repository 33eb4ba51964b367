"""What to change when the dry run's plan does not fit: for each GPU size the largest stage does
not fit, the override line of a layout that does, from the same memory plan
(:func:`recipes.plan.memory_plan.plan_groups`).

Candidates vary what the plan depends on: TP (a divisor of the heads, at most 8 and at most the
GPUs of a node), PP (powers of two; under IndexShare with the first / last stage sizes of
:func:`recipes.config.pipeline_layout.suggest_layout` where the even split breaks a rule), CP
(powers of two up to 16 that the sequence splits into), EP (powers of two dividing the experts),
full activation recompute of every layer, and ``train.loss_chunk_tokens``. The configured world
size (``parallelism.nodes`` x ``gpus_per_node``) is tried first, then more nodes (powers of two, 8
GPUs per node when one is configured), up to :data:`MAX_GPUS`. ``train.global_batch_size`` goes
up to the next multiple of micro batch x data-parallel size where a layout needs it. The chosen
candidate per GPU size is the first in this order: fewest GPUs, fewest changed keys, smallest
TP x PP x CP, smallest EP, then smallest largest stage; it must pass every config rule
(:func:`recipes.config.rules.all_problems`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from omegaconf import OmegaConf

from recipes.config import pipeline_layout as pl
from recipes.config.rules import all_problems
from recipes.config.schema import Config, RecomputeGranularity, RecomputeMethod
from recipes.plan.memory_plan import GPU_SIZES_GB, ParameterGroups, fits, plan_groups

MAX_GPUS = 8192
"""The largest world size a suggestion may need."""
LOSS_CHUNK_TOKENS = 4096
"""The ``train.loss_chunk_tokens`` a suggestion tries when the loss is computed whole."""
_KEYS = (  # the order of a suggestion's overrides: (group, field)
    ("parallelism", "nodes"), ("parallelism", "gpus_per_node"),
    ("parallelism", "tensor_model_parallel_size"), ("parallelism", "pipeline_model_parallel_size"),
    ("parallelism", "num_layers_in_first_pipeline_stage"), ("parallelism", "num_layers_in_last_pipeline_stage"),
    ("parallelism", "context_parallel_size"), ("parallelism", "expert_model_parallel_size"),
    ("train", "global_batch_size"), ("train", "recompute_granularity"), ("train", "recompute_method"),
    ("train", "recompute_num_layers"), ("train", "loss_chunk_tokens"),
)


@dataclass(frozen=True)
class Suggestion:
    """A layout that fits ``gpu``: its overrides (``key=value``, ready to paste after the
    command), its largest stage (GiB) and world size."""

    gpu: str
    overrides: tuple[str, ...]
    largest_gib: float
    gpus: int

    def line(self) -> str:
        return (f"  {self.gpu}: {' '.join(self.overrides)}  (largest stage {self.largest_gib:.1f} GiB, "
                f"{self.gpus} GPUs)")


def _powers(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _value(value: Any) -> str:
    if value is None:
        return "null"
    return str(value.value if hasattr(value, "value") else value)


def _overrides(base: Config, cand: Config) -> tuple[str, ...]:
    return tuple(f"{group}.{name}={_value(getattr(getattr(cand, group), name))}" for group, name in _KEYS
                 if getattr(getattr(cand, group), name) != getattr(getattr(base, group), name))


class _Layouts:
    """The (first, last) stage sizes per PP that megatron splits and IndexShare allows (cached)."""

    def __init__(self, cfg: Config) -> None:
        self.m, self.p = cfg.model, cfg.parallelism
        self._cache: dict[int, Optional[tuple[Optional[int], Optional[int]]]] = {}

    def __call__(self, pp: int) -> Optional[tuple[Optional[int], Optional[int]]]:
        if pp not in self._cache:
            p, m = self.p, self.m
            own = ((p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)
                   if pp == p.pipeline_model_parallel_size else (None, None))
            layout = next((x for x in (own, (None, None)) if self._ok(pp, *x)), None)
            if layout is None and pp > 1:
                layout = pl.suggest_layout(m.num_layers, pp, m.dsa_indexer_topk_freq, m.dsa_indexer_skip_topk_offset)
            self._cache[pp] = layout
        return self._cache[pp]

    def _ok(self, pp: int, first: Optional[int], last: Optional[int]) -> bool:
        layers = pl.stage_layers(self.m.num_layers, pp, first, last)
        return layers is not None and (self.m.dsa_indexer_topk_freq == 1 or pl.shares_across_stages(
            layers, self.m.dsa_indexer_topk_freq, self.m.dsa_indexer_skip_topk_offset) is None)


def _worlds(cfg: Config) -> Iterator[tuple[int, int]]:
    """(nodes, gpus per node): the configured machine, then more nodes."""
    p = cfg.parallelism
    yield p.nodes, p.gpus_per_node
    per_node = p.gpus_per_node if p.gpus_per_node > 1 else 8
    for nodes in _powers(MAX_GPUS // per_node):
        if nodes * per_node > p.nodes * p.gpus_per_node:
            yield nodes, per_node


def _candidates(cfg: Config, nodes: int, per_node: int, layouts: _Layouts) -> Iterator[Config]:
    m, p, t, d = cfg.model, cfg.parallelism, cfg.train, cfg.data
    world = nodes * per_node
    experts = m.num_moe_experts or 1
    recomputes = [(t.recompute_granularity, t.recompute_method, t.recompute_num_layers)]
    if t.recompute_granularity is None:
        recomputes.append((RecomputeGranularity.full, RecomputeMethod.uniform, 1))
    chunks = [t.loss_chunk_tokens] + ([LOSS_CHUNK_TOKENS] if not t.loss_chunk_tokens and not m.mtp_num_layers else [])
    for tp in (x for x in (1, 2, 4, 8) if m.num_attention_heads % x == 0 and x <= per_node):
        for pp in (x for x in _powers(m.num_layers) if world % (tp * x) == 0):
            layout = layouts(pp)
            if layout is None:
                continue
            for cp in (x for x in _powers(16) if world % (tp * pp * x) == 0
                       and (x == 1 or d.seq_length % (2 * x * tp) == 0)):
                dp = world // (tp * pp * cp)
                step = t.micro_batch_size * dp
                gbs = t.global_batch_size if t.global_batch_size % step == 0 else \
                    (t.global_batch_size // step + 1) * step
                etp = p.expert_tensor_parallel_size or tp
                for ep in (x for x in _powers(experts) if experts % x == 0 and world % (x * etp * pp) == 0):
                    par = dataclasses.replace(
                        p, nodes=nodes, gpus_per_node=per_node, tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=layout[0],
                        num_layers_in_last_pipeline_stage=layout[1], context_parallel_size=cp,
                        expert_model_parallel_size=ep)
                    for (granularity, method, layers), chunk in ((r, c) for r in recomputes for c in chunks):
                        train = dataclasses.replace(t, global_batch_size=gbs, recompute_granularity=granularity,
                                                    recompute_method=method, recompute_num_layers=layers,
                                                    loss_chunk_tokens=chunk)
                        yield dataclasses.replace(cfg, parallelism=par, train=train)


def _rank(base: Config, cand: Config, largest: float) -> tuple:
    p = cand.parallelism
    return (p.nodes * p.gpus_per_node, len(_overrides(base, cand)),
            p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size,
            p.expert_model_parallel_size, largest)


def _valid(cand: Config) -> bool:
    p = cand.parallelism
    return not all_problems(OmegaConf.structured(cand), p.nodes * p.gpus_per_node)


def suggestions(cfg: Config, groups: ParameterGroups) -> list[Suggestion]:
    """One :class:`Suggestion` per GPU size (:data:`~recipes.plan.memory_plan.GPU_SIZES_GB`) that
    ``cfg``'s largest stage does not fit and some candidate (module doc) fits; none when it fits
    them all. ``groups``: the model's :func:`~recipes.plan.memory_plan.parameter_groups`."""
    current = max(s.total for s in plan_groups(cfg, groups))
    wanted = {name: gb for name, gb in GPU_SIZES_GB.items() if not fits(current, gb)}
    found: dict[str, Suggestion] = {}
    layouts = _Layouts(cfg)
    for nodes, per_node in _worlds(cfg):
        if not wanted:
            break
        fitting: dict[str, list[tuple[tuple, Config, float]]] = {name: [] for name in wanted}
        for cand in _candidates(cfg, nodes, per_node, layouts):
            largest = max(s.total for s in plan_groups(cand, groups))
            for name, gb in wanted.items():
                if fits(largest, gb):
                    fitting[name].append((_rank(cfg, cand, largest), cand, largest))
        for name, ranked in fitting.items():
            best = next(((c, largest) for _, c, largest in sorted(ranked, key=lambda x: x[0]) if _valid(c)), None)
            if best is not None:
                found[name] = Suggestion(name, _overrides(cfg, best[0]), best[1], nodes * per_node)
        wanted = {name: gb for name, gb in wanted.items() if name not in found}
    return [found[name] for name in GPU_SIZES_GB if name in found]


def report(cfg: Config, groups: ParameterGroups) -> list[str]:
    """The dry run's lines after its verdict: a suggestion per GPU size the plan does not fit (or
    that no layout up to :data:`MAX_GPUS` GPUs fits)."""
    current = max(s.total for s in plan_groups(cfg, groups))
    missing = [name for name, gb in GPU_SIZES_GB.items() if not fits(current, gb)]
    if not missing:
        return []
    found = {s.gpu: s for s in suggestions(cfg, groups)}
    lines = ["to fit, add to the command (estimated like the plan above; fewest GPUs, then fewest changes):"]
    for name in missing:
        lines.append(found[name].line() if name in found else f"  {name}: no layout up to {MAX_GPUS} GPUs fits")
    return lines
