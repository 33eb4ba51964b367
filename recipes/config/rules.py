"""The rules a composed config must satisfy, checked before anything is built.

:func:`validate` raises the first :class:`~recipes.config.schema.ConfigError` (naming the key, the
value and what is allowed); :func:`all_problems` collects every broken rule for the dry run. The
declarations they check (types, defaults, ranges) are :mod:`recipes.config.schema`'s.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.utils import Split
from omegaconf import DictConfig

from kpool_layers import model_facts
from kpool_layers.moe.grouped_gemm import FP8_RECIPES
from kpool_layers.precision.fp8_format import Recipe
from kpool_layers.precision.policy import Fp8Backward, WeightsProjDtype, available_backends
from recipes.config import recompute
from recipes.config.fp8_only import check_fp8_only_keys
from recipes.config.keys import check_config_keys
from recipes.config.schema import (ConfigError, CudaGraphImpl, DataKind, Dispatcher, DriftReference,
                                   ModelConfig, Range, numeric_fields)


_found: ContextVar[Optional[list[ConfigError]]] = ContextVar("_found", default=None)
"""Set by :func:`all_problems`: failed rules are collected here instead of raised."""


def _fail(err: ConfigError) -> None:
    found = _found.get()
    if found is None:
        raise err
    found.append(err)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        _fail(ConfigError(key, value, allowed))


def _divisors_of(n: int) -> str:
    return "a divisor of " + str(n) + " (" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + ")"


def check_ranges(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for a numeric value outside its field's declared :class:`Range`."""
    for key, f in numeric_fields():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        allowed: Range = f.metadata["range"]
        if node is not None and node not in allowed:
            kind = "an integer" if isinstance(f.default, int) else "a finite number"
            raise ConfigError(key, node, f"{kind} in {allowed}")


def _check_world_size(world_size: int, tp: int, pp: int, cp: int) -> None:
    """TP*PP*CP must divide the world size; blames the first factor that makes it not divide."""
    product = 1
    for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                      ("context_parallel_size", cp)):
        product *= size
        if world_size % product:
            _fail(ConfigError(f"parallelism.{key}", size,
                              f"values with TP*PP*CP dividing the world size {world_size} (got TP={tp}, "
                              f"PP={pp}, CP={cp}); launch {tp * pp * cp} ranks, e.g. torchrun "
                              f"--nproc-per-node {tp * pp * cp} train.py ..."))
            return


def validate(cfg: DictConfig, world_size: int) -> None:
    """Checks on the composed config (as Hydra composed it, before
    :func:`recipes.config.typed.to_config`): every key exists in the schema, every number is in
    its field's range, then the cross-field rules.

    Raises :class:`ConfigError` naming the first offending key. Runs before any model is built.
    """
    check_config_keys(cfg)
    check_ranges(cfg)
    _check_rules(cfg, world_size)


def all_problems(cfg: DictConfig, world_size: int) -> list[ConfigError]:
    """Every rule of :func:`validate` that ``cfg`` breaks (a dry run lists them all at once); an
    unknown key or a value out of range is reported alone (the other rules assume sane values)."""
    try:
        check_config_keys(cfg)
        check_ranges(cfg)
    except ConfigError as err:
        return [err]
    token = _found.set([])
    try:
        _check_rules(cfg, world_size)
        return list(_found.get())
    finally:
        _found.reset(token)


def _check_rules(cfg: DictConfig, world_size: int) -> None:
    """The cross-field rules (each failure raised, or collected under :func:`all_problems`)."""
    m, p, t, d = cfg.model, cfg.parallelism, cfg.train, cfg.data
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)
    _require(m.num_attention_heads % tp == 0, "parallelism.tensor_model_parallel_size", tp,
             _divisors_of(m.num_attention_heads) + " = model.num_attention_heads' divisors")
    _check_world_size(world_size, tp, pp, cp)
    if cp > 1:
        _check_context_parallel(m, d, cp, tp if tp > 1 and p.sequence_parallel is not False else 1)
    _check_layer_pattern(m, p, t, d)
    _check_stages(m, p)
    dp = max(world_size // (tp * pp * cp), 1)  # 0 only when the world size check failed
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size",
             t.global_batch_size, f"a multiple of micro_batch_size * data_parallel_size = "
             f"{t.micro_batch_size} * {dp} = {t.micro_batch_size * dp}")
    if p.sequence_parallel:
        _require(tp > 1, "parallelism.sequence_parallel", True, "false or null when TP == 1")
    if m.num_moe_experts is not None:
        _require(m.num_moe_experts % ep == 0, "parallelism.expert_model_parallel_size", ep,
                 _divisors_of(m.num_moe_experts) + " = model.num_moe_experts' divisors")
        _require(1 <= m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk",
                 m.moe_router_topk, f"1..{m.num_moe_experts} (model.num_moe_experts)")
        _require(0 <= m.moe_first_k_dense_layers <= m.num_layers, "model.moe_first_k_dense_layers",
                 m.moe_first_k_dense_layers, f"0..{m.num_layers} (model.num_layers)")
        if tp > 1 and p.sequence_parallel is False:
            _fail(ConfigError("parallelism.sequence_parallel", False,
                              "true or null: megatron's MoE with TP > 1 requires sequence parallelism"))
        _require(m.moe_token_dispatcher_type != Dispatcher.alltoall or t.dry_run or torch.cuda.is_available(),
                 "model.moe_token_dispatcher_type", "alltoall",
                 "allgather on a machine without CUDA (megatron's alltoall dispatcher creates CUDA streams)")
    else:
        _require(ep == 1, "parallelism.expert_model_parallel_size", ep, "1 when model.num_moe_experts is null")
    _require(world_size % (ep * (p.expert_tensor_parallel_size or tp) * pp) == 0,
             "parallelism.expert_model_parallel_size", ep,
             f"values with EP * expert TP * PP dividing the world size {world_size}")
    kpool_problem = model_facts.kpool_problem(m.dsa_indexer_kpool, m.dsa_indexer_topk)
    if kpool_problem is not None:
        key, value, allowed = kpool_problem
        _fail(ConfigError(f"model.{key}", value, allowed))
    _require(m.dsa_indexer_head_dim & (m.dsa_indexer_head_dim - 1) == 0 or not m.dsa_indexer_rotate_activation,
             "model.dsa_indexer_head_dim", m.dsa_indexer_head_dim,
             "a power of two when model.dsa_indexer_rotate_activation (Hadamard) is on")
    _require(m.qk_pos_emb_head_dim % 2 == 0, "model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim,
             "an even number (0 = NoPE)")
    _require(m.qk_pos_emb_head_dim <= m.dsa_indexer_head_dim, "model.qk_pos_emb_head_dim",
             m.qk_pos_emb_head_dim, f"<= model.dsa_indexer_head_dim={m.dsa_indexer_head_dim}")
    _require(d.seq_length <= m.max_position_embeddings, "data.seq_length", d.seq_length,
             f"<= model.max_position_embeddings={m.max_position_embeddings}")
    if d.reset_attention_mask:
        _require(t.micro_batch_size == 1, "train.micro_batch_size", t.micro_batch_size,
                 "1 when data.reset_attention_mask=true (packed documents run as one THD row)")
    if d.kind == DataKind.indexed:
        _require(len(d.paths) > 0, "data.paths", list(d.paths),
                 "a non-empty list of dataset prefixes (optionally weighted) when data.kind=indexed")
        _require(d.tokenizer is not None, "data.tokenizer", None,
                 "a local Hugging Face tokenizer path when data.kind=indexed")
    _check_rollout(m, d, t)
    _check_hyper_connections(m)
    _check_validation(d, t)
    _require(t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"0..train.lr={t.lr}")
    _require(t.lr_warmup_steps < t.steps, "train.lr_warmup_steps", t.lr_warmup_steps,
             f"0..{t.steps - 1} (less than train.steps)")
    _validate_precision(cfg)
    _validate_kernels(cfg)
    _validate_linear_attention_kernels(cfg)
    _validate_cuda_graph(cfg)
    for key, value, allowed in recompute.problems(t, m.num_layers, pp, m.num_moe_experts,
                                                  m.moe_first_k_dense_layers, m.mtp_num_layers):
        _fail(ConfigError(key, value, allowed))


def _plain_list(value: Any) -> Any:
    """A ListConfig as a list (other values unchanged)."""
    from omegaconf import ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value


def _check_layer_pattern(m: DictConfig, p: DictConfig, t: DictConfig, d: DictConfig) -> None:
    """Hybrid KDA/DSA models (``model.linear_attention_freq``) and per-layer indexer types
    (``model.dsa_indexer_types``): valid patterns, KDA sizes the layer supports (its heads split over
    TP and, by the context-parallel all-to-all, over TP * CP), and the features that do not work with
    KDA layers."""
    freq = _plain_list(m.linear_attention_freq)
    problem = model_facts.linear_attention_problem(m.num_layers, freq)
    if problem is not None:
        _fail(ConfigError("model.linear_attention_freq", freq, problem))
        return
    types = _plain_list(m.dsa_indexer_types)
    pattern = model_facts.LayerPattern(m.num_layers, m.dsa_indexer_topk_freq, m.dsa_indexer_skip_topk_offset,
                                       None if types is None else tuple(types), freq)
    problem = pattern.indexer_types_problem()
    if problem is not None:
        _fail(ConfigError("model.dsa_indexer_types", types, problem))
        return
    if types is not None:
        _require(m.dsa_indexer_topk_freq == 1, "model.dsa_indexer_topk_freq", m.dsa_indexer_topk_freq,
                 "1 when model.dsa_indexer_types is set (the types list is the share pattern)")
    if not pattern.hybrid:
        return
    with_kda = "with KDA layers (model.linear_attention_freq)"
    _require(m.dsa_indexer_topk_freq == 1, "model.dsa_indexer_topk_freq", m.dsa_indexer_topk_freq,
             f"1 {with_kda}; set the share pattern per layer with model.dsa_indexer_types")
    _require(m.linear_num_value_heads == m.linear_num_key_heads, "model.linear_num_value_heads",
             m.linear_num_value_heads, f"model.linear_num_key_heads={m.linear_num_key_heads} (KDA has one head count)")
    _require(m.linear_value_head_dim == m.linear_key_head_dim, "model.linear_value_head_dim",
             m.linear_value_head_dim, f"model.linear_key_head_dim={m.linear_key_head_dim} (KDA has one head size)")
    tp = p.tensor_model_parallel_size
    for key in ("linear_num_key_heads", "linear_key_head_dim"):
        _require(m[key] % tp == 0, "parallelism.tensor_model_parallel_size", tp,
                 _divisors_of(m[key]) + f" = model.{key}'s divisors (KDA splits its heads and the "
                 "rank-D gate projections over TP)")
    cp, heads = p.context_parallel_size, m.linear_num_key_heads
    if heads % tp == 0:  # else the TP rule above has named the problem
        allowed = [c for c in range(1, heads // tp + 1) if (heads // tp) % c == 0]
        _require(heads % (tp * cp) == 0, "parallelism.context_parallel_size", cp,
                 f"one of {allowed} {with_kda} at tensor_model_parallel_size={tp}: KDA's all-to-all "
                 f"splits model.linear_num_key_heads={heads} over TP * CP")
    _require(not m.mtp_num_layers, "model.mtp_num_layers", m.mtp_num_layers,
             f"0 {with_kda} (transformers' glm5_next has no MTP layer)")


def _check_rollout(m: DictConfig, d: DictConfig, t: DictConfig) -> None:
    """Rollout data and the replay switches (docs/replay.md)."""
    rollout = d.kind == DataKind.rollout
    for key in ("dsa_topk_replay", "moe_router_replay"):
        _require(rollout or not m[key], f"model.{key}", True,
                 "false unless data=rollout (replay needs rollout records: data.rollout_dir)")
    _require(m.num_moe_experts is not None or not m.moe_router_replay, "model.moe_router_replay",
             True, "false for a model without experts (model.num_moe_experts=null)")
    if not rollout:
        return
    _require(d.rollout_dir is not None, "data.rollout_dir", None,
             "a directory of rollout records when data.kind=rollout")
    _require(not m.mtp_num_layers, "model.mtp_num_layers", m.mtp_num_layers,
             "0 with data=rollout (records hold no MTP layer's top-k or routing: a serving engine runs "
             "MTP only as a speculative draft, on other inputs)")
    _require(t.micro_batch_size == 1, "train.micro_batch_size", t.micro_batch_size,
             "1 with data=rollout (each micro batch is one packed THD row)")


def _check_hyper_connections(m: DictConfig) -> None:
    """``model.hc_mult`` (mHC streams): no MTP layers with them (neither transformers' glm5_next
    nor megatron defines MTP on streams); the other ``hc_*`` keys only with it (they would do
    nothing)."""
    if m.hc_mult is None:
        for key in ("hc_sinkhorn_iters", "hc_eps"):
            default = getattr(ModelConfig, key)
            _require(m[key] == default, f"model.{key}", m[key],
                     f"{default} (the default) unless model.hc_mult is set: without hyper-connections "
                     "it does nothing")
        return
    _require(not m.mtp_num_layers, "model.mtp_num_layers", m.mtp_num_layers,
             f"0 with model.hc_mult={m.hc_mult} (MTP layers on mHC streams are not built: "
             "transformers' glm5_next has no MTP layers)")


def _check_validation(d: DictConfig, t: DictConfig) -> None:
    """``train.eval_interval > 0``: data with a validation split (not rollout records; for indexed
    data a ``data.split`` whose validation part is not zero)."""
    if not t.eval_interval:
        return
    _require(d.kind != DataKind.rollout, "train.eval_interval", t.eval_interval,
             "0 with data=rollout (rollout records have no validation split)")
    if d.kind != DataKind.indexed:
        return
    try:
        valid = parse_and_normalize_split(str(d.split))[Split.valid.value]
    except (ValueError, AssertionError, ZeroDivisionError):
        valid = 0.0
    _require(valid > 0, "data.split", d.split,
             "train/validation/test weights with a non-zero validation part (e.g. 969,30,1) when "
             f"train.eval_interval={t.eval_interval} > 0; or train.eval_interval=0")


def _check_context_parallel(m: DictConfig, d: DictConfig, cp: int, sp: int) -> None:
    """CP > 1: the row splits into 2 * CP equal chunks (megatron's load-balanced split), each CP
    rank's slice into ``sp`` (the TP size under sequence parallelism, else 1) equal parts; MTP's
    packed-document roll assumes megatron's per-document split, which ours (per row) is not."""
    _require(d.seq_length % (2 * cp * sp) == 0, "data.seq_length", d.seq_length,
             "a multiple of 2 * parallelism.context_parallel_size"
             + (" * tensor_model_parallel_size (sequence parallel)" if sp > 1 else "")
             + f" = {2 * cp * sp} (each CP rank holds 2 of {2 * cp} equal chunks)")
    if m.mtp_num_layers and d.reset_attention_mask:
        _fail(ConfigError("parallelism.context_parallel_size", cp,
                          "1 when model.mtp_num_layers > 0 and data.reset_attention_mask=true "
                          "(megatron's MTP rolls packed documents only in its per-document CP "
                          "split); set model.mtp_num_layers=0 or data.reset_attention_mask=false"))


def _validate_kernels(cfg: DictConfig) -> None:
    """``model.dsa_kernels``: resolvable, runnable here (unless a dry run plans for another
    machine), supported for the model's shapes and deterministic under ``train.deterministic``."""
    from kpool_layers.dsa import backends as dsa_kernels

    m = cfg.model
    requested = m.dsa_kernels.value
    on_device = not cfg.train.dry_run
    backend = dsa_kernels.resolve(requested, on_device=None if on_device else False)
    shapes = dsa_kernels.KernelShapes(
        dtype=cfg.precision.dtype.torch_dtype,
        kv_lora_rank=m.kv_lora_rank, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        dsa_indexer_head_dim=m.dsa_indexer_head_dim)
    try:
        dsa_kernels.check_backend(backend, shapes, deterministic=cfg.train.deterministic,
                                  on_device=on_device)
    except dsa_kernels.KernelUnavailable as err:
        shown = requested if requested == backend else f"{requested} (= {backend} here)"
        _fail(ConfigError("model.dsa_kernels", shown, f"{list(dsa_kernels.BACKENDS)}; {err}"))


def _validate_linear_attention_kernels(cfg: DictConfig) -> None:
    """``model.linear_attention_kernels``: resolvable and runnable here (unless a dry run)."""
    from kpool_layers.linear_attention import backends

    requested = cfg.model.linear_attention_kernels.value
    on_device = not cfg.train.dry_run
    backend = backends.resolve(requested, on_device=None if on_device else False)
    try:
        backends.check_backend(backend, on_device=on_device)
    except backends.KernelUnavailable as err:
        shown = requested if requested == backend else f"{requested} (= {backend} here)"
        _fail(ConfigError(backends.KEY, shown, f"{list(backends.BACKENDS)}; {err}"))


def _validate_cuda_graph(cfg: DictConfig) -> None:
    """``train.cuda_graph_impl=full_iteration``: a CUDA machine (unless a dry run), and a step
    without host synchronisations or per-forward host bookkeeping, which a replay would skip."""
    m, p, t, d, pr = cfg.model, cfg.parallelism, cfg.train, cfg.data, cfg.precision
    if t.cuda_graph_impl is not CudaGraphImpl.full_iteration:
        return
    with_graphs = "with train.cuda_graph_impl=full_iteration"
    _require(t.dry_run or torch.cuda.is_available(), "train.cuda_graph_impl", t.cuda_graph_impl.value,
             "none on a machine without CUDA")
    _require(p.pipeline_model_parallel_size == 1, "parallelism.pipeline_model_parallel_size",
             p.pipeline_model_parallel_size, f"1 {with_graphs}")
    _require(p.context_parallel_size == 1, "parallelism.context_parallel_size", p.context_parallel_size,
             f"1 {with_graphs}")
    _require(not d.reset_attention_mask, "data.reset_attention_mask", True,
             f"false {with_graphs} (packed documents' boundaries are found on the host each batch)")
    _require(not m.dsa_indexer_loss_coeff, "model.dsa_indexer_loss_coeff", m.dsa_indexer_loss_coeff,
             f"0 {with_graphs} (its logging records each forward on the host)")
    if m.num_moe_experts is None:
        return
    host_counts = "megatron's dispatcher reads the tokens per expert on the host"
    _require(m.moe_token_dispatcher_type == Dispatcher.allgather, "model.moe_token_dispatcher_type",
             m.moe_token_dispatcher_type.value, f"allgather {with_graphs} ({host_counts} otherwise)")
    for key in ("tensor_model_parallel_size", "expert_model_parallel_size"):
        _require(p[key] == 1, f"parallelism.{key}", p[key], f"1 for MoE models {with_graphs} ({host_counts})")
    _require(m.moe_grouped_gemm is not False, "model.moe_grouped_gemm", False,
             f"true or null {with_graphs} (per-expert linears split the tokens on the host)")
    _require(not (pr.fp8 and pr.recipe not in FP8_RECIPES), "precision.recipe", pr.recipe.value,
             f"one of {[r.value for r in FP8_RECIPES]} for MoE models {with_graphs} (the others run "
             f"per-expert linears, which split the tokens on the host)")


def _validate_precision(cfg: DictConfig) -> None:
    """``precision.*`` rules: FP8-only keys only with FP8, backend available here, FP8 layer shapes, serving-quantized index
    inputs only for power-of-two indexer heads <= 128, drift settings."""
    pr, m = cfg.precision, cfg.model
    for err in check_fp8_only_keys(pr):  # e.g. precision=bf16 precision.recipe=tensorwise
        _fail(err)
    backend = pr.backend.value
    if pr.fp8:
        if not cfg.train.dry_run:  # a dry run plans for another machine
            usable = [b.value for b in available_backends()]
            _require(backend == "auto" or backend in usable, "precision.backend", backend,
                     f"auto or one available here: {usable}")
        _require(not (m.num_moe_experts and m.moe_grouped_gemm and pr.recipe not in FP8_RECIPES),
                 "model.moe_grouped_gemm", True,
                 f"false with precision.fp8=true and precision.recipe={pr.recipe.value} (grouped FP8 experts "
                 f"run precision.recipe in {[r.value for r in FP8_RECIPES]})")
    _require(not (pr.fp8 and pr.fp8_backward is Fp8Backward.fp8 and pr.recipe is not Recipe.blockwise),
             "precision.fp8_backward", pr.fp8_backward.value,
             f"['bf16'] with precision.recipe={pr.recipe.value} (['bf16', 'fp8'] with "
             "precision.recipe=blockwise: the FP8 dgrad/wgrad GEMMs are blockwise)")
    if (pr.fp8 and pr.dsa_indexer_weights_proj_dtype is WeightsProjDtype.fp32
            and not pr.dsa_indexer_weights_proj_disable_quantization):
        _fail(ConfigError("precision.dsa_indexer_weights_proj_disable_quantization", False,
                          "true when precision.dsa_indexer_weights_proj_dtype=fp32 and precision.fp8=true "
                          "(an FP32 projection cannot also be an FP8 GEMM)"))
    interval = pr.drift.interval
    serving_ref = interval > 0 and pr.drift.reference is DriftReference.serving
    if pr.dsa_indexer_kpool_use_quantization or serving_ref:
        d = m.dsa_indexer_head_dim
        key = ("precision.dsa_indexer_kpool_use_quantization=true" if pr.dsa_indexer_kpool_use_quantization
               else "precision.drift.reference=serving")
        _require(d <= 128 and d & (d - 1) == 0, "model.dsa_indexer_head_dim", d,
                 f"a power of two <= 128 (128 on served models) with {key}: the serving index path "
                 "quantizes one Hadamard-rotated head_dim vector per scale")


def _check_stages(m: DictConfig, p: DictConfig) -> None:
    """Pipeline stages: megatron can split the layers that way, and under IndexShare every stage
    starts on a top-k computing layer (see :mod:`recipes.config.pipeline_layout`)."""
    from recipes.config import pipeline_layout as pl

    pp, first, last = (p.pipeline_model_parallel_size, p.num_layers_in_first_pipeline_stage,
                       p.num_layers_in_last_pipeline_stage)
    freq, offset = m.dsa_indexer_topk_freq, m.dsa_indexer_skip_topk_offset
    layers = pl.stage_layers(m.num_layers, pp, first, last)
    fix = pl.suggest_layout(m.num_layers, pp, freq, offset) if pp > 1 else None
    hint = (f"; e.g. parallelism.num_layers_in_first_pipeline_stage={fix[0]} "
            f"parallelism.num_layers_in_last_pipeline_stage={fix[1]}" if fix else "")
    if layers is None:
        key, value = (("parallelism.pipeline_model_parallel_size", pp) if first is None and last is None
                      else ("parallelism.num_layers_in_first_pipeline_stage", first))
        _fail(ConfigError(key, value, f"a split of model.num_layers={m.num_layers} over PP={pp} stages "
                          f"(first={first}, last={last}) with the other stages equal (null first/last "
                          f"when PP=1){hint}"))
        return
    types = _plain_list(m.dsa_indexer_types)
    la_freq_ok = model_facts.linear_attention_problem(m.num_layers, _plain_list(m.linear_attention_freq)) is None
    if types is not None and la_freq_ok:
        pattern = model_facts.LayerPattern(m.num_layers, freq, offset, tuple(types),
                                           _plain_list(m.linear_attention_freq))
        layer = None if pattern.indexer_types_problem() else pl.shares_across_stages_pattern(layers, pattern)
        if layer is not None:
            _fail(ConfigError("parallelism.pipeline_model_parallel_size", pp,
                              f"stages that keep every shared DSA layer with its full source layer "
                              f"(stages {layers}: layer {layer} uses the top-k of layer "
                              f"{pattern.topk_source_layer(layer)} of an earlier stage under "
                              f"model.dsa_indexer_types); move the stage boundary "
                              f"(parallelism.num_layers_in_first_pipeline_stage / _last_)"))
        return
    start = pl.shares_across_stages(layers, freq, offset) if freq > 1 else None
    if start is not None:
        _fail(ConfigError(
            "parallelism.pipeline_model_parallel_size", pp,
            f"stages that start on top-k computing layers (stages {layers}: layer {start} starts a "
            f"stage but reuses a top-k under model.dsa_indexer_topk_freq={freq}, "
            f"model.dsa_indexer_skip_topk_offset={offset}){hint}"))
