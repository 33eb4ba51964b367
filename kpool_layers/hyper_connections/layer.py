"""mHC around megatron's ``TransformerLayer``: the decoder layer of a model with ``hc_mult`` set.

:func:`hyper_connected_spec` turns a layer spec into one of :class:`HyperConnectedTransformerLayer`
at build time (``config.hc_mult`` None leaves the spec as it is). The layer carries the residual
as ``N = hc_mult`` streams ``[s, b, N, h]`` (``s / TP`` under sequence parallelism, like megatron's
``[s, b, h]``) and runs megatron's own attention and MLP paths on the block inputs::

    post, comb, x = attn_hc(streams);  streams = post (x) attention(input_layernorm(x)) + comb^T streams
    post, comb, x = ffn_hc(streams);   streams = post (x) mlp(pre_mlp_layernorm(x)) + comb^T streams

(transformers' ``Glm5NextTextDecoderLayer``). megatron's ``_forward_attention`` / ``_forward_mlp``
do the norms, the attention and MLP calls, selective recompute (``mlp``, ``moe``,
``shared_experts``) and MoE's packed-sequence handling; their bias-dropout-add is
:func:`block_output_bda`, which adds no residual (the streams are mixed here instead). The first
decoder layer (``expand_input``) takes the embeddings ``[s, b, h]`` and makes the ``N`` copies;
the last (``collapse_output``) returns the streams' mean ``[s, b, h]``, which megatron's block
normalises with its final norm (transformers' ``Glm5NextTextHyperHead`` before ``norm``). Between
pipeline stages the stream tensor ``[s, b, N, h]`` crosses as it is
(:mod:`kpool_layers.hyper_connections.pipeline` gives megatron's schedules its shape).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.hyper_connections.mhc import HyperConnection, collapse_streams, expand_streams, mix_streams


def _bias_dropout(training: bool) -> Callable[..., Tensor]:
    def bias_dropout(x_with_bias: tuple[Tensor, Optional[Tensor]], residual: Tensor, prob: float) -> Tensor:
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        return torch.nn.functional.dropout(x, p=prob, training=training) if prob > 0 else x
    return bias_dropout


def block_output_bda(training: bool, fused: bool) -> Callable[..., Tensor]:
    """megatron's bias-dropout-add builder (``get_bias_dropout_add``'s signature) without the add:
    ``f((x, bias), residual, p) = dropout(x + bias, p)``; the residual is the streams, which
    :class:`HyperConnectedTransformerLayer` mixes itself."""
    return _bias_dropout(training)


class HyperConnectedTransformerLayer(TransformerLayer):
    """megatron's ``TransformerLayer`` on ``hc_mult`` residual streams (module docstring):
    ``forward(hidden_states [s, b, N, h], **megatron's layer kwargs) -> ([s, b, N, h], context)``;
    with ``expand_input`` the input is ``[s, b, h]``, with ``collapse_output`` the output is.
    Parameters beyond megatron's: ``attn_hc`` and ``ffn_hc`` (:class:`HyperConnection`,
    transformers' names)."""

    def __init__(self, config: GLMTransformerConfig, *args: Any, expand_input: bool = False,
                 collapse_output: bool = False, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.expand_input, self.collapse_output = expand_input, collapse_output
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Optional[Tensor]]:
        streams = expand_streams(hidden_states, self.attn_hc.hc_mult) if self.expand_input else hidden_states
        post, comb, block_input = self.attn_hc(streams)
        attention_output, context = self._forward_attention(block_input, *args, **kwargs)
        streams = mix_streams(post, comb, attention_output, streams)
        post, comb, block_input = self.ffn_hc(streams)
        mlp_output = self._forward_mlp(block_input, kwargs.get("inference_context"),
                                       padding_mask=kwargs.get("padding_mask"),
                                       packed_seq_params=kwargs.get("packed_seq_params"))
        streams = mix_streams(post, comb, mlp_output, streams)
        output = collapse_streams(streams) if self.collapse_output else streams
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True), context


def hyper_connected_spec(config: GLMTransformerConfig, spec: ModuleSpec, layer_number: int) -> ModuleSpec:
    """Decoder layer ``layer_number`` (1-based, global) of ``spec`` (a ``TransformerLayer`` spec)
    with mHC when ``config.hc_mult`` is set: :class:`HyperConnectedTransformerLayer` with the same
    submodules but :func:`block_output_bda`, expanding on layer 1 and collapsing on the last."""
    if config.hc_mult is None:
        return spec
    if spec.module is not TransformerLayer:
        raise ValueError(f"hc_mult={config.hc_mult} wraps megatron's TransformerLayer, not {spec.module}")
    submodules = dataclasses.replace(spec.submodules, self_attn_bda=block_output_bda, mlp_bda=block_output_bda)
    return ModuleSpec(module=HyperConnectedTransformerLayer, submodules=submodules,
                      params={**spec.params, "expand_input": layer_number == 1,
                              "collapse_output": layer_number == config.num_layers})
