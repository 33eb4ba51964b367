"""The one place where the composed config (the schema's ``Config``) becomes megatron-core's
transformer config.

``model`` fields carry megatron's names and are copied unchanged; the few fields that megatron
derives differently (dtype, the indexer key-norm precision, MoE layer pattern, grouped experts,
parallel sizes, CPU/GPU kernel switches, the indexer loss's backward-scale callback) are listed
explicitly in :func:`to_transformer_config`.
The ``precision`` group becomes one :class:`~kpool_layers.precision.policy.PrecisionPolicy`, held on the
config as ``precision``; the dtype fields are derived from it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kpool_layers.dsa import backends as dsa_kernels
from kpool_layers import model_facts
from kpool_layers.compat import wgrad_accumulation
from kpool_layers.mla.attention import IndexerLossAutoScaler
from kpool_layers.linear_attention import backends as linear_attention_backends
from kpool_layers.config import GLMTransformerConfig
from kpool_layers.loss import loss_backend
from kpool_layers.moe.grouped_gemm import supports_policy
from kpool_layers.precision.policy import DType, PrecisionPolicy
from recipes.config.recompute import recompute_fields
from recipes.config.schema import Config, ParallelismConfig
from recipes.config.typed import plain

# ``model`` keys that are ours, not GLMTransformerConfig fields (handled below or by the model builder).
_NOT_COPIED = {"name", "vocab_size", "max_position_embeddings", "untie_embeddings_and_output_weights",
               "moe_first_k_dense_layers", "mtp_num_layers", "moe_grouped_gemm",
               "moe_router_replay"}


def sequence_parallel(parallelism: ParallelismConfig) -> bool:
    """``parallelism.sequence_parallel``, where null means on exactly when TP > 1."""
    sp = parallelism.sequence_parallel
    return parallelism.tensor_model_parallel_size > 1 if sp is None else bool(sp)


def grouped_experts(model_grouped_gemm: bool | None, policy: PrecisionPolicy, on_gpu: bool) -> bool:
    """``model.moe_grouped_gemm``, where null (auto) means grouped-GEMM experts
    (``kpool_layers.moe.experts``) exactly on GPUs when they compute ``policy``'s expert roles
    (bf16, or FP8 with a recipe of ``kpool_layers.moe.grouped_gemm.FP8_RECIPES``; FP8 tensorwise is
    routed per expert linear, ``SequentialMLP``); on the CPU the grouped module loops anyway."""
    if model_grouped_gemm is None:
        return on_gpu and supports_policy(policy)
    return bool(model_grouped_gemm)


def fused_cross_entropy(train_cross_entropy_fusion: bool, on_gpu: bool) -> bool:
    """``train.cross_entropy_fusion`` where its kernels run: on a GPU
    (``kpool_layers.loss``, Triton; any logits dtype, the logit gradients come back in
    the logits' dtype). On the CPU megatron's unfused loss runs (the kernel route
    ``kpool_layers.loss.LOSS``)."""
    return loss_backend(train_cross_entropy_fusion, on_gpu) == "triton"


def _wgrad_fusion(ddp: bool) -> bool:
    """megatron's gradient-accumulation fusion under DDP, with this project's kernel where apex's
    is missing (megatron checks for one when it builds a linear)."""
    if ddp:
        wgrad_accumulation.install()
    return ddp


def to_transformer_config(cfg: Config, ddp: bool = False) -> GLMTransformerConfig:
    """The composed config -> ``GLMTransformerConfig``; ``ddp``: the model trains under megatron's
    DDP (``main_grad`` buffers), so its linears accumulate weight gradients straight into them
    (gradient-accumulation fusion, :mod:`kpool_layers.compat.wgrad_accumulation`)."""
    m, par = cfg.model, cfg.parallelism
    fields = {f.name for f in dataclasses.fields(GLMTransformerConfig)}
    copied = {k: v for k, v in plain(m).items() if k not in _NOT_COPIED}
    unknown = set(copied) - fields
    if unknown:
        raise KeyError(f"model keys without a megatron field: {sorted(unknown)}")

    copied["dsa_kernels"] = dsa_kernels.resolve(
        copied["dsa_kernels"], on_device=False if cfg.train.dry_run else None)
    copied["linear_attention_kernels"] = linear_attention_backends.resolve(
        copied["linear_attention_kernels"], on_device=False if cfg.train.dry_run else None)
    policy = PrecisionPolicy.from_config(cfg.precision)
    experts = m.num_moe_experts
    if experts is None:  # a dense model: megatron refuses MoE sizes without experts
        copied.update(moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None)
    moe_layer_freq = model_facts.moe_layer_freq(m.num_layers, experts, m.moe_first_k_dense_layers)
    on_gpu = torch.cuda.is_available()
    return GLMTransformerConfig(
        **copied,
        # MLA + DSA attention; the GLM-5 MLP is SwiGLU without biases.
        multi_latent_attention=True,
        experimental_attention_variant="dsa",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # MoE layer pattern and router precision (GLM-5 routes in FP32).
        moe_layer_freq=moe_layer_freq,
        moe_router_dtype="fp32" if experts else None,
        moe_enable_routing_replay=m.moe_router_replay,  # megatron's RouterReplay (recipes.replay)
        moe_grouped_gemm=grouped_experts(m.moe_grouped_gemm, policy, on_gpu),
        mtp_num_layers=m.mtp_num_layers or None,
        # Parallelism.
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=par.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=par.num_layers_in_last_pipeline_stage,
        context_parallel_size=par.context_parallel_size,
        # Our DSA's CP gathers the keys of the whole row (megatron's DSA allows only this type).
        cp_comm_type="all_gather" if par.context_parallel_size > 1 else None,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.expert_tensor_parallel_size,
        sequence_parallel=sequence_parallel(par),
        # Precision.
        precision=policy,
        bf16=policy.dtype == DType.bf16,
        params_dtype=policy.params_dtype,
        pipeline_dtype=policy.params_dtype,
        dsa_indexer_k_norm_fp32=policy.dsa_indexer_k_norm_fp32,  # megatron's own field
        deterministic_mode=cfg.train.deterministic,
        # Activation recompute (recipes/config/recompute.py validates the combination).
        **recompute_fields(cfg.train),
        # Whole-step CUDA graphs (recipes/train/cuda_graph.py); per-layer capture is not used.
        cuda_graph_impl=cfg.train.cuda_graph_impl.value,
        cuda_graph_modules=[],
        cuda_graph_warmup_steps=cfg.train.cuda_graph_warmup_steps,
        # megatron's schedules hand the main loss's backward scale to the indexer loss through it.
        experimental_attention_variant_loss_scale_func=(
            IndexerLossAutoScaler.set_loss_scale if copied["dsa_indexer_loss_coeff"] else None),
        # Kernels: the local backend uses plain torch ops (no apex/TE fusions but the weight
        # gradients' accumulation into DDP's main_grad). With cross_entropy_loss_fusion the model
        # is recipes.train.model's FusedLossGPTModel, whose loss is kpool_layers.loss's kernels;
        # megatron's own "native" fused loss never runs.
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=_wgrad_fusion(ddp),
        cross_entropy_loss_fusion=fused_cross_entropy(cfg.train.cross_entropy_fusion, on_gpu),
        cross_entropy_fusion_impl="native",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
