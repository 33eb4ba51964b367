"""GLM-5.x self-attention: absorbed MLA + DSA sparse attention (indexer top-k), for the
``self_attention`` slot of megatron-core's ``TransformerLayer``.

Per layer (``n`` heads, ``n_l = n / TP`` of them on this rank, ``r = kv_lora_rank``,
``p = qk_pos_emb_head_dim``, ``d_k = r + p``)::

    q_latent = RMSNorm(W_dq x)                                   [s, b, q_lora_rank]
    q        = W_uq q_latent -> (q_nope [n, qk_head_dim], q_pe [n, p])
    kv       = W_dkv x -> (c = RMSNorm(.) [r], k_pe [p])          c is the latent key AND value
    query    = (q_nope @ W_uk) ++ rope(q_pe)                     [s, b, n_l, d_k]  (k-up absorbed)
    key      = c ++ rope(k_pe)                                   [s, b, 1, d_k]    (one MQA head)
    idx      = DSAIndexer(x, q_latent) top-k                     [b, s, W]
    o        = sparse_attention(query, key, idx)                 [s, b, n_l, r]
    out      = W_o ((o @ W_uv^T) flattened)                      [s, b, h]

``W_uk``/``W_uv`` are the per-head row blocks of ``linear_kv_up_proj.weight``
``[n_l * (qk_head_dim + v_head_dim), r]`` (megatron's layout, so checkpoints map one to one); the
linear itself is never called. The softmax scale is megatron's MLA scale
``mscale**2 / sqrt(qk_head_dim + p)`` with ``mscale = yarn_get_mscale(rotary_scaling_factor,
mscale_all_dim)`` (megatron applies it for either ``rope_type``; it is 1 unless ``mscale_all_dim``
is set). Rotary is MLA-interleaved (megatron's ``mla_rotary_interleaved=True``) on document-local
positions; the indexer gets the same tables with ``config.dsa_indexer_rope_interleaved``. NoPE
(``p == 0``) builds and applies no rotary anywhere.

Tensor / sequence parallelism (as megatron's absorbed MLA): q_up / kv_up are column-parallel and the
output projection row-parallel over heads. The down projections are column-parallel linears whose
outputs are gathered over TP (and scattered back to the local sequence slice under SP) so the
q/kv norms run on the local slice with ``sequence_parallel``-tagged weights. Queries cover the full
sequence on every rank (q_up gathers the SP input); the latent keys are gathered over the sequence
(SP) or passed through ``copy_to_tensor_model_parallel_region`` (TP without SP) so their gradient
sums over the heads of all ranks. The indexer sees the SP-gathered, detached ``x`` and ``q_latent``.

Packed THD (``packed_seq_params.qkv_format == 'thd'``, b == 1): positions restart at every document
of ``cu_seqlens_q`` (``cu_seqlens_q_padded`` when set, as megatron) and no query attends across a
document boundary. ``attention_mask`` is not read: attention is causal by construction and confined
to documents only through ``packed_seq_params``.

Context parallelism (``context_parallel_size > 1``, :mod:`kpool_layers.dsa.context_parallel`): the
layer gets this CP rank's rows of megatron's load-balanced split (two chunks of the row) and keeps
its queries local; the latent KV and ``k_pe`` (after the TP/SP gather) are gathered from all CP
ranks into sequence order, so every query attends over the selected keys of the whole row (their
gradient is reduce-scattered back). Positions, document boundaries (``cu_seqlens`` describe the
whole row) and the indexer's keys are global; the sparse-MLA core attention gets each query's
position (``query_pos``).

Top-k replay (``config.dsa_topk_replay``, :mod:`kpool_layers.dsa.replay`): computing layers attend
to the micro batch's recorded indices; the indexer runs only for its loss or a measurement. Recorded
indices without replay are only measured against (how much of them the indexer selects).

IndexShare (``dsa_indexer_topk_freq > 1``): the config's ``computes_topk`` / ``topk_source_layer``
(:mod:`kpool_layers.model_facts`, megatron's rule) decide the layers that compute top-k; skip layers
build no indexer and take their source layer's indices from a :class:`TopKShare` shared by all
layers built from one :func:`glm_attention_spec` (see its docstring for the lifetime rules).

Indexer loss (``dsa_indexer_loss_coeff > 0``, training with grad enabled, computing layers): the
KL loss of :func:`kpool_layers.dsa.indexer_loss.indexer_kl_loss` is attached to the attention output by
:class:`IndexerLossAutoScaler` (its gradient enters backward scaled like the main loss) and its
value is recorded for :func:`collect_indexer_losses`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import get_pg_size

from kpool_layers.compat.attention_slot import AttentionSlotLayer
from kpool_layers.config import GLMTransformerConfig
from kpool_layers.dsa.context_parallel import cp_size, gather_sequence, query_positions
from kpool_layers.dsa.core_attention import CORE_ATTENTION
from kpool_layers.dsa.backends import DSA
from kpool_layers.dsa.replay import TopKReplay
from kpool_layers.dsa.indexer import DSAIndexer, dsa_indexer_submodules
from kpool_layers.dsa.indexer_loss import indexer_kl_loss
from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear, computed_by_owner, role_spec
from kpool_layers.norm import SPNorm
from kpool_layers.precision.policy import Role
from kpool_layers.mla.rope import BoundRotary, Rotary, document_positions, yarn_get_mscale


KV_UP_NOTE = "absorbed: weight used directly (W_uk/W_uv batched matmuls) in the model dtype, never FP8"
"""Precision-map note of ``mla.kv_up``: its forward never runs."""


def mla_softmax_scale(config: GLMTransformerConfig) -> float:
    """megatron's MLA softmax scale: ``mscale**2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class IndexerLossAutoScaler(torch.autograd.Function):
    """Identity on the attention output whose backward also starts the indexer loss's backward.

    ``apply(output, loss)`` returns ``output``; in backward the loss receives the gradient
    ``main_loss_backward_scale`` (1 until :meth:`set_loss_scale` is called), so the auxiliary loss
    is scaled exactly like the main loss (loss scaling, 1 / num_microbatches). megatron's schedules
    call ``config.experimental_attention_variant_loss_scale_func`` after every forward step: set
    it to :meth:`set_loss_scale` when the indexer loss is on (``recipes.config.megatron`` does,
    once for the model's config).
    """

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: ANN001, ANN205
        (loss,) = ctx.saved_tensors
        scale = IndexerLossAutoScaler.main_loss_backward_scale
        # megatron's schedules pass a [1]-shaped scale (loss scale / num_microbatches).
        loss_grad = torch.ones_like(loss) if scale is None else scale.to(loss).reshape(()).expand_as(loss)
        return grad_output, loss_grad

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Gradient given to every indexer loss in the following backward passes."""
        IndexerLossAutoScaler.main_loss_backward_scale = scale.detach().clone()


class TopKShare:
    """Hands top-k indices from the IndexShare computing layer to the skip layers after it.

    Slots are keyed by the source layer number. They live on the forward's ``PackedSeqParams``
    when there is one (one set per micro batch, so pipeline schedules with several micro batches in
    flight and activation recomputation read the indices of their own micro batch), otherwise on
    this object (then the source layer's latest forward must belong to the same micro batch as the
    skip layer's forward or recomputation; true without pipeline parallelism, or when recomputed
    segments start on computing layers). Use one share per layer stack: MTP layers number from 1
    again, so build them from a separate :func:`glm_attention_spec`.
    """

    _ATTR = "_kpool_topk_share_slots"

    def __init__(self) -> None:
        self._slots: dict[int, torch.Tensor] = {}

    def _slots_for(self, packed_seq_params: Optional[PackedSeqParams]) -> dict[int, torch.Tensor]:
        if packed_seq_params is None:
            return self._slots
        per_share = packed_seq_params.__dict__.setdefault(self._ATTR, {})
        return per_share.setdefault(id(self), {})

    def put(self, layer_number: int, topk_indices: torch.Tensor,
            packed_seq_params: Optional[PackedSeqParams]) -> None:
        """Store computing layer ``layer_number``'s indices ``[b, s, W]``."""
        self._slots_for(packed_seq_params)[layer_number] = topk_indices

    def get(self, source_layer: int, packed_seq_params: Optional[PackedSeqParams]) -> torch.Tensor:
        """The indices stored by ``source_layer``; raises if it has not run in this forward."""
        slots = self._slots_for(packed_seq_params)
        if source_layer not in slots:
            raise RuntimeError(
                f"IndexShare: top-k of source layer {source_layer} is not available (it must run "
                f"before its skip layers on the same pipeline stage); stored: {sorted(slots)}"
            )
        return slots[source_layer]


@dataclass
class GLMSparseMLASubmodules:
    """Builders of :class:`GLMSparseMLA`'s parts (ModuleSpec or class each).

    Linears take megatron's ColumnParallelLinear (all but ``linear_proj``, incl. ``gather_output``)
    or RowParallelLinear (``linear_proj``) constructor arguments, e.g. Transformer Engine's
    ``TEColumnParallelLinear`` / ``TERowParallelLinear``; norms ``(config, hidden_size, eps)``; the
    indexer ``(config, layer_number)`` with :class:`kpool_layers.dsa.indexer.DSAIndexer`'s forward; the
    core attention ``(config, softmax_scale, v_channels)`` with
    :class:`kpool_layers.dsa.core_attention.SparseMLACore`'s forward.
    """

    linear_q_down_proj: ModuleSpec | type
    linear_q_up_proj: ModuleSpec | type
    linear_kv_down_proj: ModuleSpec | type
    linear_kv_up_proj: ModuleSpec | type
    linear_proj: ModuleSpec | type
    q_layernorm: ModuleSpec | type
    kv_layernorm: ModuleSpec | type
    indexer: ModuleSpec | type
    core_attention: ModuleSpec | type


class GLMSparseMLA(AttentionSlotLayer):
    """Absorbed MLA with DSA sparse attention; see the module docstring for the math.

    ``forward(hidden_states [s_cp/TP if SP else s_cp, b, h], ...)`` -> ``(output [same shape], None)``
    with ``s_cp = s / context_parallel_size`` (this CP rank's rows).

    Built by megatron's ``TransformerLayer`` from :func:`glm_attention_spec`: ``topk_share`` and
    ``attn_mask_type`` come from the spec's params; ``cp_comm_type``, ``pp_layer_offset`` and
    ``name`` are accepted for ``TransformerLayer``'s call and not used. With
    ``dsa_indexer_loss_coeff > 0`` the config's ``experimental_attention_variant_loss_scale_func``
    should be :meth:`IndexerLossAutoScaler.set_loss_scale` (the layer does not write the config).
    """

    def __init__(
        self,
        config: GLMTransformerConfig,
        submodules: GLMSparseMLASubmodules,
        layer_number: int,
        topk_share: Optional[TopKShare] = None,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        pg_collection: Optional[ProcessGroupCollection] = None,
        cp_comm_type: Optional[str] = None,
        pp_layer_offset: Optional[int] = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        _check_config(config, attn_mask_type)
        self.layer_number = layer_number
        self.pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["tp", "cp"])
        self.tp_group = self.pg_collection.tp
        self.cp_group = self.pg_collection.cp
        tp_size = get_pg_size(self.tp_group)
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        self.local_heads = config.num_attention_heads // tp_size
        self.softmax_scale = mla_softmax_scale(config)
        self.rotary = Rotary.from_config(config) if config.qk_pos_emb_head_dim > 0 else None

        shares = config.shares_topk
        if shares and topk_share is None:
            raise ValueError("IndexShare (dsa_indexer_topk_freq > 1 or shared dsa_indexer_types) needs a TopKShare "
                             "(build the layers from glm_attention_spec)")
        self.topk_share = topk_share if shares else None
        self.computes_topk = config.computes_topk(layer_number)
        self.source_layer = config.topk_source_layer(layer_number)

        def linear(spec: ModuleSpec | type, n_in: int, n_out: int, label: str,
                   **kwargs: Any) -> torch.nn.Module:
            return build_module(spec, n_in, n_out, config=config, init_method=config.init_method,
                                bias=False, skip_bias_add=False, is_expert=False,
                                tp_comm_buffer_name=label, tp_group=self.tp_group, **kwargs)

        qk = config.qk_head_dim + config.qk_pos_emb_head_dim
        n = config.num_attention_heads
        self.linear_q_down_proj = linear(submodules.linear_q_down_proj, config.hidden_size,
                                         config.q_lora_rank, "q_down_proj", gather_output=False)
        self.linear_q_up_proj = linear(submodules.linear_q_up_proj, config.q_lora_rank, n * qk,
                                       "q_up_proj", gather_output=False)
        self.linear_kv_down_proj = linear(submodules.linear_kv_down_proj, config.hidden_size,
                                          config.kv_lora_rank + config.qk_pos_emb_head_dim,
                                          "kv_down_proj", gather_output=False)
        self.linear_kv_up_proj = linear(submodules.linear_kv_up_proj, config.kv_lora_rank,
                                        n * (config.qk_head_dim + config.v_head_dim), "kv_up_proj",
                                        gather_output=False)
        # Absorbed: the weight is used directly (_kv_up_weights), the linear's forward never runs.
        computed_by_owner(self.linear_kv_up_proj, KV_UP_NOTE)
        self.linear_proj = build_module(
            submodules.linear_proj, n * config.v_head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj",
            tp_group=self.tp_group)
        self.q_layernorm = build_module(submodules.q_layernorm, config=config,
                                        hidden_size=config.q_lora_rank,
                                        eps=config.mla_latent_norm_eps)
        self.kv_layernorm = build_module(submodules.kv_layernorm, config=config,
                                         hidden_size=config.kv_lora_rank,
                                         eps=config.mla_latent_norm_eps)
        self.indexer = (build_module(submodules.indexer, config=config, layer_number=layer_number)
                        if self.computes_topk else None)
        self.core_attention = build_module(submodules.core_attention, config=config,
                                           softmax_scale=self.softmax_scale,
                                           v_channels=config.kv_lora_rank)

        self.uses_indexer_loss = bool(config.dsa_indexer_loss_coeff) and self.computes_topk
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0

    def attend(self, hidden_states: torch.Tensor, packed_seq_params: Optional[PackedSeqParams],
               cu_seqlens: Optional[torch.Tensor]) -> tuple[torch.Tensor, None]:
        """``hidden_states [s_local, b, h]`` -> ``(output [s_local, b, h], None)``.

        ``s_local = s_cp / TP`` under sequence parallelism, else ``s_cp`` (this CP rank's rows).
        Only ``packed_seq_params`` (THD, ``cu_seqlens`` its boundaries) changes the computation;
        the base's ``forward`` takes ``TransformerLayer``'s arguments and rejects inference,
        cross-attention and external rotary.
        """
        cfg = self.config

        q_latent = self.q_layernorm(self._down(self.linear_q_down_proj, hidden_states,
                                               cfg.q_lora_rank))
        kv = self._down(self.linear_kv_down_proj, hidden_states,
                        cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim)
        kv_latent, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv_latent = self._full_sequence(self.kv_layernorm(kv_latent))  # [s_cp, b, r]
        s, b = kv_latent.shape[:2]  # this CP rank's query rows
        query_pos = query_positions(s, self.cp_group, kv_latent.device)  # None without CP
        s_kv = s * cp_size(self.cp_group)  # keys: the whole row
        key_positions, doc_start = document_positions(s_kv, cu_seqlens, kv_latent.device)
        key_start = doc_start if query_pos is None else doc_start[query_pos]
        # The query rows' positions; None: 0 .. s - 1 (one document, no CP: cached rotary tables).
        positions = None
        if cu_seqlens is not None or query_pos is not None:
            positions = key_positions if query_pos is None else key_positions[query_pos]

        q, _ = self.linear_q_up_proj(q_latent)  # [s, b, n_l * qk]
        q = q.view(s, b, self.local_heads, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
        q_nope, q_pe = q.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        k_up, v_up = self._kv_up_weights()
        query = torch.einsum("sbnd,ndc->sbnc", q_nope, k_up)  # [s, b, n_l, r]
        key = kv_latent.unsqueeze(2)  # [s, b, 1, r]
        if self.rotary is not None:
            rotate = self._rotary_fn(positions, s, kv_latent.device, mla_interleaved=True)
            k_pe = self._full_sequence(k_pe).unsqueeze(2)  # [s, b, 1, p]
            query, key = rotate.concat((query, key), (q_pe, k_pe))  # cat(latent, rotated pe)
        key = gather_sequence(key, self.cp_group)  # [s_kv, b, 1, d_k]

        topk_indices, indexer_out = self._topk(hidden_states, q_latent, positions, cu_seqlens,
                                               packed_seq_params)
        slot_mass = None  # the sparse indexer-loss target, from the attention's own forward
        if (indexer_out is not None and cfg.dsa_indexer_use_sparse_loss
                and self.core_attention.provides_slot_probs):
            latent_out, slot_mass = self.core_attention(query, key, topk_indices, key_start,
                                                        query_pos, return_slot_probs=True)
        else:
            latent_out = self.core_attention(query, key, topk_indices, key_start,
                                             query_pos)  # [s, b, n_l, r]
        if indexer_out is not None:
            loss = indexer_kl_loss(self.indexer, indexer_out, query, key, self.softmax_scale,
                                   sparse=cfg.dsa_indexer_use_sparse_loss, cu_seqlens=cu_seqlens,
                                   slot_mass=slot_mass)
            self._record_loss(loss)
            latent_out = IndexerLossAutoScaler.apply(latent_out, loss)
        out = torch.einsum("sbnc,nvc->sbnv", latent_out, v_up).reshape(s, b, -1)
        output, _ = self.linear_proj(out)
        return output, None

    def _down(self, linear: torch.nn.Module, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """Down projection to ``[s_local, b, width]`` (full width, this rank's sequence slice;
        :meth:`full_width`)."""
        out, _ = linear(hidden)
        return self.full_width(out, width)

    def _full_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (this rank's sequence slice under SP) for the full sequence, with backward summing
        the gradient contributions of all TP ranks' heads."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, group=self.tp_group)
        return copy_to_tensor_model_parallel_region(x, group=self.tp_group)

    def _kv_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk [n_l, qk_head_dim, r]`` and ``W_uv [n_l, v_head_dim, r]`` views of kv_up."""
        cfg = self.config
        weight = self.linear_kv_up_proj.weight.view(
            self.local_heads, cfg.qk_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return weight.split([cfg.qk_head_dim, cfg.v_head_dim], dim=1)

    def _rotary_fn(self, positions: Optional[torch.Tensor], s: int, device: torch.device, *,
                   mla_interleaved: bool) -> BoundRotary:
        """The rotary of the ``s`` query rows at ``positions`` (None: ``0 .. s - 1``, whose tables
        are built once for all layers and micro batches)."""
        if positions is None:
            return self.rotary.bind_arange(s, device, mla_interleaved=mla_interleaved)
        return self.rotary.bind(positions, mla_interleaved=mla_interleaved)

    def _topk(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], packed_seq_params: Optional[PackedSeqParams]
              ) -> tuple[torch.Tensor, Any]:
        """Top-k ``[b, s, W]`` (own indexer or IndexShare source) and the indexer output when the
        indexer loss is computed in this forward (else None); ``positions`` as :meth:`_rotary_fn`'s."""
        if not self.computes_topk:
            return self.topk_share.get(self.source_layer, packed_seq_params), None
        replay = self._replay(packed_seq_params)
        with_loss = self.uses_indexer_loss and self.training and torch.is_grad_enabled()
        replaying = replay is not None and self.config.dsa_topk_replay
        if replaying and not (with_loss or replay.measure):  # the indexer is not needed
            replayed = replay.for_layer(self.layer_number, self.config.dsa_indexer_output_width)
            if self.topk_share is not None:
                self.topk_share.put(self.layer_number, replayed, packed_seq_params)
            return replayed, None
        hidden, q_latent = hidden.detach(), q_latent.detach()
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
            q_latent = gather_from_sequence_parallel_region(q_latent, group=self.tp_group)
        rotary_fn: Optional[BoundRotary] = None
        if self.rotary is not None:
            rotary_fn = self._rotary_fn(positions, q_latent.size(0), q_latent.device,
                                        mla_interleaved=self.config.dsa_indexer_rope_interleaved)
        with torch.set_grad_enabled(with_loss):
            out = self.indexer(hidden, q_latent, rotary_fn, cu_seqlens)
        if replay is not None:
            recorded = replay.for_layer(self.layer_number, out.topk_indices.shape[-1])
            if replay.measure:
                replay.record_overlap(self.layer_number, out.topk_indices, recorded)
            if replaying:  # attend to (and take the loss's sparse target on) the replayed keys
                out = dataclasses.replace(out, topk_indices=recorded)
        if self.topk_share is not None:
            self.topk_share.put(self.layer_number, out.topk_indices, packed_seq_params)
        return out.topk_indices, (out if with_loss else None)

    def _replay(self, packed_seq_params: Optional[PackedSeqParams]) -> Optional[TopKReplay]:
        """The micro batch's recorded top-k (None if none; required by ``config.dsa_topk_replay``)."""
        replay = TopKReplay.of(packed_seq_params)
        if replay is None and self.config.dsa_topk_replay:
            raise ValueError("dsa_topk_replay needs recorded top-k on the forward's packed_seq_params "
                             "(kpool_layers.dsa.replay.TopKReplay.attach)")
        return replay

    def _record_loss(self, loss: torch.Tensor) -> None:
        """Accumulate the KL per query of this rank's rows (``loss / dsa_indexer_loss_coeff``,
        whose mean is over the whole row, times the CP size) for ``collect_indexer_losses``."""
        kl = loss.detach() / self.config.dsa_indexer_loss_coeff * cp_size(self.cp_group)
        self._loss_sum = kl if self._loss_sum is None else self._loss_sum + kl
        self._loss_count += 1

    def pop_indexer_loss(self) -> Optional[float]:
        """Mean KL recorded since the last call (None if none), and reset."""
        if self._loss_count == 0:
            return None
        mean = float(self._loss_sum) / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        return mean


def collect_indexer_losses(model: torch.nn.Module) -> dict[str, float]:
    """Per-layer indexer KL (mean over the forwards since the last call, before
    ``dsa_indexer_loss_coeff``), keyed by the attention module's qualified name in ``model``;
    resets the records. Values are this rank's (identical across TP; reduce over DP/PP for
    logging yourself). Call once per optimizer step (it synchronises with the device)."""
    losses = {}
    for name, module in model.named_modules():
        if isinstance(module, GLMSparseMLA):
            value = module.pop_indexer_loss()
            if value is not None:
                losses[name] = value
    return losses


def _check_config(config: GLMTransformerConfig, attn_mask_type: AttnMaskType) -> None:
    if config.q_lora_rank is None:
        raise ValueError("GLMSparseMLA needs q_lora_rank (the indexer reads the query latent)")
    if config.add_bias_linear:
        raise ValueError("GLMSparseMLA has no linear biases; set add_bias_linear=False")
    if not config.dsa_indexer_topk:
        raise ValueError("GLMSparseMLA needs dsa_indexer_topk > 0")
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"GLMSparseMLA is causal self-attention, got {attn_mask_type}")


def glm_attention_spec(config: GLMTransformerConfig,
                       topk_share: Optional[TopKShare] = None) -> ModuleSpec:
    """``self_attention`` spec for the local backend (megatron's parallel linears tagged with their
    precision roles, :mod:`kpool_layers.precision.linears`; SP norms), with the sparse MLA core attention,
    the indexer's role-tagged parts and its top-k kernel of ``config.dsa_kernels``.

    All layers built from the returned spec share one :class:`TopKShare` (a new one unless given),
    which is what IndexShare needs; build MTP layers from a separate call.
    """
    backend = config.dsa_kernels
    return ModuleSpec(
        module=GLMSparseMLA,
        params={"topk_share": topk_share or TopKShare(), "attn_mask_type": AttnMaskType.causal},
        submodules=GLMSparseMLASubmodules(
            linear_q_down_proj=role_spec(RoleColumnParallelLinear, Role.MLA_Q_DOWN),
            linear_q_up_proj=role_spec(RoleColumnParallelLinear, Role.MLA_Q_UP),
            linear_kv_down_proj=role_spec(RoleColumnParallelLinear, Role.MLA_KV_DOWN),
            linear_kv_up_proj=role_spec(RoleColumnParallelLinear, Role.MLA_KV_UP),
            linear_proj=role_spec(RoleRowParallelLinear, Role.MLA_OUT),
            q_layernorm=SPNorm,
            kv_layernorm=SPNorm,
            indexer=ModuleSpec(module=DSAIndexer, params={"range_topk": DSA.take(backend).kernel(
                config.dsa_indexer_query_chunk_size)}, submodules=dsa_indexer_submodules()),
            core_attention=CORE_ATTENTION[backend],
        ),
    )
