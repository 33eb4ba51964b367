"""The transformer config the GLM-5.x layers read: megatron-core's ``MLATransformerConfig`` plus the
KPool indexer fields that megatron-core 0.19 does not have and the run's precision policy.

Every field keeps megatron's naming so ``recipes.config.megatron`` maps the Hydra ``model`` group to
it one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.transformer.transformer_config import MLATransformerConfig

from kpool_layers import model_facts
from kpool_layers.precision.policy import PrecisionPolicy


@dataclass
class GLMTransformerConfig(MLATransformerConfig):
    """``MLATransformerConfig`` + KPool DSA indexer fields (see ``kpool_layers.dsa.kpool``) + the
    precision policy."""

    dsa_indexer_kpool: int = 1
    """Tokens per pooled index key; 1 = plain DSA."""

    dsa_indexer_kpool_always_select_tail: bool = False
    """Append the query's incomplete pool (0..kpool-1 tokens) to every selection."""

    dsa_indexer_kpool_train_ape: bool = False
    """Train the per-slot positional bias ``index_kpool_compress_ape`` (frozen by default)."""

    dsa_topk_replay: bool = False
    """Attend to replayed top-k indices instead of the indexer's (:mod:`kpool_layers.dsa.replay`)."""

    dsa_indexer_query_chunk_size: int = 1024
    """Queries scored at once by the indexer and the sparse attention; bounds memory to
    O(chunk * s) instead of O(s * s)."""

    dsa_kernels: str = "torch"
    """Kernels of the sparse MLA attention and the indexer's scores + top-k: ``torch``, ``tilelang``
    or ``triton`` (resolved; ``auto`` is resolved before the config is made, see
    :mod:`kpool_layers.dsa.backends`)."""

    linear_attention_kernels: str = "torch"
    """Kernel of the KDA layers' delta rule: ``torch`` or ``fla`` (resolved; ``auto`` is resolved
    before the config is made, see :mod:`kpool_layers.linear_attention.backends`)."""

    linear_gate_lower_bound: float | None = -5.0
    """KDA forget gate: ``lower_bound * sigmoid(exp(A_log) * f)``; None: ``-exp(A_log) softplus(f)``
    (transformers' ``linear_lower_bound``, GLM-5.3: -5)."""

    dsa_indexer_types: list[str] | None = None
    """Per decoder layer ``full`` (runs its indexer) or ``shared`` (uses the top-k of the nearest
    earlier ``full`` DSA layer), transformers' ``indexer_types``; entries of KDA layers are not
    read. None: the ``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset`` schedule
    (:class:`kpool_layers.model_facts.LayerPattern`)."""

    hc_mult: int | None = None
    """mHC residual streams around every attention and MLP block
    (:mod:`kpool_layers.hyper_connections`); None = a plain residual (transformers' ``hc_mult``,
    GLM-5.3: 4)."""

    hc_sinkhorn_iters: int = 20
    """Sinkhorn iterations making each block's stream-mixing matrix doubly stochastic."""

    hc_eps: float = 1e-6
    """mHC's floor: added to the pre weights and the mixing matrix, and to each Sinkhorn sum."""

    mla_latent_norm_epsilon: float | None = None
    """Epsilon of the MLA q/kv latent RMSNorms (``q_layernorm``, ``kv_layernorm``); None = the
    model's ``layernorm_epsilon``. transformers' glm_moe_dsa uses 1e-6 there (with rms_norm_eps
    1e-5 elsewhere)."""

    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """The run's precision policy (the ``precision`` group): the numerics the role-tagged linears
    are built with (``kpool_layers.precision.linears``), the indexer's serving-quantized scoring, drift's
    reference and the precision map.
    ``recipes.config.megatron`` derives ``bf16``, ``params_dtype`` and ``dsa_indexer_k_norm_fp32``
    from it."""

    @property
    def mla_latent_norm_eps(self) -> float:
        """The epsilon the MLA latent norms use."""
        eps = self.mla_latent_norm_epsilon
        return self.layernorm_epsilon if eps is None else eps

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dsa_kernels not in ("torch", "tilelang", "triton"):
            raise ValueError(f"dsa_kernels={self.dsa_kernels!r} is not allowed; allowed: "
                             "torch, tilelang, triton ('auto' is resolved by the recipes)")
        if self.linear_attention_kernels not in ("torch", "fla"):
            raise ValueError(f"linear_attention_kernels={self.linear_attention_kernels!r} is not "
                             "allowed; allowed: torch, fla ('auto' is resolved by the recipes)")
        if self.hc_mult is not None and self.hc_mult < 1:
            raise ValueError(f"hc_mult={self.hc_mult} is not allowed; allowed: None (off) or >= 1")
        if self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters={self.hc_sinkhorn_iters} is not allowed; allowed: >= 1")
        problem = model_facts.kpool_problem(self.dsa_indexer_kpool, self.dsa_indexer_topk)
        if problem is not None:
            key, value, allowed = problem
            raise ValueError(f"{key}={value} is not allowed; allowed: {allowed}")

    @property
    def dsa_indexer_output_width(self) -> int:
        """Width of the indexer's index tensor: ``topk`` (+ ``kpool - 1`` tail slots)."""
        tail = self.dsa_indexer_kpool - 1 if self.dsa_indexer_kpool_always_select_tail else 0
        return int(self.dsa_indexer_topk or 0) + tail

    @property
    def layer_pattern(self) -> model_facts.LayerPattern:
        """Which layers are KDA (megatron's ``linear_attention_freq``) and which DSA layers
        compute their top-k (:class:`kpool_layers.model_facts.LayerPattern`)."""
        return model_facts.LayerPattern.of(self)

    def is_linear_attention(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` is a KDA layer (``linear_attention_freq``)."""
        return self.layer_pattern.is_linear_attention(layer_number)

    @property
    def shares_topk(self) -> bool:
        """Whether some DSA layer reuses another layer's top-k (IndexShare)."""
        return self.layer_pattern.shares_topk

    def computes_topk(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` runs its own indexer (IndexShare, ``model_facts``)."""
        return self.layer_pattern.computes_topk(layer_number)

    def topk_source_layer(self, layer_number: int) -> int:
        """The computing layer whose top-k layer ``layer_number`` uses (itself if it computes)."""
        return self.layer_pattern.topk_source_layer(layer_number)

    def is_moe(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` is an MoE layer under ``moe_layer_freq``."""
        return model_facts.is_moe(layer_number, self.num_moe_experts, self.moe_layer_freq)
