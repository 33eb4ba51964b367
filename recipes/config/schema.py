"""Typed schemas for every config group, registered in Hydra's ConfigStore.

``conf/config.yaml`` starts its defaults list with ``kpool_schema`` (the :class:`Config` below), so
every group file is merged into a typed, struct-mode node: an unknown key, a wrong type or a value
outside an enum fails at composition with OmegaConf's message naming the full key (keys added with
``+``/``++`` are caught by :mod:`recipes.config.keys`). Every numeric field declares its allowed
range next to it (:func:`num`), checked by :func:`recipes.config.rules.check_ranges`. Cross-field
rules (TP must divide heads, world size must be divisible by TP*PP*CP, ...) live in
:func:`recipes.config.rules.validate`, which runs before any model is built and raises
:class:`ConfigError` naming the key, the value and what is allowed.

Field names of the ``model`` group are megatron-core's own (``TransformerConfig`` /
``MLATransformerConfig`` + ``kpool_layers.config.GLMTransformerConfig``) so that
``recipes.config.megatron`` maps them one to one.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Optional

from hydra.core.config_store import ConfigStore

from kpool_layers import model_facts
from kpool_layers.dsa.backends import Backend as DsaKernels
from kpool_layers.linear_attention.backends import Backend as LinearAttentionKernels
from kpool_layers.precision.policy import PrecisionPolicy


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
        if not math.isfinite(value):  # NaN compares False both ways; inf is no usable setting
            return False
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
    # Per-layer indexer: list of full/shared (transformers' indexer_types; a shared DSA layer uses
    # the nearest earlier full DSA layer's top-k); null = the topk_freq/skip_topk_offset schedule.
    dsa_indexer_types: Optional[list[str]] = None
    # KDA linear attention (GLM-5.3, docs/linear_attention.md). megatron's linear_attention_freq:
    # null = every layer DSA; N = layers N, 2N, ... DSA and the others KDA; or a 0/1 list per layer
    # (1 = KDA). transformers' layer_types: linear_attention / indexed_attention.
    linear_attention_freq: Any = None
    linear_num_key_heads: int = num(4, 1)
    linear_num_value_heads: int = num(4, 1)  # = linear_num_key_heads (KDA has one head count)
    linear_key_head_dim: int = num(32, 1)
    linear_value_head_dim: int = num(32, 1)  # = linear_key_head_dim
    linear_conv_kernel_dim: int = num(4, 1)
    linear_gate_lower_bound: Optional[float] = num(-5.0, None, 0.0, open_hi=True)  # null: -exp(A_log) softplus(f)
    # Rollout replay (data=rollout, docs/replay.md): attend to the recorded top-k / route to the
    # recorded experts.
    dsa_topk_replay: bool = False
    moe_router_replay: bool = False
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
    # SwiGLU clamp (transformers' swiglu_limit): gate <= v, up in [-v, v]; null = none.
    activation_func_clamp_value: Optional[float] = num(None, 0.0, open_lo=True)
    moe_grouped_gemm: Optional[bool] = None  # null = auto: true on GPUs without FP8 experts (recipes.config.megatron)
    # Multi-token prediction.
    mtp_num_layers: int = num(0, 0)
    # mHC hyper-connections (transformers' names, docs/hyper_connections.md): hc_mult residual
    # streams around every attention and MLP block; null = a plain residual.
    hc_mult: Optional[int] = num(None, 1)
    hc_sinkhorn_iters: int = num(20, 1)
    hc_eps: float = num(1e-6, 0.0)


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
    """Numeric formats: every ``kpool_layers.precision.policy.PrecisionPolicy`` field (the policy is built
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
    rollout = "rollout"


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
    rollout_dir: Optional[str] = None  # data=rollout: the directory of rollout records


class LrDecay(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class CudaGraphImpl(str, Enum):
    """megatron's ``cuda_graph_impl`` values this recipe runs (``recipes/train/cuda_graph.py``)."""

    none = "none"
    full_iteration = "full_iteration"


class RecomputeGranularity(str, Enum):
    """megatron's ``recompute_granularity`` (recipes/config/recompute.py says which combinations run)."""

    full = "full"  # whole transformer layers recomputed in backward (recompute_method, _num_layers)
    selective = "selective"  # the submodules of train.recompute_modules


class RecomputeMethod(str, Enum):
    """megatron's ``recompute_method`` (with ``recompute_granularity=full``)."""

    uniform = "uniform"  # every group of recompute_num_layers layers checkpointed as one
    block = "block"  # the first recompute_num_layers layers of each pipeline stage


class FP8WeightCache(str, Enum):
    """What a training step keeps of its FP8 weights for its later micro-batches
    (``kpool_layers/precision/weight_cache.py``)."""

    none = "none"  # every micro-batch quantizes and dequantizes every weight
    fp8 = "fp8"  # the e4m3 weights and scales: no more peak memory
    dequantized = "dequantized"  # also the backward's weight operand: 2 bytes (bf16 copy) or 1 (FP8 backward) per element


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
    # Validation loss (val/loss) on data.split's validation part every eval_interval steps and
    # after the last step (recipes/train/evaluate.py); 0 = off.
    eval_interval: int = num(0, 0)
    eval_iters: int = num(2, 1)  # global batches per evaluation: the same batches every time
    # MFU's peak per GPU in TFLOP/s; null = the device's spec peak (recipes/plan/peak_flops.py)
    peak_tflops: Optional[float] = num(None, 0.0, open_lo=True)
    deterministic: bool = False  # bit-reproducible steps: refuse non-deterministic kernels
    # Checkpoint safety (issue #14; recipes/checkpoint/resume.py, recipes/train/nonfinite.py).
    overwrite: bool = False  # a fresh run may write into a save dir holding other checkpoints
    save_in_system_dir: bool = False  # allow checkpoints in / or a system directory (recipes/plan/preflight.py)
    nonfinite_skip: int = num(0, 0)  # steps with NaN/inf loss or grads skipped before the run stops
    collective_timeout_s: float = num(600.0, 0.0, open_lo=True)  # seconds a collective waits for the other ranks, then the step fails naming itself
    # The forward-backward of all micro-batches replayed as one CUDA graph (recipes/train/cuda_graph.py).
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.none
    cuda_graph_warmup_steps: int = num(2, 1)  # eager steps before the capture
    # The language-model loss in two Triton kernels on GPUs (kpool_layers/loss.py).
    cross_entropy_fusion: bool = True
    # The output layer and loss in chunks of this many tokens, logits recomputed in backward
    # (kpool_layers/chunked_loss.py); 0 = the whole sequence at once.
    loss_chunk_tokens: int = num(0, 0)
    # megatron's activation recompute, under megatron's names (recipes/config/recompute.py); null = off.
    recompute_granularity: Optional[RecomputeGranularity] = None
    recompute_method: Optional[RecomputeMethod] = None
    recompute_num_layers: Optional[int] = num(None, 1)
    recompute_modules: Optional[list[str]] = None  # selective: null = megatron's ["core_attn"]
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
    print_precision_map: bool = False  # the console shows one line per role, not one line in all


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
