"""What a KDA layer's kernels are, and the PyTorch ones (the reference backend).

A KDA layer (:mod:`kpool_layers.linear_attention.kda`) does four things besides its GEMMs, each
through one entry of a :class:`KDAKernels` bundle picked once at the build by
``model.linear_attention_kernels`` (:mod:`kpool_layers.linear_attention.backends`):

==============  ================================================================================
entry           contract
==============  ================================================================================
``conv``        ``(x [b, s, C], weight [C, K_c], docs) -> SiLU(causal depthwise conv) [b, s, C]``
                in ``x``'s dtype, computed in float32; PyTorch's ``conv1d`` weight layout (the
                last tap multiplies the current token); taps reaching before a document's start
                read 0 (:class:`Documents`)
``decay``       ``(f [..., H, D], A_log [H], dt_bias [H * D], lower_bound) -> g`` float32
                ``[..., H, D]``: ``lower_bound * sigmoid(exp(A_log) (f + dt_bias))``, or
                ``-exp(A_log) softplus(f + dt_bias)`` without a lower bound
``delta_rule``  :data:`DeltaRule`, the chunked delta rule
``gated_norm``  ``(o [..., D], gate [..., D], weight [D], eps) -> RMSNorm_D(o) * weight *
                sigmoid(gate)`` in ``o``'s dtype, computed in float32
==============  ================================================================================

Every entry computes in float32 from its inputs' values and rounds once to the output dtype, so
two backends differ by the order of float32 operations and that last rounding (the delta rule
excepted: fla stores chunk intermediates in the input dtype; see its test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kpool_layers.linear_attention.delta_rule import chunk_kda_torch


class Documents(NamedTuple):
    """Where the documents of a row of ``s`` tokens start (the same boundaries twice):
    ``positions`` int64 ``[s]`` each token's position inside its document; ``bounds`` int32
    ``[0, ..., s]`` (None: the row is one document)."""

    positions: Tensor
    bounds: Optional[Tensor]


DeltaRule = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Optional[Tensor]], Tensor]
"""``(q, k, v, g, beta, scale, cu_seqlens) -> o``: ``q, k [B, T, H, K]`` and ``v [B, T, H, V]`` in the
model dtype (q and k are L2-normalised inside), ``g [B, T, H, K]`` float32 log decay, ``beta
[B, T, H]``, ``cu_seqlens`` int ``[N + 1]`` (``B == 1``, last entry ``T``) or None; ``o [B, T, H, V]`` in
``v``'s dtype."""
ShortConv = Callable[[Tensor, Tensor, Documents], Tensor]
Decay = Callable[[Tensor, Tensor, Tensor, Optional[float]], Tensor]
GatedNorm = Callable[[Tensor, Tensor, Tensor, float], Tensor]


@dataclass(frozen=True)
class KDAKernels:
    """One backend's kernels for a KDA layer (module docstring for each entry's contract)."""

    conv: ShortConv
    decay: Decay
    delta_rule: DeltaRule
    gated_norm: GatedNorm


def document_index(seq_len: int, cu_seqlens: Optional[Tensor], device: torch.device) -> Documents:
    """The :class:`Documents` of a row of ``seq_len`` tokens packed at ``cu_seqlens`` (tokens past
    its last entry form one more document; None: one document)."""
    tokens = torch.arange(seq_len, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        return Documents(tokens, None)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    if int(bounds[-1]) > seq_len:
        raise ValueError(f"cu_seqlens ends at {int(bounds[-1])}, past the sequence ({seq_len})")
    if int(bounds[-1]) < seq_len:
        bounds = torch.cat([bounds, bounds.new_tensor([seq_len])])
    doc = torch.searchsorted(bounds, tokens, right=True) - 1
    return Documents(tokens - bounds[doc], bounds.to(torch.int32))


def causal_depthwise_conv(x: Tensor, weight: Tensor, docs: Documents) -> Tensor:
    """``SiLU(sum_j weight[:, K-1-j] * x[t - j])`` over taps ``j < K`` inside each document, with
    PyTorch ops (``docs.positions`` masks the taps before a document's start)."""
    taps = weight.shape[1]
    weight = weight.float()
    xf = x.float()
    out = xf * weight[:, taps - 1]
    for j in range(1, taps):
        shifted = F.pad(xf, (0, 0, j, 0))[:, : x.shape[1]]
        inside = (docs.positions >= j).float()[None, :, None]
        out = out + shifted * inside * weight[:, taps - 1 - j]
    return F.silu(out).to(x.dtype)


def kda_decay(f: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: Optional[float]) -> Tensor:
    """The forget gate's log decay from the low-rank projection ``f [..., H, D]``, with PyTorch ops."""
    f = f.float() + dt_bias.float().view(f.shape[-2:])
    rate = a_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * f)
    return -rate * F.softplus(f)


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``RMSNorm_D(o) * weight * sigmoid(gate)`` per row of ``D``, with PyTorch ops."""
    of = o.float()
    normed = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(o.dtype)


TORCH_KERNELS = KDAKernels(conv=causal_depthwise_conv, decay=kda_decay, delta_rule=chunk_kda_torch,
                           gated_norm=gated_rms_norm)
"""The ``torch`` backend: any device, autograd through PyTorch ops."""
