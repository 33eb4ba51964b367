"""Sparse MLA core attention: the swappable ``core_attention`` submodule of
:class:`kpool_layers.mla.attention.GLMSparseMLA`, one class per ``dsa_kernels`` backend.

Every class computes the same function (:func:`kpool_layers.dsa.sparse_attention.sparse_mla_attention`'s
contract): ``forward(query [s_q, b, n, d_k], latent_kv [s_kv, b, 1, d_k], topk_indices int
[b, s_q, W], key_start int64 [s_q] | None, query_pos int64 [s_q] | None) -> [s_q, b, n,
v_channels]``, causal attention of every query row over its selected latent keys (key positions in
``[0, s_kv)``; slots outside ``[key_start[i], query_pos[i]]`` and ``-1`` ignored; a query without a
valid key gives zeros). ``query_pos`` is the key position of each query row in the full sequence,
None meaning ``arange(s_q)`` (then ``s_kv == s_q``): with context parallelism a rank passes its
(non-contiguous, load-balanced) query rows and the gathered latent keys of the whole sequence, and
its ``latent_kv`` gradient ``[s_kv, b, 1, d_k]`` is this rank's share of the full one (zero on keys
its rows do not select). The layer builds it with ``(config, softmax_scale, v_channels)``.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.dsa.backends import MANIFEST, KernelFacts
from kpool_layers.dsa.sparse_attention import sparse_mla_attention


class SparseMLACore(MegatronModule):
    """Base: holds the scale and the value width; each backend's subclass defines ``forward``."""

    backend = ""
    provides_slot_probs = False
    """Whether ``forward(..., return_slot_probs=True)`` also returns each slot's attention
    probability summed over heads, fp32 ``[b, s_q, W]`` (the sparse indexer-loss target)."""

    def __init__(self, config: GLMTransformerConfig, softmax_scale: float, v_channels: int) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.v_channels = v_channels

    @property
    def facts(self) -> KernelFacts:
        """What this backend guarantees (determinism, dtypes)."""
        return MANIFEST[self.backend]


class TorchSparseMLA(SparseMLACore):
    """Chunked PyTorch (``config.dsa_indexer_query_chunk_size`` queries at a time); the reference."""

    backend = "torch"

    def forward(self, query: Tensor, latent_kv: Tensor, topk_indices: Tensor,
                key_start: Optional[Tensor], query_pos: Optional[Tensor] = None) -> Tensor:
        return sparse_mla_attention(query, latent_kv, topk_indices, self.softmax_scale,
                                    v_channels=self.v_channels,
                                    chunk_size=self.config.dsa_indexer_query_chunk_size,
                                    key_start=key_start, query_pos=query_pos)


class TileLangSparseMLA(SparseMLACore):
    """megatron-core's TileLang SparseMLA (bf16, 576/512 or NoPE 512/512 padded)."""

    backend = "tilelang"

    def __init__(self, config: GLMTransformerConfig, softmax_scale: float, v_channels: int) -> None:
        super().__init__(config, softmax_scale, v_channels)
        from kpool_layers.kernels.tilelang_dsa import megatron_sparse_mla

        self._kernel = megatron_sparse_mla()

    def forward(self, query: Tensor, latent_kv: Tensor, topk_indices: Tensor,
                key_start: Optional[Tensor], query_pos: Optional[Tensor] = None) -> Tensor:
        from kpool_layers.kernels.tilelang_dsa import sparse_mla_tilelang

        return sparse_mla_tilelang(query, latent_kv, topk_indices, self.softmax_scale,
                                   v_channels=self.v_channels, key_start=key_start,
                                   query_pos=query_pos, kernel=self._kernel)


class TritonSparseMLA(SparseMLACore):
    """Our Triton kernels: forward + backward with a latent-key gradient reduced in a fixed order
    (bit-reproducible)."""

    backend = "triton"
    provides_slot_probs = True

    def forward(self, query: Tensor, latent_kv: Tensor, topk_indices: Tensor,
                key_start: Optional[Tensor], query_pos: Optional[Tensor] = None,
                return_slot_probs: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

        return sparse_mla_triton(query, latent_kv, topk_indices, self.softmax_scale,
                                 v_channels=self.v_channels, key_start=key_start,
                                 query_pos=query_pos, return_slot_probs=return_slot_probs)


CORE_ATTENTION: dict[str, type[SparseMLACore]] = {
    cls.backend: cls for cls in (TorchSparseMLA, TileLangSparseMLA, TritonSparseMLA)
}
"""Resolved ``dsa_kernels`` backend -> its core attention class."""
