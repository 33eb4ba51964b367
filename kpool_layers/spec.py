"""Layer and block specs for GLM-5.x decoders on megatron-core's ``TransformerLayer``.

Each layer is megatron's ``TransformerLayer`` with our attention in the ``self_attention`` slot
(``kpool_layers.mla.attention``'s DSA MLA, or ``kpool_layers.linear_attention.kda``'s KDA on the
layers megatron's ``linear_attention_freq`` makes linear-attention layers), megatron's dense ``MLP`` for the first ``moe_layer_freq == 0`` layers
and megatron's ``MoELayer`` (router, experts, shared expert, token dispatcher) for the rest, as
:class:`kpool_layers.moe.layer.GLMMoELayer` (megatron's allgather dispatch without host syncs
where all experts are local).
The modules are megatron's local backend (ColumnParallelLinear/RowParallelLinear, runs anywhere,
no Transformer Engine) with the sequence-parallel capable ``SPNorm`` norms. With
``config.moe_grouped_gemm`` the routed experts are
:class:`kpool_layers.moe.experts.GroupedExperts` (grouped GEMMs), else megatron's
``SequentialMLP``.

Precision roles are decided here, by the spec: every linear of the MLP, the routed experts
(``SequentialMLP`` builds its experts from the ``MLPSubmodules`` given), the shared expert and the
router is a role-tagged class of :mod:`kpool_layers.precision.linears` (``mlp.fc1/fc2``,
``moe.expert_fc1/fc2``, ``moe.shared_fc1/fc2``, ``moe.router``); the attention's roles come from
``kpool_layers.mla.attention.glm_attention_spec``. The router is
:class:`kpool_layers.moe.router.FusedTopKRouter`: megatron's ``TopKRouter`` (role-tagged) with the
fused routing where the configuration allows it. ``GroupedExperts`` has no linears: it computes the
``moe.expert_fc1/fc2`` roles of ``config.precision`` itself (``kpool_layers.moe.grouped_gemm``).
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from functools import partial

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.linear_attention.kda import kda_spec
from kpool_layers.hyper_connections.layer import hyper_connected_spec
from kpool_layers.moe.experts import GroupedExperts
from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear, role_builder
from kpool_layers.moe.router import FusedTopKRouter
from kpool_layers.norm import SPNorm
from kpool_layers.precision.policy import Role
from kpool_layers.moe.layer import GLMMoELayer


class SPLocalSpecProvider(LocalSpecProvider):
    """megatron's local backend with norms that accept sequence parallelism and grouped experts
    that need no Transformer Engine."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):  # noqa: ANN201
        return SPNorm

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):  # noqa: ANN201 (megatron ExpertsBuilder)
        if moe_use_grouped_gemm:
            return GroupedExperts
        return super().grouped_mlp_modules(moe_use_grouped_gemm)


def _mlp_submodules(fc1: Role, fc2: Role) -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=role_builder(RoleColumnParallelLinear, fc1),
                         linear_fc2=role_builder(RoleRowParallelLinear, fc2))


def glm_mlp_spec(config: GLMTransformerConfig, moe: bool):  # noqa: ANN201 (megatron MlpBuilder)
    """megatron's dense ``MLP``, or its ``MoELayer`` (router, routed experts, shared expert; as
    :class:`~kpool_layers.moe.layer.GLMMoELayer`), on the
    local backend with role-tagged linears; what ``get_mlp_module_spec_for_backend`` builds for the
    local backend, roles added."""
    if not moe:
        return partial(MLP.as_mlp_submodule, submodules=_mlp_submodules(Role.MLP_FC1, Role.MLP_FC2))
    experts = (GroupedExperts if config.moe_grouped_gemm else
               partial(SequentialMLP, submodules=_mlp_submodules(Role.MOE_EXPERT_FC1, Role.MOE_EXPERT_FC2)))
    shared = partial(SharedExpertMLP, submodules=_mlp_submodules(Role.MOE_SHARED_FC1, Role.MOE_SHARED_FC2))
    return partial(GLMMoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared,
                                                      router=FusedTopKRouter))


def glm_layer_spec(config: GLMTransformerConfig, attention: ModuleSpec, moe: bool) -> ModuleSpec:
    """One decoder layer: pre-norm attention + pre-norm dense MLP or MoE, residual adds."""
    provider = SPLocalSpecProvider()
    mlp = glm_mlp_spec(config, moe)
    norm = provider.layer_norm(rms_norm=config.normalization == "RMSNorm")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def layer_attention_spec(config: GLMTransformerConfig, attention: ModuleSpec, layer_number: int) -> ModuleSpec:
    """The ``self_attention`` spec of decoder layer ``layer_number``: KDA
    (:func:`kpool_layers.linear_attention.kda.kda_spec`) where megatron's ``linear_attention_freq``
    makes it a linear-attention layer, else ``attention`` (the DSA MLA spec)."""
    if config.is_linear_attention(layer_number):
        return kda_spec(config)
    return attention


def glm_decoder_block_spec(
    config: GLMTransformerConfig, attention: ModuleSpec, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The layers this pipeline stage builds (all of them when PP = 1) and the final norm. Each
    layer's spec is chosen by its number: KDA or DSA attention (:func:`layer_attention_spec`),
    dense MLP or MoE (``moe_layer_freq``); with ``config.hc_mult`` each layer carries mHC streams
    (:func:`kpool_layers.hyper_connections.layer.hyper_connected_spec`); megatron's
    ``TransformerBlock`` builds the list."""
    layers = [hyper_connected_spec(config, glm_layer_spec(config, layer_attention_spec(config, attention, n),
                                                          config.is_moe(n)), n)
              for n in range(1, config.num_layers + 1)]
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    per_stage = get_num_layers_to_build(config, pp_rank=pp_rank)  # uneven first/last stages too
    return TransformerBlockSubmodules(
        layer_specs=layers[offset : offset + per_stage],
        layer_norm=SPLocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm"),
    )


def glm_mtp_block_spec(  # noqa: ANN201 (MultiTokenPredictionBlockSubmodules | None)
    config: GLMTransformerConfig, attention: ModuleSpec
):
    """megatron's MTP block built from the last decoder layer's spec (GLM-5: one MTP layer)."""
    if not config.mtp_num_layers:
        return None
    last = glm_layer_spec(config, attention, config.is_moe(config.num_layers))
    return get_gpt_mtp_block_spec_for_backend(config=config, spec=last, backend=SPLocalSpecProvider())
