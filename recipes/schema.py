"""Typed schemas for every config group, registered in Hydra's ConfigStore.

``conf/config.yaml`` starts its defaults list with ``kpool_schema`` (the :class:`Config` below), so
every group file is merged into a typed, struct-mode node: an unknown key, a wrong type or a value
outside an enum fails at composition with OmegaConf's message naming the full key (keys added with
``+``/``++`` are caught by :mod:`recipes.config_keys`). Every numeric field declares its allowed
range next to it (:func:`num`), checked by :func:`check_ranges`. Cross-field rules
(TP must divide heads, world size must be divisible by TP*PP*CP, ...) live in :func:`validate`,
which runs before any model is built and raises :class:`ConfigError` naming the key, the value and
what is allowed.

Field names of the ``model`` group are megatron-core's own (``TransformerConfig`` /
``MLATransformerConfig`` + ``kpool_layers.config.GLMTransformerConfig``) so that
``recipes.megatron_config`` maps them one to one.
"""

from __future__ import annotations

import dataclasses
import typing
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from kpool_layers import model_facts
from kpool_layers.dsa_kernels import Backend as DsaKernels
from kpool_layers.grouped_gemm import FP8_RECIPES
from kpool_layers.linear_attention.backends import Backend as LinearAttentionKernels
from kpool_layers.precision import PrecisionPolicy, WeightsProjDtype, available_backends


class ConfigError(ValueError):
    """A config value that cannot work, raised before anything expensive happens."""

    def __init__(self, key: str, value: Any, allowed: str, message: Optional[str] = None) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(message or f"invalid config: {key}={value!r}; allowed: {allowed}")


MIN_VOCAB_SIZE = 256
"""The smallest ``model.vocab_size`` accepted: a byte-level vocabulary (256 ids) is the smallest
that can encode any text; below it a model cannot represent its own corpus (megatron's mock data
and the null tokenizer also reserve the last id for EOD)."""


@dataclass(frozen=True)
class Range:
    """The allowed interval of a numeric field; ``None`` bounds are unbounded."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    open_lo: bool = False
    open_hi: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.lo is None or (value > self.lo if self.open_lo else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.open_hi else value <= self.hi)
        return above and below

    def __str__(self) -> str:
        left = "(-inf" if self.lo is None else f"{'(' if self.open_lo else '['}{self.lo:g}"
        right = "inf)" if self.hi is None else f"{self.hi:g}{')' if self.open_hi else ']'}"
        return f"{left}, {right}"


def num(default: Any, lo: Optional[float] = None, hi: Optional[float] = None, *,
        open_lo: bool = False, open_hi: bool = False) -> Any:
    """A numeric schema field with its allowed :class:`Range` (checked by :func:`check_ranges`;
    ``tests/test_config.py`` fails for a numeric field declared without one). ``None`` values of
    ``Optional`` fields are always allowed."""
    return field(default=default, metadata={"range": Range(lo, hi, open_lo, open_hi)})


class Normalization(str, Enum):
    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class RopeType(str, Enum):
    rope = "rope"
    yarn = "yarn"


class RouterScore(str, Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


class Dispatcher(str, Enum):
    allgather = "allgather"
    alltoall = "alltoall"


@dataclass
class ModelConfig:
    """GLM-5.x-style decoder: MLA + DSA indexer (optionally KPool) + dense/MoE MLPs."""

    name: str = "glm5_tiny"
    num_layers: int = num(4, 1)
    hidden_size: int = num(128, 1)
    num_attention_heads: int = num(4, 1)
    ffn_hidden_size: int = num(256, 1)
    vocab_size: int = num(512, MIN_VOCAB_SIZE)
    max_position_embeddings: int = num(4096, 1)
    normalization: Normalization = Normalization.RMSNorm
    layernorm_epsilon: float = num(1e-5, 0.0, 1.0, open_lo=True, open_hi=True)
    init_method_std: float = num(0.02, 0.0, open_lo=True)
    untie_embeddings_and_output_weights: bool = True
    # Multi-latent attention.
    q_lora_rank: int = num(64, 1)
    kv_lora_rank: int = num(32, 1)
    qk_head_dim: int = num(32, 1)
    qk_pos_emb_head_dim: int = num(16, 0)  # 0 = NoPE
    v_head_dim: int = num(32, 1)
    rope_type: RopeType = RopeType.rope
    rotary_base: float = num(10000.0, 0.0, open_lo=True)
    rotary_scaling_factor: float = num(1.0, 0.0, open_lo=True)
    original_max_position_embeddings: int = num(4096, 1)
    mscale: float = num(1.0, 0.0, open_lo=True)
    mscale_all_dim: float = num(0.0, 0.0)
    beta_fast: float = num(32.0, 0.0, open_lo=True)
    beta_slow: float = num(1.0, 0.0, open_lo=True)
    # q/kv latent RMSNorm eps; null = layernorm_epsilon
    mla_latent_norm_epsilon: Optional[float] = num(None, 0.0, 1.0, open_lo=True, open_hi=True)
    # DSA lightning indexer.
    dsa_indexer_n_heads: int = num(4, 1)
    dsa_indexer_head_dim: int = num(32, 1)
    dsa_indexer_topk: int = num(16, 1)
    dsa_indexer_topk_freq: int = num(1, 1)
    dsa_indexer_skip_topk_offset: int = num(0, 0)
    dsa_indexer_loss_coeff: float = num(0.0, 0.0)
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: float = num(1e-6, 0.0, 1.0, open_lo=True, open_hi=True)
    dsa_indexer_query_chunk_size: int = num(1024, 1)
    dsa_kernels: DsaKernels = DsaKernels.auto  # sparse MLA + indexer top-k kernels (docs/kernels.md)
    linear_attention_kernels: LinearAttentionKernels = LinearAttentionKernels.auto  # KDA delta rule (docs/linear_attention.md)
    # KPool (pooled index keys).
    dsa_indexer_kpool: int = num(1, 1, max(model_facts.KPOOL_ALLOWED))
    dsa_indexer_kpool_always_select_tail: bool = False
    dsa_indexer_kpool_train_ape: bool = False
    # MoE (num_moe_experts = null: every layer dense).
    num_moe_experts: Optional[int] = num(8, 1)
    moe_first_k_dense_layers: int = num(1, 0)
    moe_router_topk: int = num(2, 1)
    moe_ffn_hidden_size: int = num(64, 1)
    moe_shared_expert_intermediate_size: Optional[int] = num(64, 1)
    moe_router_score_function: RouterScore = RouterScore.sigmoid
    moe_router_enable_expert_bias: bool = True
    moe_router_topk_scaling_factor: Optional[float] = num(2.5, 0.0, open_lo=True)
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = num(1e-4, 0.0)
    moe_token_dispatcher_type: Dispatcher = Dispatcher.allgather
    moe_grouped_gemm: Optional[bool] = None  # null = auto: true on GPUs without FP8 experts (recipes.megatron_config)
    # Multi-token prediction.
    mtp_num_layers: int = num(0, 0)


class DriftReference(str, Enum):
    """``precision.drift.reference``: the profile whose indexer numerics the drift measurement
    recomputes the selection with."""

    serving = "serving"
    bf16 = "bf16"
    fp32 = "fp32"

    @property
    def profile(self) -> str:
        """Its ``conf/precision`` profile: ``serving`` is ``serving_match``."""
        return "serving_match" if self is DriftReference.serving else self.value


@dataclass
class DriftConfig:
    """Top-k drift logging (``precision.drift.*``, see docs/precision.md)."""

    interval: int = num(50, 0)  # steps between measurements; 0 = off
    reference: DriftReference = DriftReference.serving


def _mutable_schema(frozen: type, name: str, doc: str, *extra: tuple[str, type, Any]) -> type:
    """A mutable (mergeable) schema dataclass ``name`` with the fields of the frozen dataclass
    ``frozen`` (same names, types and defaults) followed by ``extra`` ``(name, type, field)``."""
    hints = typing.get_type_hints(frozen)
    fields = [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(frozen)]
    return dataclasses.make_dataclass(name, [*fields, *extra], namespace={"__doc__": doc},
                                      module=__name__)


PrecisionConfig = _mutable_schema(
    PrecisionPolicy, "PrecisionConfig",
    """Numeric formats: every ``kpool_layers.precision.PrecisionPolicy`` field (the policy is built
    from this group by ``PrecisionPolicy.from_config``) and ``drift``.""",
    ("drift", DriftConfig, field(default_factory=DriftConfig)),
)


@dataclass
class ParallelismConfig:
    """Megatron parallel sizes. Data parallel size = world / (TP * PP * CP)."""

    name: str = "single"
    tensor_model_parallel_size: int = num(1, 1)
    pipeline_model_parallel_size: int = num(1, 1)
    context_parallel_size: int = num(1, 1)
    expert_model_parallel_size: int = num(1, 1)
    expert_tensor_parallel_size: Optional[int] = num(None, 1)
    # Uneven pipeline stages (megatron's names): the first / last stage's decoder layers, the
    # other stages split the rest evenly. null: every stage gets num_layers / PP.
    num_layers_in_first_pipeline_stage: Optional[int] = num(None, 1)
    num_layers_in_last_pipeline_stage: Optional[int] = num(None, 1)
    sequence_parallel: Optional[bool] = None  # null: on when TP > 1 (MoE with TP requires it)
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    # Launcher geometry (SLURM/torchrun); world size = nodes * gpus_per_node.
    nodes: int = num(1, 1)
    gpus_per_node: int = num(1, 1)


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
    seq_length: int = num(128, 1)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    cache_dir: Optional[str] = None
    num_workers: int = num(0, 0)


class LrDecay(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class CudaGraphImpl(str, Enum):
    """megatron's ``cuda_graph_impl`` values this recipe runs (``recipes/cuda_graph.py``)."""

    none = "none"
    full_iteration = "full_iteration"


class FP8WeightCache(str, Enum):
    """What a training step keeps of its FP8 weights for its later micro-batches
    (``kpool_layers/weight_cache.py``)."""

    none = "none"  # every micro-batch quantizes and dequantizes every weight
    fp8 = "fp8"  # the e4m3 weights and scales: no more peak memory
    dequantized = "dequantized"  # also the dequantized copy: 2 bytes per FP8 weight element more at the peak


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch sizes, steps and checkpointing."""

    steps: int = num(30, 1)
    micro_batch_size: int = num(2, 1)
    global_batch_size: int = num(4, 1)
    lr: float = num(3e-3, 0.0, open_lo=True)
    min_lr: float = num(3e-4, 0.0)
    lr_warmup_steps: int = num(3, 0)
    lr_decay_style: LrDecay = LrDecay.cosine
    weight_decay: float = num(0.01, 0.0)
    adam_beta1: float = num(0.9, 0.0, 1.0, open_hi=True)
    adam_beta2: float = num(0.95, 0.0, 1.0, open_hi=True)
    adam_eps: float = num(1e-8, 0.0, open_lo=True)
    clip_grad: float = num(1.0, 0.0)  # 0 = no clipping
    seed: int = num(1234, 0, 2**32 - 1)  # numpy's seed range
    log_interval: int = num(1, 1)
    save_interval: int = num(0, 0)  # 0: save only at the end
    save_final: bool = True  # checkpoint after the last step (benchmarks turn it off)
    save: Optional[str] = None  # default: <run dir>/checkpoints
    load: Optional[str] = None  # a checkpoint to initialise the weights from (no optimizer state)
    resume: str = "auto"  # auto | none | <checkpoint dir>
    keep_checkpoints: int = num(2, 1)
    dry_run: bool = False
    deterministic: bool = False  # bit-reproducible steps: refuse non-deterministic kernels
    # Checkpoint safety (issue #14; recipes/resume.py, recipes/nonfinite.py).
    overwrite: bool = False  # a fresh run may write into a save dir holding other checkpoints
    nonfinite_skip: int = num(0, 0)  # steps with NaN/inf loss or grads skipped before the run stops
    # The forward-backward of all micro-batches replayed as one CUDA graph (recipes/cuda_graph.py).
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.none
    cuda_graph_warmup_steps: int = num(2, 1)  # eager steps before the capture
    # The language-model loss in two Triton kernels on GPUs (kpool_layers/cross_entropy.py).
    cross_entropy_fusion: bool = True
    # FP8 weights quantized once per step, not per micro-batch (the same bits; precision.fp8 only).
    fp8_weight_cache: FP8WeightCache = FP8WeightCache.fp8


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


def numeric_fields(schema: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every int or float field (``Optional`` too, bool not) of ``schema``
    and its nested dataclasses."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from numeric_fields(hint, prefix + f.name + ".")
        elif {a for a in typing.get_args(hint) or (hint,) if a is not type(None)} & {int, float}:
            yield prefix + f.name, f


def check_ranges(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for a numeric value outside its field's declared :class:`Range`."""
    for key, f in numeric_fields():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        allowed: Range = f.metadata["range"]
        if node is not None and node not in allowed:
            kind = "an integer" if isinstance(f.default, int) else "a number"
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
    :func:`recipes.typed_config.to_config`): every key exists in the schema, every number is in
    its field's range, then the cross-field rules.

    Raises :class:`ConfigError` naming the first offending key. Runs before any model is built.
    """
    from recipes.config_keys import check_config_keys

    check_config_keys(cfg)
    check_ranges(cfg)
    _check_rules(cfg, world_size)


def all_problems(cfg: DictConfig, world_size: int) -> list[ConfigError]:
    """Every rule of :func:`validate` that ``cfg`` breaks (a dry run lists them all at once); an
    unknown key or a value out of range is reported alone (the other rules assume sane values)."""
    from recipes.config_keys import check_config_keys

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
    _require(t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"0..train.lr={t.lr}")
    _require(t.lr_warmup_steps < t.steps, "train.lr_warmup_steps", t.lr_warmup_steps,
             f"0..{t.steps - 1} (less than train.steps)")
    _validate_precision(cfg)
    _validate_kernels(cfg)
    _validate_linear_attention_kernels(cfg)
    _validate_cuda_graph(cfg)


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
    from kpool_layers import dsa_kernels

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
    """``precision.*`` rules: backend available here, FP8 layer shapes, serving-quantized index
    inputs only for power-of-two indexer heads <= 128, drift settings."""
    pr, m = cfg.precision, cfg.model
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
    starts on a top-k computing layer (see :mod:`recipes.pipeline_layout`)."""
    from recipes import pipeline_layout as pl

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
    start = pl.shares_across_stages(layers, freq, offset) if freq > 1 else None
    if start is not None:
        _fail(ConfigError(
            "parallelism.pipeline_model_parallel_size", pp,
            f"stages that start on top-k computing layers (stages {layers}: layer {start} starts a "
            f"stage but reuses a top-k under model.dsa_indexer_topk_freq={freq}, "
            f"model.dsa_indexer_skip_topk_offset={offset}){hint}"))
