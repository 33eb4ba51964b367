"""Typed schemas for every config group, registered in Hydra's ConfigStore.

``conf/config.yaml`` starts its defaults list with ``kpool_schema`` (the :class:`Config` below), so
every group file is merged into a typed, struct-mode node: an unknown key, a wrong type or a value
outside an enum fails at composition with OmegaConf's message naming the full key. Cross-field rules
(TP must divide heads, world size must be divisible by TP*PP*CP, ...) live in :func:`validate`,
which runs before any model is built and raises :class:`ConfigError` naming the key, the value and
what is allowed.

Field names of the ``model`` group are megatron-core's own (``TransformerConfig`` /
``MLATransformerConfig`` + ``kpool_layers.config.GLMTransformerConfig``) so that
``recipes.megatron_config`` maps them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore

from kpool_layers import model_facts


class ConfigError(ValueError):
    """A config value that cannot work, raised before anything expensive happens."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")


class Normalization(str, Enum):
    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class RopeType(str, Enum):
    rope = "rope"
    yarn = "yarn"


class RouterScore(str, Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


class DsaKernels(str, Enum):
    """``kpool_layers.dsa_kernels.BACKENDS``."""

    auto = "auto"
    torch = "torch"
    tilelang = "tilelang"
    triton = "triton"


class Dispatcher(str, Enum):
    allgather = "allgather"
    alltoall = "alltoall"


@dataclass
class ModelConfig:
    """GLM-5.x-style decoder: MLA + DSA indexer (optionally KPool) + dense/MoE MLPs."""

    name: str = "glm5_tiny"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    normalization: Normalization = Normalization.RMSNorm
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    # Multi-latent attention.
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_head_dim: int = 32
    qk_pos_emb_head_dim: int = 16
    v_head_dim: int = 32
    rope_type: RopeType = RopeType.rope
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mla_latent_norm_epsilon: Optional[float] = None  # q/kv latent RMSNorm eps; null = layernorm_epsilon
    # DSA lightning indexer.
    dsa_indexer_n_heads: int = 4
    dsa_indexer_head_dim: int = 32
    dsa_indexer_topk: int = 16
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_skip_topk_offset: int = 0
    dsa_indexer_loss_coeff: float = 0.0
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: float = 1e-6
    dsa_indexer_query_chunk_size: int = 1024
    dsa_kernels: DsaKernels = DsaKernels.auto  # sparse MLA + indexer top-k kernels (docs/kernels.md)
    # KPool (pooled index keys).
    dsa_indexer_kpool: int = 1
    dsa_indexer_kpool_always_select_tail: bool = False
    dsa_indexer_kpool_train_ape: bool = False
    # MoE (num_moe_experts = null: every layer dense).
    num_moe_experts: Optional[int] = 8
    moe_first_k_dense_layers: int = 1
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    moe_shared_expert_intermediate_size: Optional[int] = 64
    moe_router_score_function: RouterScore = RouterScore.sigmoid
    moe_router_enable_expert_bias: bool = True
    moe_router_topk_scaling_factor: Optional[float] = 2.5
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 1e-4
    moe_token_dispatcher_type: Dispatcher = Dispatcher.allgather
    moe_grouped_gemm: Optional[bool] = None  # null = auto: true on GPUs without FP8 experts (recipes.megatron_config)
    # Multi-token prediction.
    mtp_num_layers: int = 0


class DType(str, Enum):
    bf16 = "bf16"
    fp32 = "fp32"


class Fp8Recipe(str, Enum):
    blockwise = "blockwise"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Fp8Backend(str, Enum):
    auto = "auto"
    te = "te"
    torch = "torch"
    emulate = "emulate"


class ScaleFormat(str, Enum):
    ue8m0 = "ue8m0"
    amax = "amax"


class WeightsProjDtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    inherit = "inherit"


class DriftReference(str, Enum):
    serving = "serving"
    bf16 = "bf16"
    fp32 = "fp32"


@dataclass
class DriftConfig:
    """Top-k drift logging (``precision.drift.*``, see docs/precision.md)."""

    interval: int = 50  # steps between measurements; 0 = off
    reference: DriftReference = DriftReference.serving


@dataclass
class PrecisionConfig:
    """Numeric formats. ``dtype`` is the parameter/compute dtype of the model; the other keys
    (but ``name`` and ``drift``) are ``kpool_layers.precision.PrecisionPolicy`` fields."""

    name: str = "bf16"
    dtype: DType = DType.bf16
    fp8: bool = False
    recipe: Fp8Recipe = Fp8Recipe.blockwise
    backend: Fp8Backend = Fp8Backend.auto
    scale_format: ScaleFormat = ScaleFormat.ue8m0
    dsa_indexer_qk_proj_disable_quantization: bool = False
    mla_proj_disable_quantization: bool = False
    dsa_indexer_kpool_use_quantization: bool = False
    dsa_indexer_weights_proj_dtype: WeightsProjDtype = WeightsProjDtype.inherit
    dsa_indexer_weights_proj_disable_quantization: bool = False
    dsa_indexer_k_norm_fp32: bool = False
    drift: DriftConfig = field(default_factory=DriftConfig)


@dataclass
class ParallelismConfig:
    """Megatron parallel sizes. Data parallel size = world / (TP * PP * CP)."""

    name: str = "single"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: Optional[bool] = None  # null: on when TP > 1 (MoE with TP requires it)
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    # Launcher geometry (SLURM/torchrun); world size = nodes * gpus_per_node.
    nodes: int = 1
    gpus_per_node: int = 1


class DataKind(str, Enum):
    mock = "mock"
    indexed = "indexed"


@dataclass
class DataConfig:
    """Training data: megatron's MockGPTDataset or indexed .bin/.idx datasets (blendable)."""

    name: str = "mock"
    kind: DataKind = DataKind.mock
    paths: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    tokenizer: Optional[str] = None
    seq_length: int = 128
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    cache_dir: Optional[str] = None
    num_workers: int = 0


class LrDecay(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch sizes, steps and checkpointing."""

    steps: int = 30
    micro_batch_size: int = 2
    global_batch_size: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_steps: int = 3
    lr_decay_style: LrDecay = LrDecay.cosine
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 1
    save_interval: int = 0  # 0: save only at the end
    save_final: bool = True  # checkpoint after the last step (benchmarks turn it off)
    save: Optional[str] = None  # default: <run dir>/checkpoints
    load: Optional[str] = None  # a checkpoint to initialise the weights from (no optimizer state)
    resume: str = "auto"  # auto | none | <checkpoint dir>
    keep_checkpoints: int = 2
    dry_run: bool = False
    deterministic: bool = False  # bit-reproducible steps: refuse non-deterministic kernels
    # Checkpoint safety (issue #14; recipes/resume.py, recipes/nonfinite.py).
    overwrite: bool = False  # a fresh run may write into a save dir holding other checkpoints
    nonfinite_skip: int = 0  # steps with NaN/inf loss or grads skipped before the run stops


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class LoggingConfig:
    """Console and Weights & Biases logging (only the logging rank writes)."""

    name: str = "wandb"
    mode: WandbMode = WandbMode.offline
    project: str = "kpool-recipes"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "precision": PrecisionConfig,
    "parallelism": ParallelismConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
}


def register_configs() -> None:
    """Register the root schema and one schema per group (``<group>/schema``) in ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(name="kpool_schema", node=Config)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name="schema", node=node)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _divisors_of(n: int) -> str:
    return "a divisor of " + str(n) + " (" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + ")"


def validate(cfg: Any, world_size: int) -> None:
    """Cross-field checks on a composed config (``Config`` or a DictConfig of it).

    Raises :class:`ConfigError` naming the first offending key. Runs before any model is built.
    """
    m, p, t, d = cfg.model, cfg.parallelism, cfg.train, cfg.data
    for key, value in (("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                       ("model.num_attention_heads", m.num_attention_heads),
                       ("model.vocab_size", m.vocab_size), ("data.seq_length", d.seq_length),
                       ("train.steps", t.steps), ("train.micro_batch_size", t.micro_batch_size),
                       ("train.global_batch_size", t.global_batch_size),
                       ("parallelism.tensor_model_parallel_size", p.tensor_model_parallel_size),
                       ("parallelism.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
                       ("parallelism.context_parallel_size", p.context_parallel_size),
                       ("parallelism.expert_model_parallel_size", p.expert_model_parallel_size)):
        _require(value >= 1, key, value, "an integer >= 1")
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)
    _require(m.num_attention_heads % tp == 0, "parallelism.tensor_model_parallel_size", tp,
             _divisors_of(m.num_attention_heads) + " = model.num_attention_heads' divisors")
    _require(cp == 1, "parallelism.context_parallel_size", cp,
             "1 (the sparse MLA attention has no context-parallel path yet)")
    _require(world_size % (tp * pp * cp) == 0, "parallelism.tensor_model_parallel_size", tp,
             f"values with TP*PP*CP dividing the world size {world_size} "
             f"(got TP={tp}, PP={pp}, CP={cp})")
    _require(m.num_layers % pp == 0, "parallelism.pipeline_model_parallel_size", pp,
             _divisors_of(m.num_layers) + " = model.num_layers' divisors")
    dp = world_size // (tp * pp * cp)
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size",
             t.global_batch_size, f"a multiple of micro_batch_size * data_parallel_size = "
             f"{t.micro_batch_size} * {dp} = {t.micro_batch_size * dp}")
    if p.sequence_parallel:
        _require(tp > 1, "parallelism.sequence_parallel", True, "false or null when TP == 1")
    if m.num_moe_experts is not None:
        _require(m.num_moe_experts >= 1, "model.num_moe_experts", m.num_moe_experts,
                 "null (dense) or an integer >= 1")
        _require(m.num_moe_experts % ep == 0, "parallelism.expert_model_parallel_size", ep,
                 _divisors_of(m.num_moe_experts) + " = model.num_moe_experts' divisors")
        _require(1 <= m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk",
                 m.moe_router_topk, f"1..{m.num_moe_experts} (model.num_moe_experts)")
        _require(0 <= m.moe_first_k_dense_layers <= m.num_layers, "model.moe_first_k_dense_layers",
                 m.moe_first_k_dense_layers, f"0..{m.num_layers} (model.num_layers)")
        if tp > 1 and p.sequence_parallel is False:
            raise ConfigError("parallelism.sequence_parallel", False,
                              "true or null: megatron's MoE with TP > 1 requires sequence parallelism")
    else:
        _require(ep == 1, "parallelism.expert_model_parallel_size", ep, "1 when model.num_moe_experts is null")
    _require(world_size % (ep * (p.expert_tensor_parallel_size or tp) * pp) == 0,
             "parallelism.expert_model_parallel_size", ep,
             f"values with EP * expert TP * PP dividing the world size {world_size}")
    kpool_problem = model_facts.kpool_problem(m.dsa_indexer_kpool, m.dsa_indexer_topk)
    if kpool_problem is not None:
        key, value, allowed = kpool_problem
        raise ConfigError(f"model.{key}", value, allowed)
    _require(m.dsa_indexer_head_dim & (m.dsa_indexer_head_dim - 1) == 0 or not m.dsa_indexer_rotate_activation,
             "model.dsa_indexer_head_dim", m.dsa_indexer_head_dim,
             "a power of two when model.dsa_indexer_rotate_activation (Hadamard) is on")
    _require(m.qk_pos_emb_head_dim % 2 == 0, "model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim,
             "an even number (0 = NoPE)")
    _require(m.qk_pos_emb_head_dim <= m.dsa_indexer_head_dim, "model.qk_pos_emb_head_dim",
             m.qk_pos_emb_head_dim, f"<= model.dsa_indexer_head_dim={m.dsa_indexer_head_dim}")
    _require(m.dsa_indexer_topk_freq >= 1, "model.dsa_indexer_topk_freq", m.dsa_indexer_topk_freq,
             "an integer >= 1 (1 = every layer computes its top-k)")
    if pp > 1 and m.dsa_indexer_topk_freq > 1:
        _check_index_share_stages(m.num_layers, pp, m.dsa_indexer_topk_freq, m.dsa_indexer_skip_topk_offset)
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
    _require(t.lr > 0, "train.lr", t.lr, "a positive float")
    _require(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"0..train.lr={t.lr}")
    _require(0 <= t.lr_warmup_steps < t.steps, "train.lr_warmup_steps", t.lr_warmup_steps,
             f"0..{t.steps - 1} (less than train.steps)")
    _require(t.save_interval >= 0, "train.save_interval", t.save_interval, "0 (end only) or a positive step count")
    _require(t.keep_checkpoints >= 1, "train.keep_checkpoints", t.keep_checkpoints, "an integer >= 1")
    _require(t.nonfinite_skip >= 0, "train.nonfinite_skip", t.nonfinite_skip,
             "0 (stop at the first non-finite step) or the number of such steps to skip")
    _require(t.log_interval >= 1, "train.log_interval", t.log_interval, "an integer >= 1")
    _validate_precision(cfg)
    _validate_kernels(cfg)


def _validate_kernels(cfg: Any) -> None:
    """``model.dsa_kernels``: resolvable, runnable here (unless a dry run plans for another
    machine), supported for the model's shapes and deterministic under ``train.deterministic``."""
    from kpool_layers import dsa_kernels

    m = cfg.model
    requested = _value(m.dsa_kernels)
    on_device = not cfg.train.dry_run
    backend = dsa_kernels.resolve(requested, on_device=None if on_device else False)
    shapes = dsa_kernels.KernelShapes(
        dtype=torch.bfloat16 if _value(cfg.precision.dtype) == "bf16" else torch.float32,
        kv_lora_rank=m.kv_lora_rank, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        dsa_indexer_head_dim=m.dsa_indexer_head_dim)
    try:
        dsa_kernels.check_backend(backend, shapes, deterministic=cfg.train.deterministic,
                                  on_device=on_device)
    except dsa_kernels.KernelUnavailable as err:
        shown = requested if requested == backend else f"{requested} (= {backend} here)"
        raise ConfigError("model.dsa_kernels", shown,
                          f"{list(dsa_kernels.BACKENDS)}; {err}") from None


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def _validate_precision(cfg: Any) -> None:
    """``precision.*`` rules: backend usable by the recipes' (local) layer spec, FP8 layer shapes,
    serving-quantized index inputs only for power-of-two indexer heads <= 128, drift settings."""
    from kpool_layers import precision as prec

    pr, m = cfg.precision, cfg.model
    backend = _value(pr.backend)
    if pr.fp8:
        _require(backend != "te", "precision.backend", backend,
                 "torch, emulate or auto: the recipes build megatron's local layer spec and "
                 "precision.backend=te quantizes only Transformer Engine linears")
        if not cfg.train.dry_run:  # a dry run plans for another machine
            usable = [b for b in prec.available_backends() if b != "te"]
            _require(backend == "auto" or backend in usable, "precision.backend", backend,
                     f"auto or one available here: {usable}")
        _require(not (m.num_moe_experts and m.moe_grouped_gemm), "model.moe_grouped_gemm", True,
                 "false with precision.fp8=true (FP8 routing needs per-expert linears, SequentialMLP)")
    if (pr.fp8 and _value(pr.dsa_indexer_weights_proj_dtype) == "fp32"
            and not pr.dsa_indexer_weights_proj_disable_quantization):
        raise ConfigError("precision.dsa_indexer_weights_proj_disable_quantization", False,
                          "true when precision.dsa_indexer_weights_proj_dtype=fp32 and precision.fp8=true "
                          "(an FP32 projection cannot also be an FP8 GEMM)")
    interval = pr.drift.interval
    _require(interval >= 0, "precision.drift.interval", interval, "0 (off) or a positive step count")
    serving_ref = interval > 0 and _value(pr.drift.reference) == "serving"
    if pr.dsa_indexer_kpool_use_quantization or serving_ref:
        d = m.dsa_indexer_head_dim
        key = ("precision.dsa_indexer_kpool_use_quantization=true" if pr.dsa_indexer_kpool_use_quantization
               else "precision.drift.reference=serving")
        _require(d <= 128 and d & (d - 1) == 0, "model.dsa_indexer_head_dim", d,
                 f"a power of two <= 128 (128 on served models) with {key}: the serving index path "
                 "quantizes one Hadamard-rotated head_dim vector per scale")


def _check_index_share_stages(num_layers: int, pp: int, freq: int, offset: int) -> None:
    """Under IndexShare each pipeline stage must start on a layer that computes its own top-k."""
    per_stage = num_layers // pp
    for stage in range(1, pp):
        first = stage * per_stage + 1
        if not model_facts.computes_topk(first, freq, offset):
            raise ConfigError(
                "parallelism.pipeline_model_parallel_size", pp,
                f"a size whose stages start on top-k computing layers (stage {stage} starts on "
                f"layer {first}, which reuses a top-k under model.dsa_indexer_topk_freq={freq}, "
                f"model.dsa_indexer_skip_topk_offset={offset})")
