"""Rotary position embedding (RoPE / YaRN) for MLA and the DSA indexer, computed on the fly for
given token positions.

Same math and channel conventions as megatron-core's ``RotaryEmbedding`` /
``YarnRotaryEmbedding`` + ``apply_rotary_pos_emb`` (unfused path), but the angle table is built for
an explicit position vector instead of ``arange(max_seq_len)``, so packed THD batches get
document-local positions (each document restarts at 0) without a max-length table. Nothing is
stored on the module tree (no buffers that ``Float16Module`` could cast to bf16); the tables of one
document's positions ``0 .. s - 1`` are built once per length, device and dtype and shared by all
layers and micro batches (:meth:`Rotary.bind_arange`, :func:`arange_positions`). A rotation is five
elementwise kernels forward and five backward (:class:`RotaryTables`).

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

import functools
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


@functools.lru_cache(maxsize=32)
def arange_positions(seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0 .. seq_len - 1`` of one document and its start (zeros), both int64
    ``[seq_len]``; built once per length and device and shared (read-only) by every caller."""
    with torch.inference_mode(False):
        tokens = torch.arange(seq_len, device=device, dtype=torch.int64)
        return tokens, torch.zeros_like(tokens)


def document_positions(seq_len: int, cu_seqlens: torch.Tensor | None, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token position inside its document and the document's first token index.

    ``cu_seqlens`` (int ``[n_docs + 1]``, cumulative document lengths of a packed THD sequence) or
    None for one document per sequence. Tokens past ``cu_seqlens[-1]`` form one trailing document.
    Returns ``(positions, doc_start)``, both int64 ``[seq_len]`` (without ``cu_seqlens`` the
    shared tensors of :func:`arange_positions`: read them, never write).
    """
    if cu_seqlens is None:
        return arange_positions(seq_len, device)
    tokens = torch.arange(seq_len, device=device, dtype=torch.int64)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = torch.searchsorted(bounds, tokens, right=True) - 1  # in [0, n_docs]
    doc_start = bounds[doc]
    return tokens - doc_start, doc_start


@dataclass(frozen=True)
class RotaryTables:
    """The products' factors of one rotation, in the rotated tensor's dtype: ``cos`` and ``sin``
    (``[s, 1, 1, rot_dim]``, scaled by ``mscale`` then cast, as megatron does), with the sign of
    "rotate half" folded into ``sin``: ``x * cos + partner(x) * sin`` equals megatron's
    ``x * cos + rotate_half(x) * sin`` bit for bit (``(-a) * b == a * (-b)`` exactly)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_interleaved: bool

    @classmethod
    def of(cls, angles: torch.Tensor, dtype: torch.dtype, *, rotary_interleaved: bool,
           mscale: float) -> RotaryTables:
        """Tables of ``angles [s, 1, 1, rot_dim]`` (megatron's ``freqs``) for tensors of ``dtype``."""
        half = angles.size(-1) // 2
        sign = torch.ones(angles.size(-1), dtype=dtype, device=angles.device)
        if rotary_interleaved:  # pairs (2i, 2i+1) -> (-x[2i+1], x[2i])
            sign[0::2] = -1
        else:  # halves -> (-second, first)
            sign[:half] = -1
        cos = (angles.cos() * mscale).to(dtype)
        sin = (angles.sin() * mscale).to(dtype) * sign
        return cls(cos=cos, sin=sin, rotary_interleaved=rotary_interleaved)

    def partner(self, x: torch.Tensor) -> torch.Tensor:
        """Every channel's rotation partner: halves swapped, or the channels of each pair swapped
        (``rotary_interleaved``); one copy kernel."""
        if self.rotary_interleaved:
            return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return x.roll(x.size(-1) // 2, dims=-1)

    def rotate(self, t: torch.Tensor, *, mla_interleaved: bool) -> torch.Tensor:
        """Rotate the first ``rot_dim`` channels of ``t [s, b, n, d]``; a tensor shaped like ``t``."""
        rot_dim = self.cos.size(-1)
        rot = t[..., :rot_dim] if t.size(-1) > rot_dim else t
        if mla_interleaved:  # even channels, then odd channels: one copy
            rot = rot.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        out = rot * self.cos + self.partner(rot) * self.sin
        if t.size(-1) == rot_dim:
            return out
        return torch.cat((out, t[..., rot_dim:]), dim=-1)


def apply_rotary(t: torch.Tensor, angles: torch.Tensor, *, mla_interleaved: bool,
                 rotary_interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of ``t [s, b, n, d]`` by ``angles [s, 1, 1, rot_dim]``.

    ``cos``/``sin`` are scaled by ``mscale`` (YaRN concentration) and cast to ``t.dtype`` before the
    products, as megatron does. Returns a tensor shaped like ``t``.
    """
    tables = RotaryTables.of(angles, t.dtype, rotary_interleaved=rotary_interleaved, mscale=mscale)
    return tables.rotate(t, mla_interleaved=mla_interleaved)


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

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """:class:`RotaryTables` at int ``positions [s]`` for tensors of ``dtype``."""
        return RotaryTables.of(self.angles(positions), dtype,
                               rotary_interleaved=self.rotary_interleaved, mscale=self.concentration)

    def bind(self, positions: torch.Tensor, *, mla_interleaved: bool) -> RotaryFn:
        """A function rotating ``[s, b, n, dim]`` tensors at ``positions [s]`` (tables built at
        the first call of each dtype)."""
        built: dict[torch.dtype, RotaryTables] = {}

        def rotate(t: torch.Tensor) -> torch.Tensor:
            if t.dtype not in built:
                built[t.dtype] = self.tables(positions, t.dtype)
            return built[t.dtype].rotate(t, mla_interleaved=mla_interleaved)

        return rotate

    def bind_arange(self, seq_len: int, device: torch.device, *, mla_interleaved: bool) -> RotaryFn:
        """:meth:`bind` at positions ``0 .. seq_len - 1`` with tables kept across calls (one
        build per length, device and dtype for all layers and micro batches)."""

        def rotate(t: torch.Tensor) -> torch.Tensor:
            return _arange_tables(self, seq_len, device, t.dtype).rotate(t, mla_interleaved=mla_interleaved)

        return rotate


@functools.lru_cache(maxsize=32)
def _arange_tables(rotary: Rotary, seq_len: int, device: torch.device, dtype: torch.dtype) -> RotaryTables:
    """``rotary``'s tables at positions ``0 .. seq_len - 1`` (plain tensors even when first built
    under inference mode, so that autograd may save them)."""
    with torch.inference_mode(False), torch.no_grad():
        return rotary.tables(arange_positions(seq_len, device)[0], dtype)
