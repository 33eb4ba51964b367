"""The chunked KDA (Kimi delta attention) delta rule in PyTorch: the reference backend.

Recurrence per sequence, head and token ``t`` (state ``S [K, V]``, zero at a document's start)::

    S   <- diag(exp(g_t)) S                       per-key-channel decay, g_t <= 0 (log space)
    u_t  = beta_t (v_t - S^T k_t)                 delta rule: correct what S predicts for k_t
    S   <- S + k_t u_t^T
    o_t  = S^T (scale * q_t)

with ``q_t``, ``k_t`` L2-normalised over ``K`` first (``x / sqrt(sum x^2 + 1e-6)``, as
flash-linear-attention's ``use_qk_l2norm_in_kernel``). Chunked form (chunk of ``C`` tokens,
``G_t`` the in-chunk inclusive cumulative sum of ``g``, ``S0`` the state entering the chunk)::

    A[t, s] = beta_t sum_d k_td k_sd exp(G_td - G_sd)     s < t (strictly lower triangular)
    W  = (I + A)^-1 (beta * k * exp(G))                    [C, K]
    U  = (I + A)^-1 (beta * v) - W S0                      [C, V]  (the u_t of all chunk tokens)
    O  = (scale q * exp(G)) S0 + (P . tril) U,  P[t, s] = sum_d scale q_td k_sd exp(G_td - G_sd)
    S1 = diag(exp(G_C)) S0 + sum_s (k_s * exp(G_C - G_s)) u_s^T

Every exponent is a difference ``G_t - G_s`` with ``t >= s`` (or ``G`` itself), hence <= 0: no
overflow whatever the decay. The chunks' triangular systems are solved at once; only the state
is carried from chunk to chunk.

Layouts (flash-linear-attention's): ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]``
(log decay), ``beta [B, T, H]``; output ``[B, T, H, V]`` in ``v``'s dtype. ``cu_seqlens``
(int ``[N + 1]``, ``B == 1``, last entry ``T``) packs ``N`` documents whose states start at zero.
The computation runs in float32, or in float64 for float64 inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

L2NORM_EPS = 1e-6
"""Epsilon of the q/k L2 normalisation (flash-linear-attention's and transformers')."""


def l2_normalize(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2, -1) + 1e-6)`` over the last dim."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _one_sequence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  chunk_size: int) -> Tensor:
    """One sequence, heads first: ``q, k, g [H, T, K]``, ``v [H, T, V]``, ``beta [H, T]`` (already
    normalised, scaled and in the compute dtype) -> ``[H, T, V]``."""
    h, t, dk = k.shape
    c = chunk_size
    pad = (-t) % c
    if pad:  # padded tokens: k = 0, beta = 0, g = 0 leave the state unchanged
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (t + pad) // c
    q, k, v, g = (x.reshape(h, n, c, x.shape[-1]) for x in (q, k, v, g))  # [H, N, C, *]
    beta = beta.reshape(h, n, c, 1)
    big_g = g.cumsum(dim=2)                                              # [H, N, C, K]
    later = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)  # s > t
    diff = (big_g.unsqueeze(3) - big_g.unsqueeze(2)).masked_fill(later[..., None], float("-inf"))
    decay = diff.exp()                                                   # [H, N, C(t), C(s), K]
    kk = torch.einsum("hntd,hnsd,hntsd->hnts", k, k, decay)
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    a = (beta * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta * k * big_g.exp(), beta * v], dim=-1)         # [H, N, C, K + V]
    sol = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    w, u0 = sol.split([dk, v.shape[-1]], dim=-1)
    p = torch.einsum("hntd,hnsd,hntsd->hnts", q, k, decay)             # tril incl. (decay 0 above)
    q_decayed = q * big_g.exp()
    k_to_end = k * (big_g[:, :, -1:] - big_g).exp()
    state = q.new_zeros(h, dk, v.shape[-1])
    out = []
    for i in range(n):
        u = u0[:, i] - w[:, i] @ state                                   # [H, C, V]
        out.append(q_decayed[:, i] @ state + p[:, i] @ u)
        state = big_g[:, i, -1].exp().unsqueeze(-1) * state + k_to_end[:, i].transpose(1, 2) @ u
    return torch.cat(out, dim=1)[:, :t]


def chunk_kda_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                    cu_seqlens: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """The KDA delta rule (module docstring) for ``[B, T, H, *]`` inputs -> ``[B, T, H, V]``."""
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {q.shape[0]}")
    dtype = _compute_dtype(q.dtype)
    qh, kh, vh, gh = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, *]
    bh = beta.to(dtype).transpose(1, 2)
    qh, kh = l2_normalize(qh) * scale, l2_normalize(kh)
    if cu_seqlens is None:
        out = torch.stack([_one_sequence(qh[b], kh[b], vh[b], gh[b], bh[b], chunk_size)
                           for b in range(q.shape[0])])
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[1]}, got {bounds}")
        docs = [_one_sequence(qh[0, :, b0:b1], kh[0, :, b0:b1], vh[0, :, b0:b1], gh[0, :, b0:b1],
                              bh[0, :, b0:b1], chunk_size)
                for b0, b1 in zip(bounds, bounds[1:]) if b1 > b0]
        out = torch.cat(docs, dim=1).unsqueeze(0)
    return out.transpose(1, 2).to(v.dtype)
