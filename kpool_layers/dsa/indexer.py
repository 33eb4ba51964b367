"""The DSA lightning indexer (DeepSeek-V3.2 / GLM-5), plain and KPool (pooled keys).

Per token ``t`` of a row (megatron's sequence-first layout, ``[s, b, ...]``):

    q[t]  = W_q  q_latent[t]            [n_heads, head_dim]   q_latent: RMS-normalised MLA query latent
    k[t]  = LayerNorm(W_k hidden[t])    [head_dim]            one shared key per token
    w[t]  = W_w hidden[t] * n_heads**-0.5 * head_dim**-0.5    [n_heads]
    rotary on the first qk_pos_emb_head_dim channels of q and k (none under NoPE);
    key[j] = the token key k[j] (plain DSA) or the pooled key of :mod:`kpool_layers.dsa.kpool`
             (``kpool > 1``, pooled from the token keys after rotary),
    then optionally (``dsa_indexer_rotate_activation``) a Hadamard rotation of q and key[j]:
             for ``kpool > 1`` after pooling, as upstream Megatron-LM and SGLang rotate;
    score(t, j) = sum_h w[t, h] * act(q[t, h] . key[j]),   act = ReLU or identity,

causal (and per document for packed THD). Inputs are detached: the indexer learns only
through :func:`kpool_layers.dsa.indexer_loss.indexer_kl_loss`.

All projections are linears duplicated on every TP rank (the indexer sees the full, SP-gathered
sequence), built from :class:`DSAIndexerSubmodules` (by default role-tagged
:class:`kpool_layers.precision.linears.RoleDuplicatedLinear`, which compute as the policy says for their
role); their parameters carry megatron's ``average_gradients_across_tp_domain``
so ``finalize_model_grads`` averages their gradients over TP.

Context parallelism (:mod:`kpool_layers.dsa.context_parallel`): the indexer gets this CP rank's rows
(queries at the rank's positions of the load-balanced split); its token keys (after rotary,
and after the rotation for ``kpool == 1``) and KPool gates are gathered from all CP ranks into
sequence order (gradients reduce-scattered back), so each local query scores every key of the
row it may see; pools (rotated after pooling) and document boundaries (``cu_seqlens`` of the
whole row) are global, and the output's ``layout`` holds this rank's query rows
(:meth:`PoolLayout.for_queries`).

Precision (``docs/precision.md``): every computation runs under explicit :class:`IndexerNumerics`.
The training numerics (:func:`training_numerics`, ``DSAIndexer.numerics``) are fixed at
construction from the config: the projections through their (role-tagged) linear modules and,
with ``precision.dsa_indexer_kpool_use_quantization``, scoring with the serving engines' quantized
index inputs (:func:`kpool_layers.precision.fp8.serving_index_quant` on every index-query head and every
scored key, whose Hadamard replaces ``rotate_activation``), equal to
:func:`kpool_layers.precision.fp8.serving_index_scores`. :meth:`DSAIndexer.recompute` redoes a forward's
selection under other numerics (the top-k drift reference, ``recipes.observe.drift``), and
:meth:`ScoredSelection.of` is what a selection scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.dsa.context_parallel import gather_sequence, query_positions
from kpool_layers.dsa.backends import RangeTopK, range_topk_kernel
from kpool_layers.precision.fp8 import serving_index_quant
from kpool_layers.precision.hadamard import rotate_activation
from kpool_layers.precision.linears import RoleDuplicatedLinear, computed_by_owner, role_spec
from kpool_layers.dsa.kpool import PoolLayout, index_keys, kpool_select, pool_layout
from kpool_layers.dsa.numerics import IndexerNumerics, RoutedProjections, indexer_numerics
from kpool_layers.precision.policy import Role
from kpool_layers.dsa.topk import index_scores, score_dtype, score_rows


@dataclass
class IndexerOutput:
    """What the indexer hands to the sparse attention and to the indexer loss."""

    topk_indices: Tensor
    """int64 [b, s_q, W], W = ``config.dsa_indexer_output_width``: key positions within the batch
    row, -1 = empty slot (``s_q``: this rank's query rows, the whole row ``s`` without CP)."""
    q: Tensor
    """[s_q, b, n_heads, head_dim] index queries (grad to the q projection)."""
    weights: Tensor
    """[s_q, b, n_heads] per-head weights, scale included (FP32 when kpool > 1)."""
    keys: Tensor
    """[n, b, head_dim] the keys that were scored: token keys of the whole row (n = s, kpool = 1)
    or pooled keys (n = pools of the row, kpool > 1); grad to the key projection, norm, gate and
    ape."""
    layout: PoolLayout
    """Where the pools are and which ones each query row sees (the same for every batch row)."""


# --- precision: the numerics an indexer computation runs under, and what a selection scored ---


def training_numerics(config: GLMTransformerConfig) -> IndexerNumerics:
    """The numerics the indexer trains with: the linears' own projections, the key LayerNorm precision of
    ``config.dsa_indexer_k_norm_fp32`` (megatron's field, which the recipes derive from the
    policy) and ``config.precision``'s serving-quantized scoring."""
    return IndexerNumerics(
        projections=RoutedProjections(),
        k_norm_fp32=config.dsa_indexer_k_norm_fp32,
        index_quant=indexer_numerics(config.precision).index_quant,
    )


def scoring_input(x: Tensor, index_quant: Optional[str]) -> Tensor:
    """What the top-k scores of index q ``[..., head_dim]`` or keys ``[..., head_dim]``:
    :func:`serving_index_quant` per ``head_dim`` vector under ``index_quant``, else ``x``."""
    return serving_index_quant(x, index_quant) if index_quant is not None else x


@dataclass
class ScoredSelection:
    """A selection and exactly what was scored to make it (detached).

    ``topk_indices`` int64 ``[b, s_q, W]``; ``q [s_q, b, h, d]`` and ``keys [n, b, d]`` as scored
    (dequantized under ``index_quant``); ``weights [s_q, b, h]``; ``layout``."""

    topk_indices: Tensor
    q: Tensor
    keys: Tensor
    weights: Tensor
    layout: PoolLayout

    @classmethod
    def of(cls, out: IndexerOutput, numerics: IndexerNumerics) -> ScoredSelection:
        """What the forward that returned ``out`` under ``numerics`` scored (its q and keys
        through :func:`scoring_input`: per-vector, so equal to what the forward scored)."""
        return cls(
            topk_indices=out.topk_indices.detach(),
            q=scoring_input(out.q.detach(), numerics.index_quant),
            keys=scoring_input(out.keys.detach(), numerics.index_quant),
            weights=out.weights.detach(),
            layout=out.layout,
        )

    def score_chunks(self, row: int, relu: bool, chunk_size: int) -> Iterator[Tensor]:
        """FP32 index scores of batch row ``row``, query chunk by query chunk: ``[c, n]`` each, in
        query order, ``-inf`` where a query cannot see the key (causal / other document /
        incomplete pool). ``c`` is ``chunk_size`` or less (:func:`~kpool_layers.dsa.topk.score_rows`:
        a chunk's per-head intermediate stays within ``SCORE_BUFFER_BYTES``), the same for any two
        selections of equal shapes."""
        lay = self.layout
        cols = torch.arange(lay.n_pools, device=self.q.device)
        t, _, heads, _ = self.q.shape
        rows = score_rows(chunk_size, heads if relu else 1, self.keys.shape[0])
        for start in range(0, t, rows):
            end = min(start + rows, t)
            part = index_scores(self.q[start:end, row], self.keys[:, row], self.weights[start:end, row], relu=relu)
            visible = (cols >= lay.query_lo[start:end, None]) & (cols < lay.query_hi[start:end, None])
            yield part.masked_fill(~visible, float("-inf"))


# --- end precision ------------------------------------------------------------------------------


KPOOL_WEIGHTS_NOTE = "KPool contract: FP32 GEMM inside the indexer"
"""Precision-map note of ``indexer.weights`` with ``kpool > 1`` (its forward never runs)."""


@dataclass
class DSAIndexerSubmodules:
    """Builders of :class:`DSAIndexer`'s parts (ModuleSpec or class each), as megatron's
    ``DSAIndexerSubmodules`` plus the KPool gate. Linears: ``(input_size, output_size, *, config,
    init_method, bias)`` with ``nn.Linear``'s ``forward(x) -> y`` and a ``weight`` the indexer also
    reads (recomputation, the KPool head weights), replicated on every TP rank; ``init_method=None``
    asks for zeros (the KPool gate). ``k_norm``: ``(normalized_shape, *, eps, device, dtype)`` with
    ``nn.LayerNorm``'s attributes."""

    linear_wq_b: ModuleSpec | type
    linear_wk: ModuleSpec | type
    k_norm: ModuleSpec | type
    linear_weights_proj: ModuleSpec | type
    index_kpool_compress_gate: ModuleSpec | type


def dsa_indexer_submodules() -> DSAIndexerSubmodules:
    """The indexer's parts: role-tagged duplicated linears (``indexer.q``, ``indexer.k``,
    ``indexer.weights``, ``indexer.kpool_gate``) and torch's LayerNorm."""
    return DSAIndexerSubmodules(
        linear_wq_b=role_spec(RoleDuplicatedLinear, Role.INDEXER_Q),
        linear_wk=role_spec(RoleDuplicatedLinear, Role.INDEXER_K),
        k_norm=torch.nn.LayerNorm,
        linear_weights_proj=role_spec(RoleDuplicatedLinear, Role.INDEXER_WEIGHTS),
        index_kpool_compress_gate=role_spec(RoleDuplicatedLinear, Role.INDEXER_KPOOL_GATE),
    )


class DSAIndexer(MegatronModule):
    """DSA lightning indexer; ``config.dsa_indexer_kpool > 1`` pools the index keys (KPool).

    ``range_topk`` scores and selects (the spec passes the ``dsa_kernels`` backend's kernel;
    default: that of ``config.dsa_kernels``).

    KPool adds ``index_kpool_compress_gate`` (hidden -> head_dim, no bias, zero-initialised so
    pooling starts as a mean) and ``index_kpool_compress_ape`` [kpool, head_dim] (zeros, trainable
    iff ``dsa_indexer_kpool_train_ape``). The ape is held in FP32 whatever the model dtype:
    :meth:`_apply` undoes half/bf16 casts of it (megatron's ``Float16Module`` calls
    ``module.bfloat16()``), so mixed-precision optimizers see it as an FP32 parameter.
    """

    def __init__(self, config: GLMTransformerConfig, layer_number: int,
                 range_topk: Optional[RangeTopK] = None,
                 submodules: Optional[DSAIndexerSubmodules] = None) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.range_topk = range_topk or range_topk_kernel(config.dsa_kernels,
                                                          config.dsa_indexer_query_chunk_size)
        """Scores + top-k kernel (:mod:`kpool_layers.dsa.backends`), chosen by the layer spec."""
        self.n_heads = config.dsa_indexer_n_heads
        self.head_dim = config.dsa_indexer_head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        self.kpool = config.dsa_indexer_kpool
        sub = submodules or dsa_indexer_submodules()
        q_in = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size

        def linear(spec: ModuleSpec | type, n_in: int, n_out: int, zeros: bool = False) -> torch.nn.Module:
            return build_module(spec, n_in, n_out, config=config, bias=False,
                                init_method=None if zeros else config.init_method)

        self.linear_wq_b = linear(sub.linear_wq_b, q_in, self.n_heads * self.head_dim)
        self.linear_wk = linear(sub.linear_wk, config.hidden_size, self.head_dim)
        eps = config.dsa_indexer_k_norm_epsilon
        self.k_norm = build_module(
            sub.k_norm,
            self.head_dim,
            eps=config.layernorm_epsilon if eps is None else eps,
            device=self.linear_wk.weight.device,
            dtype=config.params_dtype,
        )
        self.linear_weights_proj = linear(sub.linear_weights_proj, config.hidden_size, self.n_heads)
        if self.kpool > 1:
            # The KPool contract computes the head weights in FP32 inside the indexer (_index).
            computed_by_owner(self.linear_weights_proj, KPOOL_WEIGHTS_NOTE, torch.float32)
            self.index_kpool_compress_gate = linear(sub.index_kpool_compress_gate, config.hidden_size,
                                                    self.head_dim, zeros=True)
            self.index_kpool_compress_ape = torch.nn.Parameter(
                torch.zeros(self.kpool, self.head_dim, device=self.linear_wk.weight.device),
                requires_grad=config.dsa_indexer_kpool_train_ape,
            )
        for param in self.parameters():
            param.average_gradients_across_tp_domain = True  # type: ignore[attr-defined]
        groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group, self.cp_group = groups.tp, groups.cp
        self.numerics = training_numerics(config)
        """The numerics :meth:`forward` computes under (fixed at construction)."""

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - torch.nn.Module API
        """Module casts/moves, except that ``index_kpool_compress_ape`` never drops below FP32."""
        module = super()._apply(fn, recurse)
        ape = getattr(self, "index_kpool_compress_ape", None)
        if ape is not None and ape.dtype in (torch.float16, torch.bfloat16):
            ape.data = ape.data.float()
            if ape.grad is not None:
                ape.grad = ape.grad.float()
        return module

    def _rotate(self, x: Tensor, rotary_fn: Optional[Callable[[Tensor], Tensor]], hadamard: bool) -> Tensor:
        """Rotary on the first ``rope_dim`` channels (rope-first; ``rotary_fn`` rotates the first
        channels of what it is given and passes the others through), then with ``hadamard``
        :func:`rotate_activation`, of x [s, b, n, head_dim]."""
        if self.rope_dim:
            x = rotary_fn(x)
        return rotate_activation(x) if hadamard else x

    def _rotate_qk(self, q: Tensor, k: Tensor, rotary_fn: Optional[Callable[[Tensor], Tensor]],
                   hadamard_q: bool, hadamard_k: bool) -> tuple[Tensor, Tensor]:
        """Rotary on the index queries q [s, b, n_heads, head_dim] and token keys k [s, b,
        head_dim], then :func:`rotate_activation` of q with ``hadamard_q`` and of k with
        ``hadamard_k`` -> (contiguous q, contiguous k). Both maps act on every head_dim vector
        alone, so q and k of one dtype that get the same maps go through them as one [s, b,
        n_heads + 1, head_dim] tensor: the same values in a third of the kernels."""
        s, b = k.shape[:2]
        if q.dtype != k.dtype or hadamard_q != hadamard_k:  # no common tensor
            return (self._rotate(q, rotary_fn, hadamard_q),
                    self._rotate(k.view(s, b, 1, -1), rotary_fn, hadamard_k).view(s, b, -1))
        if self.rope_dim == 0 and not hadamard_q:
            return q, k
        qk = self._rotate(torch.cat([q, k.unsqueeze(2)], dim=2), rotary_fn, hadamard_q)
        q, k = qk.split([self.n_heads, 1], dim=2)
        return q.contiguous(), k.squeeze(2).contiguous()

    def forward(
        self,
        hidden: Tensor,
        q_latent: Tensor,
        rotary_fn: Optional[Callable[[Tensor], Tensor]] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> IndexerOutput:
        """Index queries/keys/weights and the top-k selection under the training numerics
        (``self.numerics``).

        Args:
            hidden: [s_q, b, hidden] this CP rank's rows (the full sequence without CP), already
                gathered from SP.
            q_latent: [s_q, b, q_lora_rank] the RMS-normalised MLA query latent.
            rotary_fn: applies rotary (at the rows' positions) to the first qk_pos_emb_head_dim
                channels of [s_q, b, n, d] and passes the others through
                (:class:`kpool_layers.mla.rope.BoundRotary`); None iff NoPE.
            cu_seqlens: int32 [n_docs + 1] packed THD boundaries of the whole row (then b == 1).
        """
        return self._index(hidden, q_latent, rotary_fn, cu_seqlens, self.numerics)

    @torch.no_grad()
    def recompute(
        self,
        numerics: IndexerNumerics,
        hidden: Tensor,
        q_latent: Tensor,
        rotary_fn: Optional[Callable[[Tensor], Tensor]] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> IndexerOutput:
        """:meth:`forward`'s computation on the same arguments (same layouts) under ``numerics``,
        without grad (same weights; under CP every rank of the group must call it, as the keys
        are gathered)."""
        return self._index(hidden, q_latent, rotary_fn, cu_seqlens, numerics)

    def _k_norm(self, k: Tensor, fp32: bool) -> Tensor:
        if not fp32:
            return self.k_norm(k)
        norm = self.k_norm
        return F.layer_norm(
            k.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps
        ).to(k.dtype)

    def _index(
        self,
        hidden: Tensor,
        q_latent: Tensor,
        rotary_fn: Optional[Callable[[Tensor], Tensor]],
        cu_seqlens: Optional[Tensor],
        numerics: IndexerNumerics,
    ) -> IndexerOutput:
        """The indexer computation (arguments as :meth:`forward`'s) under ``numerics``; the
        inputs are detached."""
        if (rotary_fn is None) != (self.rope_dim == 0):
            raise ValueError(
                f"rotary_fn must be given iff qk_pos_emb_head_dim > 0 (it is {self.rope_dim})"
            )
        if cu_seqlens is not None and hidden.shape[1] != 1:
            raise ValueError(f"packed THD input needs batch size 1, got {hidden.shape[1]}")
        hidden, q_latent = hidden.detach(), q_latent.detach()
        cfg = self.config
        s, b, _ = hidden.shape  # this CP rank's rows
        project, quant = numerics.projections, numerics.index_quant

        q = project.qk(self.linear_wq_b, q_latent).view(s, b, self.n_heads, self.head_dim)
        k = self._k_norm(project.qk(self.linear_wk, hidden), numerics.k_norm_fp32)
        # Hadamard of the queries and the scored keys: token keys for kpool = 1, pooled keys (after
        # pooling, index_keys) for kpool > 1; under index_quant the quantizer's Hadamard instead.
        hadamard = cfg.dsa_indexer_rotate_activation and quant is None
        q, k = self._rotate_qk(q, k, rotary_fn, hadamard, hadamard and self.kpool == 1)
        k = gather_sequence(k, self.cp_group)  # [s_kv, b, head_dim], the whole row
        scale = self.n_heads**-0.5 * self.head_dim**-0.5
        if self.kpool > 1:
            dtype = score_dtype(hidden.dtype)  # FP32 (FP64 stays FP64)
            weights = F.linear(hidden.to(dtype), self.linear_weights_proj.weight.to(dtype)) * scale
        else:
            weights = project.weights(self.linear_weights_proj, hidden) * scale
        # Serving-quantized scoring inputs (its Hadamard replaces rotate_activation).
        q_scored = scoring_input(q, quant)

        layout = pool_layout(k.shape[0], self.kpool, cu_seqlens, device=hidden.device)
        positions = query_positions(s, self.cp_group, hidden.device)
        if positions is not None:
            layout = layout.for_queries(positions)
        if self.kpool > 1:
            gate = gather_sequence(project.qk(self.index_kpool_compress_gate, hidden),
                                   self.cp_group)  # [s_kv, b, head_dim]
        keys, indices = [], []
        for row in range(b):
            row_keys = k[:, row]
            if self.kpool > 1:
                row_keys = index_keys(row_keys, gate[:, row], self.index_kpool_compress_ape, layout,
                                      rotate=hadamard)
            indices.append(
                kpool_select(
                    q_scored[:, row],
                    scoring_input(row_keys, quant),
                    weights[:, row],
                    layout,
                    topk=cfg.dsa_indexer_topk,
                    always_select_tail=cfg.dsa_indexer_kpool_always_select_tail,
                    relu=cfg.dsa_indexer_scoring_relu,
                    range_topk=self.range_topk,
                )
            )
            keys.append(row_keys)
        return IndexerOutput(
            topk_indices=_stack(indices, dim=0),
            q=q,
            weights=weights,
            keys=_stack(keys, dim=1),
            layout=layout,
        )


def _stack(rows: list[Tensor], dim: int) -> Tensor:
    """``torch.stack(rows, dim)``; one row is a view of it, not a copy."""
    return rows[0].unsqueeze(dim) if len(rows) == 1 else torch.stack(rows, dim=dim)
