"""Per-GPU memory of every pipeline stage, and whether it fits 80 / 141 / 192 GB GPUs.

Parameters come from the meta-built model, layer by layer, so uneven stages and the embedding
(first stage; also the last with MTP), output layer, final norm and MTP block (last stage) land on
the right stage. Per rank: dense parameters / TP, expert parameters / (EP * expert TP); bf16 (or
fp32) weights, fp32 main gradients (megatron DDP reduces in fp32) and 12 B of Adam state per
parameter (fp32 master, m, v), divided by the data-parallel size with the distributed optimizer.

Activations are an estimate, not a measurement: per token and layer ``34 * h / TP`` bytes
(Korthikanti et al. 2022, "Reducing Activation Recomputation", with sequence parallelism and no
recomputation; sparse attention stores no [s, s] scores; KDA layers and mHC streams:
:func:`_layer_bytes`) plus ``6 * topk * moe_ffn`` bytes of routed
expert intermediates on MoE layers, for the micro batches in flight under 1F1B (``PP - stage``),
plus the last stage's logits (bf16 + fp32 for the loss; with ``train.loss_chunk_tokens`` one
chunk's, plus the gathered bf16 hidden states the chunks are recomputed from and the output
weight gradient's FP32 accumulator). Activation recompute
(``train.recompute_*``) keeps less per layer and rebuilds one unit during backward
(:func:`_recomputed`). Under context parallelism a rank holds
``seq_length / CP`` tokens of every micro batch, and every DSA layer also keeps the whole row's keys it
gathered from the CP ranks for backward: the latent KV (``kv_lora_rank + qk_pos_emb_head_dim``)
and the indexer keys (``dsa_indexer_head_dim``, twice with the KPool gate). A KDA layer gathers
nothing: its all-to-all trades the sequence shard for a head shard, so what it keeps between the
all-to-alls (the whole row for ``H / (TP * CP)`` heads) is as many elements as ``seq_length / CP``
tokens of all ``H / TP`` heads, and :func:`_layer_bytes` per token of this rank's counts it.
A stage fits a GPU if its total is at
most :data:`USABLE` of the memory (CUDA context, NCCL buffers and fragmentation take the rest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from kpool_layers import model_facts
from kpool_layers.precision.policy import DType
from recipes.config.pipeline_layout import stage_layers
from recipes.config.schema import Config, TrainConfig

GPU_SIZES_GB = {"80 GB (A100/H100)": 80, "141 GB (H200)": 141, "192 GB (B200)": 192}
USABLE = 0.9
GIB = 2**30
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass
class StageMemory:
    """One pipeline stage's per-GPU memory (GiB)."""

    stage: int
    layers: int
    weights: float
    grads: float
    optimizer: float
    activations: float  # all of them, including the two parts below
    logits: float = 0.0  # the output layer's logits (and the chunked loss's saved hidden states)
    recompute_working: float = 0.0  # one recompute unit's activations, rebuilt during backward

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def _parameter_groups(model: nn.Module) -> "ParameterGroups":
    """(dense, expert) parameters per decoder layer, and of the embedding / head / MTP parts."""
    layers: dict[int, list[int]] = {}
    parts = {"embedding": [0, 0], "head": [0, 0], "mtp": [0, 0]}
    for name, p in model.named_parameters():
        slot = 1 if ".experts." in name else 0
        match = _LAYER.match(name)
        if match:
            layers.setdefault(int(match[1]), [0, 0])[slot] += p.numel()
        elif name.startswith("embedding."):
            parts["embedding"][slot] += p.numel()
        elif name.startswith("mtp."):
            parts["mtp"][slot] += p.numel()
        else:  # output_layer, decoder.final_layernorm
            parts["head"][slot] += p.numel()
    return [tuple(layers[i]) for i in sorted(layers)], {k: tuple(v) for k, v in parts.items()}


@dataclass(frozen=True)
class RankSizes:
    """The parallel sizes a rank's share of the model depends on, and bytes per weight."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int  # data parallel (dense parameters' optimizer shards)
    edp: int  # expert data parallel (expert parameters' optimizer shards)
    weight_bytes: int
    distributed_optimizer: bool

    @classmethod
    def of(cls, cfg: Config) -> "RankSizes":
        p = cfg.parallelism
        world = p.nodes * p.gpus_per_node
        tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
        etp = p.expert_tensor_parallel_size or tp
        return cls(tp, pp, ep, etp, dp=max(world // (tp * pp * p.context_parallel_size), 1),
                   edp=max(world // (ep * etp * pp), 1),
                   weight_bytes=2 if cfg.precision.dtype is DType.bf16 else 4,
                   distributed_optimizer=p.use_distributed_optimizer)

    @property
    def adam_bytes_dense(self) -> float:
        """fp32 master, m and v (12 B) per dense parameter on one rank."""
        return 12 / (self.dp if self.distributed_optimizer else 1)

    @property
    def adam_bytes_expert(self) -> float:
        return 12 / (self.edp if self.distributed_optimizer else 1)


FP8_UNCOUNTED = ("FP8's quantized copies of weights and saved operands (measured at glm5_width, "
                 "seq 4096: fp8 peaked 12.3 GiB above bf16's)")
"""What the plan leaves out under ``precision.fp8``, printed with it: it counts a run's memory as
bf16's (docs/benchmarks.md, "Long sequences and context parallelism")."""

RECOMPUTE_WORKING_FACTOR = 2
"""A recompute unit's activations exist twice over while it runs its backward: rebuilt, and their
gradients. Measured on glm5_proxy with full recompute (``scripts/bench/activation_memory.py
--peak-sites``): at the peak, one rebuilt layer (17 GiB at 131072 tokens) beside 12 GiB of
gradients in the checkpoint's backward."""


def _recomputed(t: TrainConfig, full: list[float], mlp: list[float], moe: list[bool], layer_input: float,
                streams: int = 0) -> tuple[list[float], float]:
    """Bytes per token each of a stage's layers keeps for backward under ``t``'s recompute
    (``full``: each layer's without recompute; ``mlp``: the part of it the MLP block keeps, routed
    intermediates included; ``moe``: which are MoE layers; ``layer_input``: ``h / TP``, so that a layer's bf16 input is
    ``2 * layer_input`` bytes per token; ``streams``: mHC's N, 0 without, whose N x h streams are a
    layer's input), and the recompute working set per token: the largest unit's activations, which
    exist again while it is recomputed, times :data:`RECOMPUTE_WORKING_FACTOR`.

    Recomputing ``mlp`` (dense layers) or ``moe`` (MoE layers) keeps the MLP's input (2 h) instead
    of its part. ``full`` keeps each unit's input (``uniform``: every ``recompute_num_layers``
    layers one unit; ``block``: the first ``recompute_num_layers`` layers, one unit each).
    ``shared_experts`` is not modelled (the estimate has no separate shared-expert term)."""
    granularity = t.recompute_granularity
    if granularity is None:
        return full, 0.0
    if granularity.value == "selective":
        kept, working = list(full), 0.0
        for i, (part, is_moe) in enumerate(zip(mlp, moe, strict=True)):
            if ("moe" if is_moe else "mlp") in (t.recompute_modules or ()):
                kept[i] = full[i] - part + 2 * layer_input
                working = max(working, part)
        return kept, RECOMPUTE_WORKING_FACTOR * working
    n = t.recompute_num_layers
    if t.recompute_method.value == "uniform":
        units = [range(i, min(i + n, len(full))) for i in range(0, len(full), n)]
    else:
        units = [range(i, i + 1) for i in range(min(n, len(full)))]
    kept = list(full)
    for unit in units:
        for i in unit:
            kept[i] = 2 * layer_input * max(streams, 1) if i == unit[0] else 0.0
    return kept, RECOMPUTE_WORKING_FACTOR * max((sum(full[i] for i in unit) for unit in units), default=0.0)


ParameterGroups = tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]
"""(dense, expert) parameter counts per decoder layer, and of the embedding / head / MTP parts."""


def parameter_groups(model: nn.Module) -> ParameterGroups:
    """The :data:`ParameterGroups` of ``model`` (the full model, meta device): what :func:`plan`
    needs of it, computed once for planning several parallel layouts (:mod:`recipes.plan.fit`)."""
    return _parameter_groups(model)


KDA_CHUNK = 64
"""Tokens per chunk of the KDA delta rule (``kpool_layers.linear_attention.delta_rule``)."""


def _layer_bytes(m: Any, layer_number: int, tp: int) -> float:
    """Activation bytes per token a layer keeps without recompute (routed experts aside):
    Korthikanti's ``34 h / TP``, for an MLA layer plus :func:`_mla_bytes` and, where the layer runs
    its own indexer, the int64 top-k indices (``8 * topk``, on every TP rank); a KDA layer replaces its 15 h of attention by
    ``2 h + 24 W + 4 H D^2 / C`` (``W = H D``): the normalised input, q/k/v before and after the
    conv (bf16), the fp32 log decay, the delta-rule output and the output gate (bf16), the fp32
    gated-norm input, and the fp32 D x D state per chunk of C tokens and head (per token of this
    CP rank's: under CP the conv and the delta rule keep the whole row for ``H / (TP * CP)`` heads,
    the same number of elements). With mHC
    (``hc_mult`` N) each of the layer's two blocks also keeps its input streams, N x h bf16
    (``comb^T @ streams`` and the projection of the flattened streams need them for backward):
    ``4 N h`` more."""
    h = m.hidden_size
    streams = 4 * m.hc_mult * h if m.hc_mult else 0
    pattern = model_facts.LayerPattern.of(m)
    if not pattern.is_linear_attention(layer_number):
        return (34 * h + _mla_bytes(m) + streams) / tp + (8 * m.dsa_indexer_topk if pattern.computes_topk(layer_number) else 0)
    heads, d = m.linear_num_key_heads, m.linear_key_head_dim
    kda = 2 * h + 24 * heads * d + 4 * heads * d * d / KDA_CHUNK
    return (19 * h + kda + streams) / tp


def _mla_bytes(m: Any) -> float:
    """What an absorbed MLA layer keeps beyond Korthikanti's generic attention, per token on all
    TP ranks together: the absorbed query ``n (d_c + d_r)`` and the latent attention output
    ``n d_c`` (bf16; ``n`` heads, ``d_c`` kv_lora_rank, ``d_r`` the rope channels), which the
    sparse-attention backward reads. Measured on glm5_proxy at 32K tokens
    (``scripts/bench/activation_memory.py``, docs/benchmarks.md): 18 and 16 KB per token and layer."""
    return 2 * m.num_attention_heads * (2 * m.kv_lora_rank + m.qk_pos_emb_head_dim)


def layer_activation_bytes(cfg: Config, layer_number: int, moe: bool) -> float:
    """Bytes per token (of this CP rank) decoder layer ``layer_number`` (1-based) keeps for backward
    on one rank without recompute: :func:`_layer_bytes` plus, on an MoE layer (``moe``), the routed
    experts' ``6 * topk * moe_ffn / ETP`` intermediates."""
    return _layer_bytes(cfg.model, layer_number, RankSizes.of(cfg).tp) + (_routed_bytes(cfg) if moe else 0.0)


def _routed_bytes(cfg: Config) -> float:
    """The routed experts' intermediates per token: ``6 * topk * moe_ffn / ETP``."""
    m = cfg.model
    return 6 * m.moe_router_topk * m.moe_ffn_hidden_size / RankSizes.of(cfg).etp


def plan(cfg: Config, model: nn.Module) -> list[StageMemory]:
    """Per-GPU memory of each pipeline stage of ``cfg`` (``model``: the full model, meta device)."""
    return plan_groups(cfg, _parameter_groups(model))


def plan_groups(cfg: Config, groups: ParameterGroups) -> list[StageMemory]:
    """:func:`plan` from the model's :func:`parameter_groups`."""
    m, p, t = cfg.model, cfg.parallelism, cfg.train
    r = RankSizes.of(cfg)
    tp, pp, ep, etp, dp, wbytes = r.tp, r.pp, r.ep, r.etp, r.dp, r.weight_bytes
    opt_dense, opt_expert = r.adam_bytes_dense, r.adam_bytes_expert
    per_layer, parts = groups
    sizes = stage_layers(m.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                         p.num_layers_in_last_pipeline_stage)
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    cp = p.context_parallel_size
    tokens = t.micro_batch_size * cfg.data.seq_length // cp  # this CP rank's
    gathered = 0.0  # bytes per DSA layer and micro batch: the whole row's keys gathered over CP
    if cp > 1:
        index_keys = m.dsa_indexer_head_dim * (2 if m.dsa_indexer_kpool > 1 else 1)
        gathered = (t.micro_batch_size * cfg.data.seq_length * wbytes
                    * (m.kv_lora_rank + m.qk_pos_emb_head_dim + index_keys))
    pattern = model_facts.LayerPattern.of(m)
    stages, start = [], 0
    for stage, count in enumerate(sizes):
        groups = per_layer[start:start + count]
        if stage == 0:
            groups = groups + [parts["embedding"]]
        if stage == pp - 1:
            groups = groups + [parts["head"], parts["mtp"]] + ([parts["embedding"]] if m.mtp_num_layers and pp > 1 else [])
        dense = sum(g[0] for g in groups) / tp
        expert = sum(g[1] for g in groups) / (ep * etp)
        full = [layer_activation_bytes(cfg, start + i + 1, bool(g[1]))
                for i, g in enumerate(per_layer[start:start + count])]
        mlp = [19 * m.hidden_size / tp + (_routed_bytes(cfg) if g[1] else 0.0)
               for g in per_layer[start:start + count]]
        kept, working = _recomputed(t, full, mlp, [bool(g[1]) for g in per_layer[start:start + count]],
                                    m.hidden_size / tp, m.hc_mult or 0)
        in_flight = min(pp - stage, micro_batches)
        dsa_layers = sum(not pattern.is_linear_attention(start + i + 1) for i in range(count))
        activations = (sum(kept) * tokens + dsa_layers * gathered) * in_flight
        logits = 0.0
        if stage == pp - 1:
            chunk = t.loss_chunk_tokens
            # whole: the bf16 logits and their bf16 gradient (the fused loss writes no FP32 copy);
            # chunked: one chunk's logits (bf16 + fp32 for the loss), the gathered hidden states
            # the chunks recompute them from (bf16, the whole row on every TP rank) and the weight
            # gradient's FP32 accumulator with its bf16 result (6 B per output weight)
            logits = (min(chunk * t.micro_batch_size, tokens) * m.vocab_size / tp * 6
                      + 2 * m.hidden_size * tokens + 6 * m.vocab_size / tp * m.hidden_size if chunk
                      else tokens * m.vocab_size / tp * 4)
        # the loss's backward ends before the decoder's begins: the peak holds one of the two
        activations += max(logits, working * tokens)
        stages.append(StageMemory(stage, count, (dense + expert) * wbytes / GIB, (dense + expert) * 4 / GIB,
                                  (dense * opt_dense + expert * opt_expert) / GIB, activations / GIB,
                                  logits / GIB, working * tokens / GIB))
        start += count
    return stages


def report(cfg: Config, model: nn.Module) -> list[str]:
    """Console lines: each stage's memory, the largest, and the verdict per GPU size."""
    p = cfg.parallelism
    stages = plan(cfg, model)
    t = cfg.train
    chunks = f" (loss in chunks of {t.loss_chunk_tokens} tokens)" if t.loss_chunk_tokens else " (whole sequence)"
    recompute = "" if t.recompute_granularity is None else (
        f" ({t.recompute_granularity.value}: " + (", ".join(t.recompute_modules or ())
                                                 if t.recompute_granularity.value == "selective" else
                                                 (f"uniform, units of {t.recompute_num_layers} layers"
                                                  if t.recompute_method.value == "uniform" else
                                                  f"block, first {t.recompute_num_layers} layers")) + ")")
    lines = [f"per-GPU memory by pipeline stage at TP={p.tensor_model_parallel_size} "
             f"PP={p.pipeline_model_parallel_size} EP={p.expert_model_parallel_size} "
             f"CP={p.context_parallel_size} on {p.nodes}x{p.gpus_per_node} GPUs (micro batch "
             f"{cfg.train.micro_batch_size} x seq {cfg.data.seq_length}"
             + (f", {cfg.data.seq_length // p.context_parallel_size} tokens per CP rank"
                if p.context_parallel_size > 1 else "")
             + "; activations estimated, see recipes/plan/memory_plan.py):"]
    for s in stages:
        lines.append(f"  stage {s.stage}: {s.layers} layers | weights {s.weights:.1f} | grads {s.grads:.1f} | "
                     f"optimizer {s.optimizer:.1f} | activations {s.activations:.1f} | total {s.total:.1f} GiB")
        if s.logits or s.recompute_working:
            lines.append(f"    of the activations: logits {s.logits:.1f} GiB{chunks} | "
                         f"recompute working set {s.recompute_working:.1f} GiB{recompute}")
    if cfg.precision.fp8:
        lines.append(f"  not counted: {FP8_UNCOUNTED}")
    worst = max(stages, key=lambda s: s.total)
    verdicts = [f"{name}: {'fits' if fits(worst.total, gb) else 'does not fit'}"
                for name, gb in GPU_SIZES_GB.items()]
    lines.append(f"largest: stage {worst.stage}, {worst.total:.1f} GiB -> " + " | ".join(verdicts))
    return lines


def fits(total_gib: float, gpu_gb: int) -> bool:
    """Whether a stage of ``total_gib`` fits a GPU of ``gpu_gb`` GB (:data:`USABLE` of it)."""
    return total_gib * GIB <= USABLE * gpu_gb * 1e9
