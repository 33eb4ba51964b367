"""Rotary position embedding (RoPE / YaRN) for MLA and the DSA indexer, computed on the fly for
given token positions.

Same math and channel conventions as megatron-core's ``RotaryEmbedding`` /
``YarnRotaryEmbedding`` + ``apply_rotary_pos_emb`` (unfused path), but the angle table is built for
an explicit position vector instead of ``arange(max_seq_len)``, so packed THD batches get
document-local positions (each document restarts at 0) without a max-length table. Nothing is
stored on the module tree (no buffers that ``Float16Module`` could cast to bf16); the tables of one
document's positions ``0 .. s - 1`` are built once per length, device and dtype and shared by all
layers and micro batches (:meth:`Rotary.bind_arange`, :func:`arange_positions`). A rotation is five
elementwise kernels forward and five backward as torch ops (:class:`RotaryTables`); on CUDA, BF16
tensors take one Triton kernel each way where the kernel route :data:`ROPE` resolved to ``triton``
(:mod:`kpool_layers.kernels.rope_triton`: the same operations in the same order, bit for bit),
which also writes the channels a rotation is concatenated with (:meth:`BoundRotary.concat`: MLA's
query and key are ``cat(latent, rotated pe)``) and the channels past the rotary ones.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig

from kpool_layers.kernel_routes import KernelBackend, Route, needs_cuda, needs_package, register


def _triton_rope() -> ModuleType:
    from kpool_layers.kernels import rope_triton

    return rope_triton


ROPE = register(Route("rope", (
    KernelBackend("triton", _triton_rope, "one Triton kernel per rotation and per gradient (BF16), "
                  "the copy of the channels it is concatenated with included",
                  declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: None, "elementwise torch ops: five kernels each way, and a cat"),
), summary="rotary position embedding of MLA's and the DSA indexer's queries and keys"))
"""``rope``: where :class:`RotaryTables` rotates CUDA tensors of :data:`KERNEL_DTYPES`."""

KERNEL_DTYPES = (torch.bfloat16,)
"""Dtypes the Triton kernel rotates (others take the torch ops)."""


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

    def rotate_torch(self, t: torch.Tensor, *, mla_interleaved: bool) -> torch.Tensor:
        """Rotate the first ``rot_dim`` channels of ``t [s, b, n, d]`` with torch ops; a tensor
        shaped like ``t``."""
        rot_dim = self.cos.size(-1)
        rot = t[..., :rot_dim] if t.size(-1) > rot_dim else t
        if mla_interleaved:  # even channels, then odd channels: one copy
            rot = rot.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        out = rot * self.cos + self.partner(rot) * self.sin
        if t.size(-1) == rot_dim:
            return out
        return torch.cat((out, t[..., rot_dim:]), dim=-1)

    def rotate(self, t: torch.Tensor, *, mla_interleaved: bool,
               kernel: Optional[ModuleType] = None) -> torch.Tensor:
        """:meth:`rotate_torch`'s result, by ``kernel`` (the Triton module) when given, else by
        the one :data:`ROPE` chose for ``t`` (:func:`route_kernel`), else by the torch ops."""
        kernel = kernel or route_kernel(t, self.cos.size(-1))
        if kernel is None:
            return self.rotate_torch(t, mla_interleaved=mla_interleaved)
        return _Rotate.apply(t, self, mla_interleaved, kernel)

    def rotate_concat(self, rests: Sequence[torch.Tensor], pes: Sequence[torch.Tensor], *,
                      mla_interleaved: bool, kernel: Optional[ModuleType] = None
                      ) -> list[torch.Tensor]:
        """``[cat([rest_i, rotate(pe_i)], -1)]`` for ``rest_i [s, b, n_i, d_i]`` and ``pe_i [s, b,
        n_i, rot_dim]``: one kernel per pair each way by ``kernel`` (or :data:`ROPE`'s choice);
        the torch ops rotate the pes as one tensor (their heads concatenated) and cat each pair."""
        rot_dim = self.cos.size(-1)
        kernel = kernel or route_kernel(pes[0], rot_dim)
        if kernel is not None and all(
                pe.shape[-1] == rot_dim and pe.stride(-1) == 1 and rest.dtype == pe.dtype == pes[0].dtype
                and rest.shape[:-1] == pe.shape[:-1] for rest, pe in zip(rests, pes, strict=True)):
            return [_RotateConcat.apply(rest, pe, self, mla_interleaved, kernel)
                    for rest, pe in zip(rests, pes)]
        heads = [pe.size(2) for pe in pes]
        rotated = self.rotate_torch(torch.cat(list(pes), dim=2) if len(pes) > 1 else pes[0],
                                    mla_interleaved=mla_interleaved).split(heads, dim=2)
        return [torch.cat([rest, pe], dim=-1) for rest, pe in zip(rests, rotated, strict=True)]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` as ``[s, rot_dim]`` (the kernel's layout; views)."""
        return self.cos.view(self.cos.size(0), -1), self.sin.view(self.sin.size(0), -1)


def route_kernel(t: torch.Tensor, rot_dim: int) -> Optional[ModuleType]:
    """The Triton module :data:`ROPE` chose, for a CUDA ``t`` of :data:`KERNEL_DTYPES` with unit
    stride in its last dimension and a power-of-two ``rot_dim``; else None (the torch ops)."""
    if (not t.is_cuda or t.dtype not in KERNEL_DTYPES or t.dim() != 4 or t.stride(-1) != 1
            or rot_dim & (rot_dim - 1) or rot_dim < 2 or ROPE.default().backend != "triton"):
        return None
    return ROPE.default().kernel


def _unit_last(g: torch.Tensor) -> torch.Tensor:
    """``g`` with unit stride in its last dimension (the kernel's views)."""
    return g if g.stride(-1) == 1 else g.contiguous()


class _Rotate(torch.autograd.Function):
    """``t [s, b, n, d]`` -> its first ``rot_dim`` channels rotated, the rest copied: one kernel
    forward, one backward (the gradient's rest channels copied, its rotary ones rotated back)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, tables: RotaryTables, mla_interleaved: bool,
                kernel: ModuleType) -> torch.Tensor:
        rot = tables.cos.size(-1)
        cos, sin = tables.rows()
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        kernel.rope(t[..., :rot], t[..., rot:], cos, sin, out[..., :rot], out[..., rot:], backward=False,
                    mla_interleaved=mla_interleaved, pairs=tables.rotary_interleaved)
        ctx.args = (tables, mla_interleaved, kernel)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        tables, mla_interleaved, kernel = ctx.args
        rot = tables.cos.size(-1)
        cos, sin = tables.rows()
        grad = _unit_last(grad)
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        kernel.rope(grad[..., :rot], grad[..., rot:], cos, sin, out[..., :rot], out[..., rot:], backward=True,
                    mla_interleaved=mla_interleaved, pairs=tables.rotary_interleaved)
        return out, None, None, None


class _RotateConcat(torch.autograd.Function):
    """``cat([rest [s, b, n, d], rotate(pe [s, b, n, rot_dim])], -1)``: one kernel forward; backward
    the rest's gradient is a view of the output's, the pe's one kernel."""

    @staticmethod
    def forward(ctx: Any, rest: torch.Tensor, pe: torch.Tensor, tables: RotaryTables,
                mla_interleaved: bool, kernel: ModuleType) -> torch.Tensor:
        d = rest.size(-1)
        cos, sin = tables.rows()
        out = torch.empty(*pe.shape[:-1], d + pe.size(-1), dtype=pe.dtype, device=pe.device)
        kernel.rope(pe, _unit_last(rest), cos, sin, out[..., d:], out[..., :d], backward=False,
                    mla_interleaved=mla_interleaved, pairs=tables.rotary_interleaved)
        ctx.args = (d, tables, mla_interleaved, kernel)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        d, tables, mla_interleaved, kernel = ctx.args
        cos, sin = tables.rows()
        grad = _unit_last(grad)
        grad_pe = torch.empty(*grad.shape[:-1], grad.size(-1) - d, dtype=grad.dtype, device=grad.device)
        kernel.rope(grad[..., d:], None, cos, sin, grad_pe, None, backward=True,
                    mla_interleaved=mla_interleaved, pairs=tables.rotary_interleaved)
        return grad[..., :d], grad_pe, None, None, None


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

    def bind(self, positions: torch.Tensor, *, mla_interleaved: bool) -> BoundRotary:
        """This rotary at ``positions [s]`` (tables built at the first use of each dtype)."""
        built: dict[torch.dtype, RotaryTables] = {}

        def tables(dtype: torch.dtype) -> RotaryTables:
            if dtype not in built:
                built[dtype] = self.tables(positions, dtype)
            return built[dtype]

        return BoundRotary(tables, mla_interleaved)

    def bind_arange(self, seq_len: int, device: torch.device, *, mla_interleaved: bool) -> BoundRotary:
        """:meth:`bind` at positions ``0 .. seq_len - 1`` with tables kept across calls (one
        build per length, device and dtype for all layers and micro batches)."""
        return BoundRotary(functools.partial(_arange_tables, self, seq_len, device), mla_interleaved)


@dataclass(frozen=True)
class BoundRotary:
    """A rotary at fixed positions: calling it on ``t [s, b, n, d]`` rotates the first ``rot_dim``
    channels (:meth:`RotaryTables.rotate`); :meth:`concat` rotates pes into concatenations.
    ``tables`` gives the tables of a dtype (built once)."""

    tables: Callable[[torch.dtype], RotaryTables]
    mla_interleaved: bool

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.tables(t.dtype).rotate(t, mla_interleaved=self.mla_interleaved)

    def concat(self, rests: Sequence[torch.Tensor], pes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``[cat([rest_i, rotate(pe_i)], -1)]`` (:meth:`RotaryTables.rotate_concat`)."""
        return self.tables(pes[0].dtype).rotate_concat(rests, pes, mla_interleaved=self.mla_interleaved)


@functools.lru_cache(maxsize=32)
def _arange_tables(rotary: Rotary, seq_len: int, device: torch.device, dtype: torch.dtype) -> RotaryTables:
    """``rotary``'s tables at positions ``0 .. seq_len - 1`` (plain tensors even when first built
    under inference mode, so that autograd may save them)."""
    with torch.inference_mode(False), torch.no_grad():
        return rotary.tables(arange_positions(seq_len, device)[0], dtype)
