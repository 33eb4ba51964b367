"""Builds the GLM-5.x megatron-core model for this pipeline stage, and counts its parameters.

We use megatron-core's ``GPTModel`` (not ``HybridModel``): a GLM-5 layer is attention + MLP/MoE in
one ``TransformerLayer``, exactly like the released checkpoints' ``model.layers.N``, and GPTModel
takes a per-layer ``TransformerBlockSubmodules`` and an MTP block spec directly. See docs/design.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from kpool_layers.compat import cpu as _cpu
from kpool_layers.mla.attention import glm_attention_spec
from kpool_layers.config import GLMTransformerConfig
from kpool_layers import chunked_loss
from kpool_layers.loss import LOSS
from kpool_layers.precision.linears import assign_gpt_roles
from kpool_layers.spec import glm_decoder_block_spec, glm_mtp_block_spec
from recipes.config.schema import Config


def build_gpt_model(cfg: Config, tcfg: GLMTransformerConfig) -> GPTModel:
    """The ``GPTModel`` for this rank's pipeline stage (embedding on the first, head on the last),
    every linear tagged with its precision role (``kpool_layers.precision.linears``); with
    ``tcfg.cross_entropy_loss_fusion`` its loss is ``kpool_layers.loss``'s kernels
    (:class:`kpool_layers.loss.FusedLossGPTModel`, the route :data:`kpool_layers.loss.LOSS`); with
    ``cfg.train.loss_chunk_tokens`` its head runs in chunks (:mod:`kpool_layers.chunked_loss`)."""
    attention = glm_attention_spec(tcfg)
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    chunk = cfg.train.loss_chunk_tokens
    model_class = (chunked_loss.model_class(tcfg.cross_entropy_loss_fusion, chunk) if chunk else
                   LOSS.backend("triton" if tcfg.cross_entropy_loss_fusion else "megatron").load())
    model = model_class(
        **({"loss_chunk_tokens": chunk} if chunk else {}),
        config=tcfg,
        transformer_layer_spec=glm_decoder_block_spec(tcfg, attention, pp_rank=ps.get_pipeline_model_parallel_rank()),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",  # MLA applies its own rotary (or none: NoPE)
        # MTP layers number from 1 again: their own spec keeps their top-k share separate.
        mtp_block_spec=glm_mtp_block_spec(tcfg, glm_attention_spec(tcfg)) if post else None,
    )
    assign_gpt_roles(model)  # embedding / output layer: GPTModel builds them from no spec
    return model


@contextlib.contextmanager
def meta_init(tcfg: GLMTransformerConfig) -> Iterator[None]:
    """Build without memory: parameters on the ``meta`` device, no initialisation."""
    saved = (tcfg.use_cpu_initialization, tcfg.perform_initialization)
    tcfg.use_cpu_initialization, tcfg.perform_initialization = True, False
    try:
        with torch.device("meta"), _cpu.redirect_cuda_to("meta"):
            yield
    finally:
        tcfg.use_cpu_initialization, tcfg.perform_initialization = saved


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the full (unsharded) model, from a meta build at TP = PP = EP = 1."""

    total: int
    active_per_token: int
    embedding: int
    mtp: int


def count_parameters(model: GPTModel, tcfg: GLMTransformerConfig) -> ParamCount:
    """Total parameters and those a token touches (routed experts: top-k of them)."""
    total = expert = 0
    embedding = mtp = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name:
            expert += n
        if name.startswith("embedding.") or name.startswith("output_layer."):
            embedding += n
        if name.startswith("mtp."):
            mtp += n
    active = total
    if expert:  # routed experts exist only on MoE layers
        active = total - expert + expert * tcfg.moe_router_topk // tcfg.num_moe_experts
    return ParamCount(total=total, active_per_token=active, embedding=embedding, mtp=mtp)
