"""Tensor names and layouts: HF ``glm_moe_dsa`` / ``glm5_next`` checkpoints <-> our ``GPTModel``.

One :class:`TensorMap` per megatron state-dict tensor (TP = PP = EP = 1 names, the layout
``dist_checkpointing`` reshards from) names the HF tensors it is made of and the
:class:`Conversion` between the two layouts:

* :class:`Copy` - same tensor (most weights; the MLA projections keep their row order: HF's
  ``kv_a_proj_with_mqa`` is ``[kv_lora_rank latent; qk_rope_head_dim rope]`` like megatron's
  ``linear_kv_down_proj``, ``q_b_proj`` is per head ``[nope; rope]`` like ``linear_q_up_proj``,
  and both rotate their rope channels as interleaved pairs, which is our MLA rotary
  (megatron's ``mla_rotary_interleaved``).
* :class:`ConcatRows` - megatron's SwiGLU ``linear_fc1`` is ``[gate; up]`` stacked along rows;
  HF stores ``gate_proj`` and ``up_proj`` (dense MLP, every expert, the shared expert).
* :class:`IndexerRope` - the indexer rotates its first ``qk_rope_head_dim`` channels
  (rope-first). glm_moe_dsa rotates interleaved pairs ``(0,1), (2,3), ...``; a model with
  ``dsa_indexer_rope_interleaved = False`` rotates half-split pairs ``(i, i + rope/2)``. Permuting
  the rope rows of ``wq_b`` (per head), ``wk`` and the ``k_norm`` weight/bias to
  ``[0, 2, 4, ..., 1, 3, 5, ...]`` turns the first into the second (the LayerNorm commutes with a
  channel permutation), so the indexer scores are unchanged. Identity for interleaved models.

Layers: HF ``model.layers.{i}`` is megatron ``decoder.layers.{i}``; the MTP layer ``k`` is HF
``model.layers.{num_layers + k}`` (DeepSeek-V3 layout: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and the decoder-layer tensors) and megatron ``mtp.layers.{k}``. Its optional
``embed_tokens`` / ``shared_head.head`` copies are :attr:`Mapping.aliases`: megatron's MTP shares
the main embedding and output layer, so on import they must equal those, and export writes them.
Indexer tensors exist only on layers computing their top-k under IndexShare
(``dsa_indexer_topk_freq``, :func:`kpool_layers.model_facts.computes_topk`), as in both models.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kpool_layers import model_facts
from recipes.hf.config import SKIP_MTP_HINT


class Conversion(Protocol):
    """HF tensors (in :attr:`TensorMap.hf` order) <-> one megatron tensor."""

    def to_megatron(self, hf: list[torch.Tensor]) -> torch.Tensor: ...

    def to_hf(self, megatron: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class Copy:
    """The same tensor on both sides."""

    def to_megatron(self, hf: list[torch.Tensor]) -> torch.Tensor:
        (tensor,) = hf
        return tensor

    def to_hf(self, megatron: torch.Tensor) -> list[torch.Tensor]:
        return [megatron]


@dataclass(frozen=True)
class ConcatRows:
    """megatron = ``cat(hf, dim=0)`` of ``parts`` equal row blocks (SwiGLU ``[gate; up]``)."""

    parts: int = 2

    def to_megatron(self, hf: list[torch.Tensor]) -> torch.Tensor:
        if len(hf) != self.parts or len({t.shape for t in hf}) != 1:
            raise ValueError(f"ConcatRows needs {self.parts} equal-shaped tensors, got {[tuple(t.shape) for t in hf]}")
        return torch.cat(hf, dim=0)

    def to_hf(self, megatron: torch.Tensor) -> list[torch.Tensor]:
        return [part.contiguous() for part in megatron.chunk(self.parts, dim=0)]


def rope_deinterleave_order(head_dim: int, rope_dim: int) -> torch.Tensor:
    """Channel order taking interleaved rope pairs to half-split ones: evens, odds, then the rest."""
    rope = torch.arange(rope_dim)
    return torch.cat([rope[0::2], rope[1::2], torch.arange(rope_dim, head_dim)])


@dataclass(frozen=True)
class IndexerRope:
    """Rows ``[heads * head_dim]`` (dim 0) whose first ``rope_dim`` per head are HF-interleaved rope
    channels; ``interleaved`` (our ``dsa_indexer_rope_interleaved``) keeps them, else they are
    reordered with :func:`rope_deinterleave_order`."""

    heads: int
    head_dim: int
    rope_dim: int
    interleaved: bool

    def _permute(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        if self.interleaved or self.rope_dim == 0:
            return t
        rows = t.reshape(self.heads, self.head_dim, *t.shape[1:])
        return rows[:, order].reshape(t.shape).contiguous()

    def to_megatron(self, hf: list[torch.Tensor]) -> torch.Tensor:
        (tensor,) = hf
        return self._permute(tensor, rope_deinterleave_order(self.head_dim, self.rope_dim))

    def to_hf(self, megatron: torch.Tensor) -> list[torch.Tensor]:
        order = torch.argsort(rope_deinterleave_order(self.head_dim, self.rope_dim))
        return [self._permute(megatron, order)]


@dataclass(frozen=True)
class Conv1dWeight:
    """transformers' depthwise ``conv1d.weight [C, 1, K]`` <-> our ``[C, K]``."""

    def to_megatron(self, hf: list[torch.Tensor]) -> torch.Tensor:
        (tensor,) = hf
        if tensor.dim() != 3 or tensor.shape[1] != 1:
            raise ValueError(f"a depthwise conv1d weight is [C, 1, K], got {tuple(tensor.shape)}")
        return tensor[:, 0].contiguous()

    def to_hf(self, megatron: torch.Tensor) -> list[torch.Tensor]:
        return [megatron.unsqueeze(1).contiguous()]


@dataclass(frozen=True)
class TensorMap:
    """One megatron tensor and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    conversion: Conversion = field(default_factory=Copy)


@dataclass(frozen=True)
class Mapping:
    """Every tensor of one model: ``maps`` (1:1 with the megatron state dict) and ``aliases``
    (HF name -> the HF name it must equal: the MTP layers' embedding/head copies)."""

    maps: tuple[TensorMap, ...]
    aliases: dict[str, str]
    layers: int
    """HF layers ``model.layers.{i}`` the mapping covers: the decoder layers, then the MTP layers."""
    inert: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    """HF tensors that cannot change the HF model's output, name -> (shape, the value export
    writes): glm5_next's KPool gate and ape at ``index_kpool`` 1 (a softmax over one slot is 1).
    Import checks their shape; our model has no such parameter."""

    def hf_names(self) -> set[str]:
        """Every HF tensor name the mapping reads or writes (aliases and inert tensors included)."""
        return {name for m in self.maps for name in m.hf} | set(self.aliases) | set(self.inert)


def _indexer(model: Any, meg: str, hf: str) -> list[TensorMap]:
    rope = IndexerRope(model.dsa_indexer_n_heads, model.dsa_indexer_head_dim, model.qk_pos_emb_head_dim,
                       bool(model.dsa_indexer_rope_interleaved))
    key_rope = IndexerRope(1, model.dsa_indexer_head_dim, model.qk_pos_emb_head_dim,
                           bool(model.dsa_indexer_rope_interleaved))
    maps = [TensorMap(f"{meg}linear_wq_b.weight", (f"{hf}wq_b.weight",), rope),
            TensorMap(f"{meg}linear_wk.weight", (f"{hf}wk.weight",), key_rope),
            TensorMap(f"{meg}k_norm.weight", (f"{hf}k_norm.weight",), key_rope),
            TensorMap(f"{meg}k_norm.bias", (f"{hf}k_norm.bias",), key_rope),
            TensorMap(f"{meg}linear_weights_proj.weight", (f"{hf}weights_proj.weight",))]
    if model.dsa_indexer_kpool > 1:
        maps += [TensorMap(f"{meg}index_kpool_compress_gate.weight", (f"{hf}index_kpool_compress_gate",)),
                 TensorMap(f"{meg}index_kpool_compress_ape", (f"{hf}index_kpool_compress_ape",))]
    return maps


def _swiglu(meg: str, hf: str) -> list[TensorMap]:
    return [TensorMap(f"{meg}linear_fc1.weight", (f"{hf}gate_proj.weight", f"{hf}up_proj.weight"), ConcatRows()),
            TensorMap(f"{meg}linear_fc2.weight", (f"{hf}down_proj.weight",))]


def kda_maps(att: str, hatt: str) -> list[TensorMap]:
    """A KDA layer's attention (``kpool_layers.linear_attention.kda``; transformers'
    ``Glm5NextTextLinearAttention`` in its checkpoint names: forget gate and conv per q/k/v flat
    under ``self_attn``)."""
    names = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj", "linear_f_a": "f_a_proj",
             "linear_f_b": "f_b_proj", "linear_beta": "b_proj", "linear_g_a": "g_a_proj",
             "linear_g_b": "g_b_proj", "linear_proj": "o_proj"}
    maps = [TensorMap(f"{att}{ours}.weight", (f"{hatt}{theirs}.weight",)) for ours, theirs in names.items()]
    maps += [TensorMap(f"{att}conv_{x}", (f"{hatt}{x}_conv1d.weight",), Conv1dWeight()) for x in "qkv"]
    return maps + [TensorMap(f"{att}dt_bias", (f"{hatt}dt_bias",)),
                   TensorMap(f"{att}A_log", (f"{hatt}A_log",)),
                   TensorMap(f"{att}out_norm_weight", (f"{hatt}o_norm.weight",))]

def _hyper_connections(meg: str, hf: str) -> list[TensorMap]:
    """A layer's mHC weights: megatron ``attn_hc.fn`` is the checkpoint's ``hc_attn_fn`` (the
    names glm5_next checkpoints store; transformers renames them to ``attn_hc.fn`` on load)."""
    return [TensorMap(f"{meg}{block}_hc.{part}", (f"{hf}hc_{block}_{part}",))
            for block in ("attn", "ffn") for part in ("fn", "base", "scale")]


def layer_maps(model: Any, meg: str, hf: str, layer_number: int, moe: bool) -> list[TensorMap]:
    """One decoder layer: megatron prefix ``meg`` (``decoder.layers.3.``), HF prefix ``hf``
    (``model.layers.3.``), 1-indexed ``layer_number`` for the layer pattern (KDA or DSA,
    IndexShare; :class:`kpool_layers.model_facts.LayerPattern`)."""
    att, hatt = f"{meg}self_attention.", f"{hf}self_attn."
    pattern = model_facts.LayerPattern.of(model)
    if pattern.is_linear_attention(layer_number):
        maps = [TensorMap(f"{meg}input_layernorm.weight", (f"{hf}input_layernorm.weight",)),
                *kda_maps(att, hatt),
                TensorMap(f"{meg}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",))]
        return maps + _mlp_maps(model, meg, hf, moe)
    maps = [TensorMap(f"{meg}input_layernorm.weight", (f"{hf}input_layernorm.weight",)),
            TensorMap(f"{att}linear_q_down_proj.weight", (f"{hatt}q_a_proj.weight",)),
            TensorMap(f"{att}q_layernorm.weight", (f"{hatt}q_a_layernorm.weight",)),
            TensorMap(f"{att}linear_q_up_proj.weight", (f"{hatt}q_b_proj.weight",)),
            TensorMap(f"{att}linear_kv_down_proj.weight", (f"{hatt}kv_a_proj_with_mqa.weight",)),
            TensorMap(f"{att}kv_layernorm.weight", (f"{hatt}kv_a_layernorm.weight",)),
            TensorMap(f"{att}linear_kv_up_proj.weight", (f"{hatt}kv_b_proj.weight",)),
            TensorMap(f"{att}linear_proj.weight", (f"{hatt}o_proj.weight",)),
            TensorMap(f"{meg}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",))]
    if pattern.computes_topk(layer_number):
        maps += _indexer(model, f"{att}indexer.", f"{hatt}indexer.")
    return maps + _mlp_maps(model, meg, hf, moe)


def _mlp_maps(model: Any, meg: str, hf: str, moe: bool) -> list[TensorMap]:
    """A layer's mHC weights (with ``model.hc_mult``) and its dense MLP or MoE (router, every
    routed expert, the shared expert)."""
    maps: list[TensorMap] = _hyper_connections(meg, hf) if model.hc_mult is not None else []
    if not moe:
        return maps + _swiglu(f"{meg}mlp.", f"{hf}mlp.")
    maps += [TensorMap(f"{meg}mlp.router.weight", (f"{hf}mlp.gate.weight",)),
             TensorMap(f"{meg}mlp.router.expert_bias", (f"{hf}mlp.gate.e_score_correction_bias",))]
    for e in range(model.num_moe_experts):
        maps += _swiglu(f"{meg}mlp.experts.local_experts.{e}.", f"{hf}mlp.experts.{e}.")
    return maps + _swiglu(f"{meg}mlp.shared_experts.", f"{hf}mlp.shared_experts.")


def _check_supported(model: Any) -> None:
    if model.normalization != "RMSNorm":
        raise ValueError(f"model.normalization={model.normalization!r}: the HF models use RMSNorm")
    if not model.num_moe_experts or not model.moe_shared_expert_intermediate_size:
        raise ValueError("the HF GLM-5.x models are MoE with a shared expert: set model.num_moe_experts "
                         "and model.moe_shared_expert_intermediate_size")


def build_mapping(model: Any) -> Mapping:
    """The mapping for our ``model`` config group (``recipes.config.schema.ModelConfig`` or its node)."""
    _check_supported(model)
    n, experts = model.num_layers, model.num_moe_experts
    moe_freq = model_facts.moe_layer_freq(n, experts, model.moe_first_k_dense_layers)
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(n):
        maps += layer_maps(model, f"decoder.layers.{i}.", f"model.layers.{i}.", i + 1,
                           moe=model_facts.is_moe(i + 1, experts, moe_freq))
    maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",)))
    aliases: dict[str, str] = {}
    for k in range(model.mtp_num_layers):
        meg, hf = f"mtp.layers.{k}.", f"model.layers.{n + k}."
        maps += [TensorMap(f"{meg}enorm.weight", (f"{hf}enorm.weight",)),
                 TensorMap(f"{meg}hnorm.weight", (f"{hf}hnorm.weight",)),
                 TensorMap(f"{meg}eh_proj.weight", (f"{hf}eh_proj.weight",))]
        maps += layer_maps(model, f"{meg}mtp_model_layer.", hf, 1,
                           moe=model_facts.is_moe(n, experts, moe_freq))  # as the last layer
        maps.append(TensorMap(f"{meg}final_layernorm.weight", (f"{hf}shared_head.norm.weight",)))
        aliases[f"{hf}embed_tokens.weight"] = "model.embed_tokens.weight"
        aliases[f"{hf}shared_head.head.weight"] = (
            "lm_head.weight" if model.untie_embeddings_and_output_weights else "model.embed_tokens.weight")
    if model.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",)))
    return Mapping(maps=tuple(maps), aliases=aliases, layers=n + model.mtp_num_layers, inert=_inert_kpool(model))


def _inert_kpool(model: Any) -> dict[str, tuple[tuple[int, ...], float]]:
    """glm5_next builds ``index_kpool_compress_ape [1, D]`` (init 0) and ``_gate [D, hidden]``
    (init 1) in every indexer, also at ``index_kpool`` 1 where pooling one key is the identity;
    models with KDA layers are glm5_next models (:mod:`recipes.hf.config`)."""
    pattern = model_facts.LayerPattern.of(model)
    if model.dsa_indexer_kpool != 1 or not pattern.hybrid:
        return {}
    d = model.dsa_indexer_head_dim
    out: dict[str, tuple[tuple[int, ...], float]] = {}
    for n in pattern.topk_layers():
        prefix = f"model.layers.{n - 1}.self_attn.indexer."
        out[f"{prefix}index_kpool_compress_ape"] = ((1, d), 0.0)
        out[f"{prefix}index_kpool_compress_gate"] = ((d, model.hidden_size), 1.0)
    return out


HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
"""An HF decoder-layer tensor name (text layout); group 1 is the layer index."""


def layer_index(name: str) -> int | None:
    """The ``i`` of an HF tensor ``model.layers.{i}.*``; ``None`` for other tensors."""
    match = HF_LAYER.match(name)
    return int(match.group(1)) if match else None


def tensors_past(names: Iterable[str], layers: int) -> list[str]:
    """The tensors of HF layers ``model.layers.{i}`` with ``i >= layers``, sorted: a checkpoint's
    MTP layers (DeepSeek-V3 layout, stored after the decoder layers) that a mapping of ``layers``
    layers leaves out."""
    return sorted(n for n in names if (i := layer_index(n)) is not None and i >= layers)


def check_hf_names(mapping: Mapping, present: set[str], skip_mtp: bool = False) -> list[str]:
    """Raise naming every HF tensor the mapping needs but ``present`` lacks, and every tensor in
    ``present`` the mapping does not know (MTP aliases may be absent). ``skip_mtp``: the tensors
    of layers past the mapping's (:func:`tensors_past`) are left out, and returned so the caller
    can report them; without it they are unknown like any other, with the hint to skip them."""
    needed = {name for m in mapping.maps for name in m.hf}
    skipped = tensors_past(present, mapping.layers) if skip_mtp else []
    missing = sorted(needed - present)
    unknown = sorted(present - mapping.hf_names() - set(skipped))
    if missing or unknown:
        past = tensors_past(unknown, mapping.layers)
        hint = ""
        if past and not skip_mtp:
            first = layer_index(past[0])
            hint = (f"; {len(past)} of the unknown tensors belong to layers past the model's {mapping.layers} "
                    f"(model.layers.{first}.*: MTP layers): {SKIP_MTP_HINT}")
        raise KeyError(f"HF checkpoint does not match the model: missing {missing[:20]}"
                       f"{' ...' if len(missing) > 20 else ''} ({len(missing)}); unknown {unknown[:20]}"
                       f"{' ...' if len(unknown) > 20 else ''} ({len(unknown)}){hint}")
    return skipped
