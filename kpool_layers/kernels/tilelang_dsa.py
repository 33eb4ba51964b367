"""megatron-core's TileLang DSA kernels behind our layouts and contracts (``dsa_kernels=tilelang``).

megatron-core 0.19.2 ships ``ops.sparse_mla.SparseMLA`` (forward + backward) and the lightning
indexer's logits kernel ``ops.tilelang_indexer_fwd.indexer_fwd_interface``; TileLang itself is an
optional extra (``pip install -e '.[tilelang]'``). This module adapts them to what they do not
cover:

* NoPE (latent 512, no rope): SparseMLA is specialised for 576 = 512 + 64 channels, so queries and
  latent keys get a zero 64-wide tail (zero channels add nothing to ``q . k``; exact).
* Head counts: padded to what the kernels tile (a power of two >= 16 up to 64, else a multiple of
  64) with zero queries, whose outputs are dropped (their gradient is zero).
* Slot widths (KPool's ``topk + kpool - 1``): padded with -1 slots to a multiple of
  :data:`TILELANG_SLOT_BLOCK` (SparseMLA is wrong for 192 slots at 16 heads).
* Causality and packed THD documents: SparseMLA only skips ``-1`` slots, so every slot outside
  ``[key_start[i], query_pos[i]]`` (``query_pos[i] = i`` by default) is turned into ``-1`` first
  (:func:`valid_indices`).
* Context parallelism (``query_pos``: ``s_q`` local query rows at arbitrary positions of the full
  sequence against all ``s_kv`` latent keys): SparseMLA takes it as is. Checked in megatron-core
  0.19.2's ``ops/sparse_mla.py``, ``ops/tilelang_sparse_mla_fwd.py`` and
  ``ops/tilelang_sparse_mla_bwd.py``: ``SparseMLA`` documents q ``[b, seq_len, H, 576]`` and kv
  ``[b, seq_len_kv, 1, 576]``; both kernels declare ``seq_len`` and ``seq_len_kv`` as separate
  ``T.dynamic`` sizes (q, o, indices, lse, delta over ``seq_len``; kv and the fp32 dKV buffer over
  ``seq_len_kv``); the interfaces pad each to its own bucket (``MCORE_DSA_TILELANG_SEQ_BUCKET``)
  and slice the outputs back (``dkv[:, :S_kv]``); a slot loads ``KV[b, max(idx, 0)]`` and is
  masked only by ``idx != -1`` (the forward's ``max_kv_i = q_i`` is never used), so a query row's
  own position plays no part, and dKV is accumulated with atomics at ``dKV[b, idx]`` for any
  ``idx < seq_len_kv``. megatron's own absorbed-DSA hook (``fused_sparse_mla_absorbed`` in
  ``ops/tilelang_dsa.py``) likewise checks batch and ``indices.size(1) == query.size(0)`` but not
  ``query.size(0) == key.size(0)``, and its ``DSAttention`` runs allgather CP the same way (local
  queries, keys gathered in full-sequence order, ``dsa.py``). The adapter with ``s_q != s_kv`` is
  tested on a GPU (``test_tilelang_sparse_mla_with_query_pos_matches_torch``).
* The indexer: logits of at most ``chunk_size`` queries at a time (``[chunk, n]`` FP32, never
  ``[t, n]``), masked outside each query's ``[lo, hi)``, then ``torch.topk``. Ties among exactly
  equal scores follow ``torch.topk`` (not the lower-index rule of :mod:`kpool_layers.dsa.topk`).

Determinism: SparseMLA's forward and query gradient are bit-reproducible, its latent-key gradient
is not (float atomics); see docs/kernels.md.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kpool_layers.dsa.sparse_attention import check_layouts
from kpool_layers.dsa.topk import ascending_selection

TILELANG_DIM = 576
"""Channels SparseMLA is specialised for (512 latent + 64 rope)."""
TILELANG_V = 512
TILELANG_SLOT_BLOCK = 128
"""Slot widths we hand SparseMLA: multiples of 128 (two of its 64-slot blocks), padded with -1
slots here, because SparseMLA's own padding to 64 gives wrong results for some widths at 16 heads
(W = 192 on an H200; docs/kernels.md, "What the TileLang adapter adds")."""


def tilelang_heads(n: int) -> int:
    """Heads the TileLang kernels run for ``n`` heads: a power of two >= 16 up to 64, else the next
    multiple of 64."""
    if n <= 64:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // 64) * 64


def valid_indices(topk_indices: Tensor, key_start: Optional[Tensor],
                  query_pos: Optional[Tensor] = None) -> Tensor:
    """int32 ``[b, s_q, W]``: ``topk_indices`` with every slot outside
    ``[key_start[i], query_pos[i]]`` (causal, same document; ``key_start`` int ``[s_q]`` or None =
    0, ``query_pos`` int ``[s_q]`` or None = ``arange(s_q)``) set to -1."""
    s = topk_indices.shape[1]
    rows = torch.arange(s, device=topk_indices.device)
    lowest = key_start if key_start is not None else torch.zeros_like(rows)
    highest = query_pos if query_pos is not None else rows
    ok = (topk_indices >= lowest[None, :, None]) & (topk_indices <= highest[None, :, None])
    return torch.where(ok, topk_indices, -1).to(torch.int32)


SparseMLAKernel = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
"""``(q [b, s_q, H, 576], kv [b, s_kv, 1, 576], indices int32 [b, s_q, 1, W] in [0, s_kv) or -1,
scale) -> (out [b, s_q, H, 512], lse)``: megatron-core's ``SparseMLA.apply`` (skips only -1
slots; no causal mask of its own)."""


def megatron_sparse_mla() -> SparseMLAKernel:
    """megatron-core's TileLang ``SparseMLA.apply`` (raises ImportError without TileLang)."""
    from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA

    if SparseMLA is None:
        raise ImportError("megatron-core's SparseMLA needs tilelang: pip install -e '.[tilelang]'")
    return SparseMLA.apply


def sparse_mla_tilelang(query: Tensor, latent_kv: Tensor, topk_indices: Tensor,
                        softmax_scale: float, *, v_channels: int, key_start: Optional[Tensor],
                        kernel: SparseMLAKernel, query_pos: Optional[Tensor] = None) -> Tensor:
    """:func:`kpool_layers.dsa.sparse_attention.sparse_mla_attention`'s contract on ``kernel``.

    ``query [s_q, b, n, d]``, ``latent_kv [s_kv, b, 1, d]`` (``s_kv >= s_q``; ``s_kv == s_q``
    without ``query_pos``) with ``d`` 576 (GLM-5) or 512 (NoPE), ``v_channels`` 512,
    ``topk_indices [b, s_q, W]`` (valid slots unique per row, as the indexer makes them),
    ``key_start`` / ``query_pos`` int64 ``[s_q]`` or None -> ``[s_q, b, n, 512]``. Differentiable in
    query and latent_kv (``[s_kv, b, 1, d]`` gradient) through the padding."""
    check_layouts(query, latent_kv, topk_indices, key_start, query_pos)
    s, b, n, d = query.shape
    if v_channels != TILELANG_V or d not in (TILELANG_V, TILELANG_DIM):
        raise ValueError(f"TileLang SparseMLA needs v_channels {TILELANG_V} and d {TILELANG_V} or "
                         f"{TILELANG_DIM}, got {v_channels} and {d}")
    q = query.transpose(0, 1)  # [b, s_q, n, d]
    kv = latent_kv.transpose(0, 1)  # [b, s_kv, 1, d]
    if d == TILELANG_V:  # NoPE: zero rope channels
        q, kv = F.pad(q, (0, TILELANG_DIM - d)), F.pad(kv, (0, TILELANG_DIM - d))
    heads = tilelang_heads(n)
    if heads != n:
        q = F.pad(q, (0, 0, 0, heads - n))
    indices = valid_indices(topk_indices, key_start, query_pos)
    pad = -indices.shape[-1] % TILELANG_SLOT_BLOCK
    if pad:  # F.pad copies even for a zero pad: skip it for plain DSA's widths
        indices = F.pad(indices, (0, pad), value=-1)
    indices = indices.unsqueeze(2)  # [b, s_q, 1, W'], W' a multiple of TILELANG_SLOT_BLOCK
    out, _ = kernel(q.contiguous(), kv.contiguous(), indices.contiguous(), softmax_scale)
    return out[:, :, :n].transpose(0, 1)


def range_topk_tilelang(q: Tensor, keys: Tensor, weights: Tensor, lo: Tensor, hi: Tensor, *,
                        topk: int, relu: bool, chunk_size: int) -> Tensor:
    """:func:`kpool_layers.dsa.topk.chunked_range_topk`'s contract (q [t, h, d], keys [n, d], weights
    [t, h], lo/hi [t] -> int64 [t, topk], -1 = empty) on megatron-core's TileLang logits kernel
    (bf16 q/keys, FP32 weights and logits), ``chunk_size`` queries at a time."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_fwd import (
        indexer_fwd_interface,
    )

    t, n = q.shape[0], keys.shape[0]
    out = torch.full((t, topk), -1, dtype=torch.long, device=q.device)
    width = min(topk, n)
    if t == 0 or width == 0:
        return out
    keys_bf16 = keys.detach().to(torch.bfloat16).contiguous()
    with torch.no_grad():
        for start in range(0, t, chunk_size):
            end = min(start + chunk_size, t)
            logits = indexer_fwd_interface(
                q[start:end].to(torch.bfloat16).contiguous(), keys_bf16,
                weights[start:end].float().contiguous(), lo[start:end].to(torch.int32).contiguous(),
                hi[start:end].to(torch.int32).contiguous(), clean_logits=True, use_relu=relu)
            values, chosen = torch.topk(logits, width, dim=-1)
            out[start:end, :width] = ascending_selection(chosen, values > float("-inf"))
    return out
