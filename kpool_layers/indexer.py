"""The DSA lightning indexer (DeepSeek-V3.2 / GLM-5), plain and KPool (pooled keys).

Per token ``t`` of a row (megatron's sequence-first layout, ``[s, b, ...]``):

    q[t]  = W_q  q_latent[t]            [n_heads, head_dim]   q_latent: RMS-normalised MLA query latent
    k[t]  = LayerNorm(W_k hidden[t])    [head_dim]            one shared key per token
    w[t]  = W_w hidden[t] * n_heads**-0.5 * head_dim**-0.5    [n_heads]
    rotary on the first qk_pos_emb_head_dim channels of q and k (none under NoPE),
    then optionally a Hadamard rotation of q and k;
    score(t, j) = sum_h w[t, h] * act(q[t, h] . key[j]),   act = ReLU or identity,

causal (and per document for packed THD). ``key[j]`` is the token key (plain DSA) or the pooled
key of :mod:`kpool_layers.kpool` (``kpool > 1``). Inputs are detached: the indexer learns only
through :func:`kpool_layers.indexer_loss.indexer_kl_loss`.

All projections are plain linears duplicated on every TP rank (the indexer sees the full,
SP-gathered sequence); their parameters carry megatron's ``average_gradients_across_tp_domain``
so ``finalize_model_grads`` averages their gradients over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.hadamard import rotate_activation
from kpool_layers.kpool import PoolLayout, kpool_select, pool_keys, pool_layout
from kpool_layers.topk import score_dtype


@dataclass
class IndexerOutput:
    """What the indexer hands to the sparse attention and to the indexer loss."""

    topk_indices: Tensor
    """int64 [b, s, W], W = ``config.dsa_indexer_output_width``: key positions within the batch
    row, -1 = empty slot."""
    q: Tensor
    """[s, b, n_heads, head_dim] index queries (grad to the q projection)."""
    weights: Tensor
    """[s, b, n_heads] per-head weights, scale included (FP32 when kpool > 1)."""
    keys: Tensor
    """[n, b, head_dim] the keys that were scored: token keys (n = s, kpool = 1) or pooled keys
    (n = pools of the row, kpool > 1); grad to the key projection, norm, gate and ape."""
    layout: PoolLayout
    """Where the pools are and which ones each query sees (the same for every batch row)."""


def _duplicated_linear(
    config: GLMTransformerConfig, n_in: int, n_out: int, init: bool
) -> torch.nn.Linear:
    """Bias-free linear replicated on every TP rank, initialised with ``config.init_method`` from
    the default generator (seeded identically on all TP ranks), or zeros when ``init`` is False."""
    device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
    linear = torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=config.params_dtype)
    with torch.no_grad():
        if not init:
            linear.weight.zero_()
        elif config.perform_initialization:
            config.init_method(linear.weight)
    return linear


class DSAIndexer(MegatronModule):
    """DSA lightning indexer; ``config.dsa_indexer_kpool > 1`` pools the index keys (KPool).

    KPool adds ``index_kpool_compress_gate`` (hidden -> head_dim, no bias, zero-initialised so
    pooling starts as a mean) and ``index_kpool_compress_ape`` [kpool, head_dim] (zeros, trainable
    iff ``dsa_indexer_kpool_train_ape``). The ape is held in FP32 whatever the model dtype:
    :meth:`_apply` undoes half/bf16 casts of it (megatron's ``Float16Module`` calls
    ``module.bfloat16()``), so mixed-precision optimizers see it as an FP32 parameter.
    """

    def __init__(self, config: GLMTransformerConfig, layer_number: int) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.n_heads = config.dsa_indexer_n_heads
        self.head_dim = config.dsa_indexer_head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        self.kpool = config.dsa_indexer_kpool
        q_in = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        self.linear_wq_b = _duplicated_linear(config, q_in, self.n_heads * self.head_dim, init=True)
        self.linear_wk = _duplicated_linear(config, config.hidden_size, self.head_dim, init=True)
        eps = config.dsa_indexer_k_norm_epsilon
        self.k_norm = torch.nn.LayerNorm(
            self.head_dim,
            eps=config.layernorm_epsilon if eps is None else eps,
            device=self.linear_wk.weight.device,
            dtype=config.params_dtype,
        )
        self.linear_weights_proj = _duplicated_linear(
            config, config.hidden_size, self.n_heads, init=True
        )
        if self.kpool > 1:
            self.index_kpool_compress_gate = _duplicated_linear(
                config, config.hidden_size, self.head_dim, init=False
            )
            self.index_kpool_compress_ape = torch.nn.Parameter(
                torch.zeros(self.kpool, self.head_dim, device=self.linear_wk.weight.device),
                requires_grad=config.dsa_indexer_kpool_train_ape,
            )
        for param in self.parameters():
            param.average_gradients_across_tp_domain = True  # type: ignore[attr-defined]
        self.tp_group = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]).tp

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - torch.nn.Module API
        """Module casts/moves, except that ``index_kpool_compress_ape`` never drops below FP32."""
        module = super()._apply(fn, recurse)
        ape = getattr(self, "index_kpool_compress_ape", None)
        if ape is not None and ape.dtype in (torch.float16, torch.bfloat16):
            ape.data = ape.data.float()
            if ape.grad is not None:
                ape.grad = ape.grad.float()
        return module

    def _rope(self, x: Tensor, rotary_fn: Optional[Callable[[Tensor], Tensor]]) -> Tensor:
        """Rotary on the first ``rope_dim`` channels of x [s, b, n, head_dim] (rope-first)."""
        if self.rope_dim == 0:
            return x
        pe, nope = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([rotary_fn(pe), nope], dim=-1)

    def forward(
        self,
        hidden: Tensor,
        q_latent: Tensor,
        rotary_fn: Optional[Callable[[Tensor], Tensor]] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> IndexerOutput:
        """Index queries/keys/weights and the top-k selection.

        Args:
            hidden: [s, b, hidden] the full sequence (already gathered from SP).
            q_latent: [s, b, q_lora_rank] the RMS-normalised MLA query latent.
            rotary_fn: applies rotary to [s, b, n, qk_pos_emb_head_dim]; None iff NoPE.
            cu_seqlens: int32 [n_docs + 1] packed THD boundaries (then b == 1).
        """
        if (rotary_fn is None) != (self.rope_dim == 0):
            raise ValueError(
                f"rotary_fn must be given iff qk_pos_emb_head_dim > 0 (it is {self.rope_dim})"
            )
        if cu_seqlens is not None and hidden.shape[1] != 1:
            raise ValueError(f"packed THD input needs batch size 1, got {hidden.shape[1]}")
        cfg = self.config
        hidden, q_latent = hidden.detach(), q_latent.detach()
        s, b, _ = hidden.shape

        q = self.linear_wq_b(q_latent).view(s, b, self.n_heads, self.head_dim)
        k = self.linear_wk(hidden)
        if cfg.dsa_indexer_k_norm_fp32:
            norm = self.k_norm
            k = F.layer_norm(
                k.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps
            ).to(k.dtype)
        else:
            k = self.k_norm(k)
        q = self._rope(q, rotary_fn)
        k = self._rope(k.view(s, b, 1, self.head_dim), rotary_fn).view(s, b, self.head_dim)
        if cfg.dsa_indexer_rotate_activation:
            q, k = rotate_activation(q), rotate_activation(k)
        scale = self.n_heads**-0.5 * self.head_dim**-0.5
        if self.kpool > 1:
            dtype = score_dtype(hidden.dtype)  # FP32 (FP64 stays FP64)
            weights = F.linear(hidden.to(dtype), self.linear_weights_proj.weight.to(dtype)) * scale
        else:
            weights = self.linear_weights_proj(hidden) * scale

        layout = pool_layout(s, self.kpool, cu_seqlens, device=hidden.device)
        if self.kpool > 1:
            gate = self.index_kpool_compress_gate(hidden)  # [s, b, head_dim]
        keys, indices = [], []
        for row in range(b):
            row_keys = k[:, row]
            if self.kpool > 1:
                row_keys = pool_keys(row_keys, gate[:, row], self.index_kpool_compress_ape, layout)
            indices.append(
                kpool_select(
                    q[:, row],
                    row_keys,
                    weights[:, row],
                    layout,
                    topk=cfg.dsa_indexer_topk,
                    always_select_tail=cfg.dsa_indexer_kpool_always_select_tail,
                    relu=cfg.dsa_indexer_scoring_relu,
                    chunk_size=cfg.dsa_indexer_query_chunk_size,
                )
            )
            keys.append(row_keys)
        return IndexerOutput(
            topk_indices=torch.stack(indices),
            q=q,
            weights=weights,
            keys=torch.stack(keys, dim=1),
            layout=layout,
        )
