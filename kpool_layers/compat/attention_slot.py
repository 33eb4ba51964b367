"""A layer for the ``self_attention`` slot of megatron-core's ``TransformerLayer`` that computes
causal self-attention over megatron's TP / SP layout and reads only ``packed_seq_params`` of the
slot's forward arguments: the base of ``GLMSparseMLA`` and ``KimiDeltaAttention``.

``TransformerLayer`` calls every layer in the slot with megatron's ``SelfAttention.forward``
arguments. :meth:`AttentionSlotLayer.forward` takes them, refuses by name those such a layer does
not implement (cross-attention, inference, external rotary, attention bias, a sequence offset),
finds the packed THD document boundaries and calls the subclass's :meth:`~AttentionSlotLayer.attend`.
``attention_mask`` and ``position_ids`` are not read (causal; positions come from
``packed_seq_params``).

Layout: ``hidden_states [s_local, b, h]``, ``s_local = s / TP`` under sequence parallelism (the
subclass sets ``sequence_parallel``: ``config.sequence_parallel`` with TP > 1), else ``s``.
:meth:`~AttentionSlotLayer.full_width` brings a column-parallel projection's output back to this
layout at its full width.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


def thd_boundaries(packed_seq_params: Optional[PackedSeqParams]) -> Optional[Tensor]:
    """The document boundaries of a packed THD batch (``qkv_format == 'thd'``):
    ``cu_seqlens_q_padded`` when set, else ``cu_seqlens_q`` (as megatron), int ``[N + 1]``; None
    for a BSHD batch."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None
    padded = packed_seq_params.cu_seqlens_q_padded
    return padded if padded is not None else packed_seq_params.cu_seqlens_q


class AttentionSlotLayer(MegatronModule):
    """Base of a causal self-attention layer for ``TransformerLayer``'s ``self_attention`` slot
    (module docstring). Subclasses set ``tp_group`` and ``sequence_parallel`` and implement
    :meth:`attend`."""

    tp_group: Any
    sequence_parallel: bool

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        key_value_states: Optional[Tensor] = None,
        inference_context: Any = None,
        rotary_pos_emb: Any = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        position_ids: Optional[Tensor] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params: Any = None,
    ) -> tuple[Tensor, None]:
        """``hidden_states [s_local, b, h]`` -> ``(output [s_local, b, h], None)`` by
        :meth:`attend`. Raises ValueError naming the layer's class and the given arguments it does
        not support, and for a packed THD batch whose batch size (dim 1) is not 1."""
        unsupported = dict(key_value_states=key_value_states, inference_context=inference_context,
                           inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
                           rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                           rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                           sequence_len_offset=sequence_len_offset)
        given = [key for key, value in unsupported.items() if value is not None]
        if given:
            raise ValueError(f"{type(self).__name__} does not support {given}")
        cu_seqlens = thd_boundaries(packed_seq_params)
        if cu_seqlens is not None and hidden_states.size(1) != 1:
            raise ValueError(f"packed THD needs batch size 1, got {hidden_states.size(1)}")
        return self.attend(hidden_states, packed_seq_params, cu_seqlens)

    def attend(self, hidden_states: Tensor, packed_seq_params: Optional[PackedSeqParams],
               cu_seqlens: Optional[Tensor]) -> tuple[Tensor, None]:
        """The layer: ``hidden_states [s_local, b, h]`` -> ``(output [s_local, b, h], None)``;
        ``cu_seqlens`` the THD document boundaries (:func:`thd_boundaries`) or None."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")

    def full_width(self, out: Tensor, width: int) -> Tensor:
        """A column-parallel linear's output -> ``[s_local, b, width]`` (full width, this rank's
        sequence slice).

        A column-parallel linear yields ``[s, b, width / TP]`` (its SP input gathered): gather the
        channels over TP, then scatter the sequence back under SP. An output that already has the
        full width (TP = 1, or a linear duplicated on every rank) is this rank's slice as is."""
        if out.size(-1) != width:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
            if self.sequence_parallel:
                out = scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out
