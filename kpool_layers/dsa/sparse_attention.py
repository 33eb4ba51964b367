"""Causal sparse attention over each query's top-k keys, in absorbed-MLA (MQA) form.

Layouts (megatron):
  * ``query``        ``[s_q, b, n, d_k]`` absorbed queries, ``d_k = kv_lora_rank + rope dim``;
  * ``latent_kv``    ``[s_kv, b, 1, d_k]`` latent keys of the whole sequence, whose first
    ``v_channels`` are the value; ``s_kv >= s_q`` (``s_kv == s_q`` without ``query_pos``);
  * ``topk_indices`` int ``[b, s_q, W]`` key positions in ``[0, s_kv)`` per query row, ``-1`` =
    empty slot;
  * ``key_start``    int64 ``[s_q]`` first key each query row may see (its document start in a
    packed THD sequence) or None (0);
  * ``query_pos``    int64 ``[s_q]`` key position of each query row, i.e. its position in the full
    sequence, or None (``arange(s_q)``). With context parallelism a rank holds a subset of the
    query rows (megatron's load-balanced split: chunks ``r`` and ``2 CP - 1 - r`` of ``2 CP``, so
    not contiguous positions) but the latent keys of the whole sequence. Values are not checked
    (no host sync); they lie in ``[0, s_kv)``;
  * output           ``[s_q, b, n, v_channels]``; gradient of ``latent_kv`` ``[s_kv, b, 1, d_k]``
    (zero on keys no query row selects; summing it over ranks gives the full gradient).

A selected key counts once (duplicates in a row are dropped) and only if
``key_start[i] <= key <= query_pos[i]`` for query row ``i`` (causal, same document). A query with
no valid key gets a zero output and zero gradients.

Memory: queries are processed ``chunk_size`` rows at a time; per chunk the selected keys
``[b, chunk, W, d_k]`` are gathered and the scores ``[b, chunk, n, W]`` formed, never an
``[s_q, s_kv]`` mask.

Precision: fp32/fp64 inputs are computed in their own dtype. For bf16/fp16 inputs the gathers and
the four matmuls run in the input dtype on tensor cores (fp32 accumulation), while the softmax,
its log-sum-exp, ``rowsum(dO * O)`` and the key-gradient accumulation are fp32, as in megatron's
unfused attention (bf16 logits, fp32 softmax). Autograd saves only the inputs, the output
and the per-row log-sum-exp ``[b, s_q, n]``; backward regathers each chunk (flash-attention style),
so activation memory is linear in the sequence length.
"""

from __future__ import annotations

from typing import Optional

import torch


def _selected_keys(indices: torch.Tensor, first_row: int, key_start: Optional[torch.Tensor],
                   query_pos: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted, de-duplicated key indices of a query chunk and their validity.

    ``indices`` int ``[b, c, W]`` for query rows ``first_row .. first_row + c - 1``; a slot is valid
    iff ``key_start[row] <= key <= query_pos[row]`` (None: 0 and ``row``) and it is the first
    occurrence of its key. Returns ``(keys, valid)``: int64 ``[b, c, W]`` (invalid slots hold 0)
    and bool ``[b, c, W]``.
    """
    rows = torch.arange(first_row, first_row + indices.size(1), device=indices.device)
    lowest = key_start[rows] if key_start is not None else torch.zeros_like(rows)
    highest = query_pos[rows].to(torch.int64) if query_pos is not None else rows
    keys = indices.to(torch.int64)
    allowed = (keys >= lowest[None, :, None]) & (keys <= highest[None, :, None])
    keys, _ = torch.where(allowed, keys, -1).sort(dim=-1)
    valid = keys >= 0
    valid[..., 1:] &= keys[..., 1:] != keys[..., :-1]
    return keys.clamp(min=0), valid


def _flat_rows(keys: torch.Tensor, s_kv: int) -> torch.Tensor:
    """Row ids into a ``[b * s_kv, d]`` key table for per-batch key positions ``keys [b, c, W]``;
    int64 ``[b * c * W]``."""
    batch_offset = torch.arange(keys.size(0), device=keys.device)[:, None, None] * s_kv
    return (keys + batch_offset).reshape(-1)


def _dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(matmul/gather dtype, softmax/accumulation dtype) for inputs of ``dtype``."""
    if dtype in (torch.bfloat16, torch.float16):
        return dtype, torch.float32
    return dtype, torch.promote_types(dtype, torch.float32)


class _SparseMLAAttention(torch.autograd.Function):
    """Chunked sparse MQA attention with recomputation in backward (see module docstring)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, query: torch.Tensor, latent_kv: torch.Tensor,
                topk_indices: torch.Tensor,
                key_start: Optional[torch.Tensor], query_pos: Optional[torch.Tensor],
                softmax_scale: float, v_channels: int, chunk_size: int) -> torch.Tensor:
        s, b, n, d = query.shape
        s_kv = latent_kv.size(0)
        mm, acc = _dtypes(query.dtype)
        flat_kv = latent_kv.detach().to(mm).permute(1, 0, 2, 3).reshape(b * s_kv, d)
        out = query.new_empty(s, b, n, v_channels)
        lse = torch.empty(b, s, n, dtype=acc, device=query.device)
        for r0 in range(0, s, chunk_size):
            r1 = min(r0 + chunk_size, s)
            keys, valid = _selected_keys(topk_indices[:, r0:r1], r0, key_start, query_pos)
            k_sel = flat_kv[_flat_rows(keys, s_kv)].view(b, r1 - r0, -1, d)
            q = query[r0:r1].detach().to(mm).transpose(0, 1)  # [b, c, n, d]
            probs = torch.matmul(q, k_sel.transpose(-1, -2)).to(acc).mul_(softmax_scale)  # [b, c, n, W]
            probs.masked_fill_(~valid[:, :, None, :], float("-inf"))
            row_lse = torch.logsumexp(probs, dim=-1)
            row_lse.masked_fill_(row_lse == float("-inf"), float("inf"))  # empty row -> p = 0
            probs.sub_(row_lse[..., None]).exp_()
            out[r0:r1] = torch.matmul(probs.to(mm), k_sel[..., :v_channels]).transpose(0, 1)
            lse[:, r0:r1] = row_lse
        ctx.save_for_backward(query, latent_kv, topk_indices, key_start, query_pos, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.v_channels = v_channels
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor):  # noqa: ANN205
        query, latent_kv, topk_indices, key_start, query_pos, out, lse = ctx.saved_tensors
        scale, v, chunk = ctx.softmax_scale, ctx.v_channels, ctx.chunk_size
        s, b, n, d = query.shape
        s_kv = latent_kv.size(0)
        mm, acc = _dtypes(query.dtype)
        flat_kv = latent_kv.to(mm).permute(1, 0, 2, 3).reshape(b * s_kv, d)
        grad_flat_kv = torch.zeros(b * s_kv, d, dtype=acc, device=query.device)
        grad_query = torch.empty_like(query)
        for r0 in range(0, s, chunk):
            r1 = min(r0 + chunk, s)
            keys, valid = _selected_keys(topk_indices[:, r0:r1], r0, key_start, query_pos)
            rows = _flat_rows(keys, s_kv)
            k_sel = flat_kv[rows].view(b, r1 - r0, -1, d)
            q = query[r0:r1].to(mm).transpose(0, 1)
            d_out = grad_out[r0:r1].to(mm).transpose(0, 1)  # [b, c, n, v]
            o = out[r0:r1].transpose(0, 1)
            probs = torch.matmul(q, k_sel.transpose(-1, -2)).to(acc).mul_(scale)
            probs.masked_fill_(~valid[:, :, None, :], float("-inf"))
            probs.sub_(lse[:, r0:r1, :, None]).exp_()
            # dS = P * (dP - rowsum(dO * O)) * scale
            d_scores = torch.matmul(d_out, k_sel[..., :v].transpose(-1, -2)).to(acc)
            d_scores.sub_((d_out.to(acc) * o.to(acc)).sum(-1, keepdim=True)).mul_(probs).mul_(scale)
            d_scores = d_scores.to(mm)
            grad_query[r0:r1] = torch.matmul(d_scores, k_sel).transpose(0, 1)
            grad_k = torch.matmul(d_scores.transpose(-1, -2), q).to(acc)  # [b, c, W, d]
            grad_k[..., :v] += torch.matmul(probs.to(mm).transpose(-1, -2), d_out).to(acc)
            grad_flat_kv.index_add_(0, rows, grad_k.reshape(-1, d))
        grad_kv = grad_flat_kv.view(b, s_kv, 1, d).transpose(0, 1).to(latent_kv.dtype)
        return grad_query, grad_kv, None, None, None, None, None, None


def check_layouts(query: torch.Tensor, latent_kv: torch.Tensor, topk_indices: torch.Tensor,
                  key_start: Optional[torch.Tensor], query_pos: Optional[torch.Tensor]) -> None:
    """Raise ValueError naming the argument and its expected shape unless the tensors follow the
    module docstring's layouts (shapes and index dtypes only: no values are read, no host sync)."""
    if query.dim() != 4:
        raise ValueError(f"query must be [s_q, b, n, d_k], got {list(query.shape)}")
    s, b, _, d = query.shape
    s_kv = latent_kv.size(0) if latent_kv.dim() == 4 else -1
    if query_pos is None and latent_kv.shape != (s, b, 1, d):
        raise ValueError(f"latent_kv must be [{s}, {b}, 1, {d}] (s_kv = s_q without query_pos), "
                         f"got {list(latent_kv.shape)}")
    if query_pos is not None and (latent_kv.shape[1:] != (b, 1, d) or s_kv < s):
        raise ValueError(f"latent_kv must be [s_kv >= {s}, {b}, 1, {d}], got "
                         f"{list(latent_kv.shape)}")
    if topk_indices.dim() != 3 or topk_indices.shape[:2] != (b, s):
        raise ValueError(f"topk_indices must be [{b}, {s}, W], got {list(topk_indices.shape)}")
    for name, rows in (("key_start", key_start), ("query_pos", query_pos)):
        if rows is not None and (rows.shape != (s,) or rows.dtype.is_floating_point
                                 or rows.dtype.is_complex or rows.dtype == torch.bool):
            raise ValueError(f"{name} must be an int64 (integer) [{s}] tensor, got "
                             f"{rows.dtype} {list(rows.shape)}")


def sparse_mla_attention(query: torch.Tensor, latent_kv: torch.Tensor, topk_indices: torch.Tensor,
                         softmax_scale: float, *, v_channels: int, chunk_size: int,
                         key_start: Optional[torch.Tensor] = None,
                         query_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of ``query [s_q, b, n, d_k]`` over its selected latent keys
    ``latent_kv [s_kv, b, 1, d_k]``.

    See the module docstring for layouts and masking (query row ``i`` sits at key position
    ``query_pos[i]``, default ``i``). Returns ``[s_q, b, n, v_channels]`` in ``query.dtype``;
    differentiable in ``query`` and ``latent_kv``.
    """
    check_layouts(query, latent_kv, topk_indices, key_start, query_pos)
    d = query.size(-1)
    if not 0 < v_channels <= d:
        raise ValueError(f"v_channels={v_channels} must be in (0, {d}]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _SparseMLAAttention.apply(query, latent_kv, topk_indices, key_start, query_pos,
                                     softmax_scale, v_channels, chunk_size)
