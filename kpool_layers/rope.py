"""Rotary position embedding (RoPE / YaRN) for MLA and the DSA indexer, computed on the fly for
given token positions.

Same math and channel conventions as megatron-core's ``RotaryEmbedding`` /
``YarnRotaryEmbedding`` + ``apply_rotary_pos_emb`` (unfused path), but the angle table is built for
an explicit position vector instead of ``arange(max_seq_len)``, so packed THD batches get
document-local positions (each document restarts at 0) without a cached table. Nothing is stored
on the module tree: no buffers that ``Float16Module`` could cast to bf16.

Layouts:
  * positions: int64 ``[s]`` (token position inside its document);
  * angles (megatron's ``freqs``): fp32 ``[s, 1, 1, rot_dim]``;
  * rotated tensors: megatron's ``[s, b, n, d]`` (``d >= rot_dim``; channels past ``rot_dim`` pass
    through unchanged, as with ``rotary_percent < 1``).

Conventions (both exactly as megatron):
  * ``rotary_interleaved`` - the angle table repeats every frequency on adjacent channels and
    "rotate half" pairs channels (2i, 2i+1); otherwise the table is ``cat(f, f)`` and pairs are
    (i, i + rot_dim/2). MLA configs reject it (megatron raises) but the function supports it.
  * ``mla_interleaved`` (megatron's ``mla_rotary_interleaved``) - the input's rotary channels are
    first de-interleaved (even channels, then odd channels) and the output stays in that
    de-interleaved order. MLA's q/k use it; the DSA indexer uses
    ``config.dsa_indexer_rope_interleaved``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

RotaryFn = Callable[[torch.Tensor], torch.Tensor]
"""Applies a bound rotary embedding to ``[s, b, n, rot_dim]`` (see :meth:`Rotary.bind`)."""


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def document_positions(seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token position inside its document and the document's first token index.

    ``cu_seqlens`` (int ``[n_docs + 1]``, cumulative document lengths of a packed THD sequence) or
    None for one document per sequence. Tokens past ``cu_seqlens[-1]`` form one trailing document.
    Returns ``(positions, doc_start)``, both int64 ``[seq_len]``.
    """
    tokens = torch.arange(seq_len, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        return tokens, torch.zeros_like(tokens)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = torch.searchsorted(bounds, tokens, right=True) - 1  # in [0, n_docs]
    doc_start = bounds[doc]
    return tokens - doc_start, doc_start


def apply_rotary(t: torch.Tensor, angles: torch.Tensor, *, mla_interleaved: bool,
                 rotary_interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of ``t [s, b, n, d]`` by ``angles [s, 1, 1, rot_dim]``.

    ``cos``/``sin`` are scaled by ``mscale`` (YaRN concentration) and cast to ``t.dtype`` before the
    products, as megatron does. Returns a tensor shaped like ``t``.
    """
    rot_dim = angles.size(-1)
    rot, rest = t[..., :rot_dim], t[..., rot_dim:]
    if mla_interleaved:
        rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
    cos = (angles.cos() * mscale).to(t.dtype)
    sin = (angles.sin() * mscale).to(t.dtype)
    if rotary_interleaved:
        pairs = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1)
        rotated_half = pairs.flatten(-2)
    else:
        first, second = rot.chunk(2, dim=-1)
        rotated_half = torch.cat((-second, first), dim=-1)
    return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)


@dataclass(frozen=True)
class Rotary:
    """RoPE or YaRN frequencies for ``dim`` rotary channels (build with :meth:`from_config`).

    ``concentration`` multiplies cos/sin (YaRN's mscale ratio; 1 for plain RoPE).
    """

    dim: int
    base: float
    yarn: bool
    scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    concentration: float = 1.0
    rotary_interleaved: bool = False

    @classmethod
    def from_config(cls, config: MLATransformerConfig) -> Rotary:
        """Rotary for ``config.qk_pos_emb_head_dim`` channels and ``config.rope_type``.

        Raises for NoPE (``qk_pos_emb_head_dim == 0``): NoPE models build no rotary at all.
        """
        head_dim = config.qk_pos_emb_head_dim
        if head_dim <= 0:
            raise ValueError("qk_pos_emb_head_dim == 0 (NoPE) has no rotary embedding")
        if config.rope_type == "rope":
            return cls(dim=int(head_dim * config.rotary_percent), base=config.rotary_base,
                       yarn=False, rotary_interleaved=config.rotary_interleaved)
        if config.rope_type == "yarn":
            if config.rotary_interleaved:
                raise ValueError("YaRN RoPE does not support rotary_interleaved (as megatron)")
            concentration = (yarn_get_mscale(config.rotary_scaling_factor, config.mscale)
                             / yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim))
            return cls(dim=head_dim, base=config.rotary_base, yarn=True,
                       scaling_factor=config.rotary_scaling_factor,
                       original_max_position_embeddings=config.original_max_position_embeddings,
                       beta_fast=config.beta_fast, beta_slow=config.beta_slow,
                       concentration=float(concentration))
        raise ValueError(f"rope_type={config.rope_type!r} is not supported; allowed: rope, yarn")

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """fp32 ``[dim / 2]`` inverse frequencies (YaRN-blended when ``yarn``)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        extrapolated = 1.0 / (self.base ** exponents)
        if not self.yarn:
            return extrapolated
        interpolated = 1.0 / (self.scaling_factor * self.base ** exponents)
        low, high = self._correction_range()
        if low == high:
            high += 0.001
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32, device=device) - low)
                / (high - low)).clamp(0, 1)
        keep_extrapolated = 1.0 - ramp
        return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated

    def _correction_range(self) -> tuple[float, float]:
        """YaRN's [low, high] channel range between the beta_fast/beta_slow rotation counts."""

        def channel(rotations: float) -> float:
            wavelengths = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return self.dim * math.log(wavelengths) / (2 * math.log(self.base))

        low = math.floor(channel(self.beta_fast))
        high = math.ceil(channel(self.beta_slow))
        return max(low, 0), min(high, self.dim - 1)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``[s, 1, 1, dim]`` angle table for int ``positions [s]`` (megatron's ``freqs``)."""
        inv_freq = self.inv_freq(positions.device)
        freqs = torch.outer(positions.to(torch.float32), inv_freq)
        if self.rotary_interleaved:
            table = freqs.repeat_interleave(2, dim=-1)
        else:
            table = torch.cat((freqs, freqs), dim=-1)
        return table[:, None, None, :]

    def bind(self, positions: torch.Tensor, *, mla_interleaved: bool) -> RotaryFn:
        """A function rotating ``[s, b, n, dim]`` tensors at ``positions [s]``."""
        angles = self.angles(positions)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            return apply_rotary(t, angles, mla_interleaved=mla_interleaved,
                                rotary_interleaved=self.rotary_interleaved,
                                mscale=self.concentration)

        return rotate
