"""Per-layer facts of a GLM-5.x decoder, from plain numbers: which layers compute their own DSA
top-k (IndexShare), which are MoE, which KPool sizes are valid.

The one definition of each fact. :class:`kpool_layers.config.GLMTransformerConfig` exposes them as
methods (``computes_topk``, ``topk_source_layer``, ``is_moe``); the recipes (schema, dry run, HF
mapping and config) call these functions with their ``model`` group's numbers. Nothing here
imports megatron; the tests check the rules against megatron's ``is_dsa_skip_topk_layer``,
``source_dsa_compute_layer`` and ``get_moe_layer_pattern``.

Layer numbers are 1-based decoder layers (megatron's ``layer_number``); MTP layers number from 1
again in their own block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

KPOOL_ALLOWED = (1, 2, 4, 8, 16, 32, 64)
"""Powers of two that divide 64 (the serving engines' index-cache page size)."""

MoeLayerFreq = Union[int, list[int]]
"""megatron's ``moe_layer_freq``: one MoE layer every N layers, or a 0/1 pattern per layer."""


def _first_shared_layer(skip_topk_offset: int) -> int:
    """IndexShare counts from layer ``max(offset, 1)`` (offset 0 still starts at layer 1)."""
    return max(skip_topk_offset, 1)


def computes_topk(layer_number: int, topk_freq: int, skip_topk_offset: int) -> bool:
    """Whether layer ``layer_number`` runs its own indexer: every layer up to ``max(offset, 1)``,
    then every ``topk_freq``-th layer from there (``topk_freq = 1``: every layer)."""
    start = _first_shared_layer(skip_topk_offset)
    return max(layer_number - start, 0) % topk_freq == 0


def topk_source_layer(layer_number: int, topk_freq: int, skip_topk_offset: int) -> int:
    """The computing layer whose top-k layer ``layer_number`` uses (itself when it computes)."""
    start = _first_shared_layer(skip_topk_offset)
    if layer_number <= start:
        return layer_number
    return layer_number - (layer_number - start) % topk_freq


def topk_layers(num_layers: int, topk_freq: int, skip_topk_offset: int) -> list[int]:
    """The layers (of ``1..num_layers``) that compute their own top-k."""
    return [n for n in range(1, num_layers + 1) if computes_topk(n, topk_freq, skip_topk_offset)]


def moe_layer_freq(num_layers: int, num_moe_experts: Optional[int],
                   first_k_dense_layers: int) -> MoeLayerFreq:
    """megatron's ``moe_layer_freq`` for GLM-5.x's layout: ``first_k_dense_layers`` dense layers,
    then MoE (``1``, i.e. all layers MoE, when the model has no experts: they are then dense)."""
    if not num_moe_experts:
        return 1
    return [0] * first_k_dense_layers + [1] * (num_layers - first_k_dense_layers)


def is_moe(layer_number: int, num_moe_experts: Optional[int], freq: MoeLayerFreq) -> bool:
    """Whether layer ``layer_number`` is an MoE layer under megatron's ``moe_layer_freq``
    ``freq``; never without experts. MTP layers copy the last decoder layer's kind."""
    if not num_moe_experts:
        return False
    if isinstance(freq, int):
        return (layer_number - 1) % freq == 0
    return bool(freq[layer_number - 1])


def kpool_problem(kpool: int, topk: Optional[int]) -> Optional[tuple[str, int, str]]:
    """``(field, value, allowed)`` of the first KPool rule that ``kpool`` / ``topk`` break (None
    when both are valid; ``topk`` None is not checked)."""
    if kpool not in KPOOL_ALLOWED:
        return ("dsa_indexer_kpool", kpool,
                f"{list(KPOOL_ALLOWED)} (powers of two dividing 64, the serving index-cache page)")
    if topk is not None and (topk < 1 or topk % kpool != 0):
        return "dsa_indexer_topk", topk, f"a positive multiple of dsa_indexer_kpool={kpool}"
    return None


LINEAR_ATTENTION = "linear_attention"
"""transformers' ``layer_types`` name of a KDA layer (``model.linear_attention_freq`` 1)."""
INDEXED_ATTENTION = "indexed_attention"
"""transformers' ``layer_types`` name of a DSA MLA layer (``model.linear_attention_freq`` 0)."""
INDEXER_TYPES = ("full", "shared")
"""transformers' ``indexer_types``: ``full`` runs the indexer, ``shared`` reuses a top-k."""

LinearAttentionFreq = Union[None, int, list[int]]
"""megatron's ``linear_attention_freq``: None (no linear attention), N (layers ``N, 2N, ...``
are DSA, the others KDA) or a 0/1 pattern per layer (1 = KDA)."""


def linear_attention_pattern(num_layers: int, freq: LinearAttentionFreq) -> list[bool]:
    """Per decoder layer (0-based list), whether it is a KDA layer; megatron's rule
    (``experimental_attention_variant_module_specs``: layer ``i`` (0-based) is softmax attention
    iff ``(i + 1) % freq == 0``)."""
    if freq is None:
        return [False] * num_layers
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(num_layers)]
    return [bool(v) for v in freq]


def linear_attention_problem(num_layers: int, freq: Any) -> Optional[str]:
    """Why ``freq`` is not a valid ``linear_attention_freq`` for ``num_layers`` layers (None
    when it is)."""
    if freq is None:
        return None
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        return "null, an integer >= 1 or a list of 0/1 per layer"
    if isinstance(freq, int):
        return None if freq >= 1 else "an integer >= 1 (1 = no KDA layer)"
    if len(freq) != num_layers or any(v not in (0, 1) or isinstance(v, float) for v in freq):
        return f"a list of {num_layers} (model.num_layers) entries, each 0 (DSA) or 1 (KDA)"
    return None


@dataclass(frozen=True)
class LayerPattern:
    """Which attention each decoder layer has and which DSA layers compute their own top-k.

    ``indexer_types`` (transformers' ``full``/``shared`` per layer, entries of KDA layers ignored)
    replaces the ``topk_freq`` / ``skip_topk_offset`` schedule when given: a ``shared`` DSA layer
    uses the top-k of the nearest earlier ``full`` DSA layer. KDA layers compute no top-k.
    :meth:`of` reads the fields from any object carrying the ``model`` group's names
    (the schema's node or :class:`kpool_layers.config.GLMTransformerConfig`)."""

    num_layers: int
    topk_freq: int = 1
    skip_topk_offset: int = 0
    indexer_types: Optional[tuple[str, ...]] = None
    linear_attention_freq: Any = None

    @classmethod
    def of(cls, model: Any) -> "LayerPattern":
        """The pattern of a ``model`` group / transformer config."""
        types = getattr(model, "dsa_indexer_types", None)
        freq = getattr(model, "linear_attention_freq", None)
        return cls(num_layers=int(model.num_layers), topk_freq=int(model.dsa_indexer_topk_freq),
                   skip_topk_offset=int(model.dsa_indexer_skip_topk_offset),
                   indexer_types=None if types is None else tuple(str(t) for t in types),
                   linear_attention_freq=freq if freq is None or isinstance(freq, int) else
                   [int(v) for v in freq])

    def is_linear_attention(self, layer_number: int) -> bool:
        """Whether 1-based ``layer_number`` is a KDA layer."""
        return linear_attention_pattern(self.num_layers, self.linear_attention_freq)[layer_number - 1]

    @property
    def hybrid(self) -> bool:
        """Whether any layer is a KDA layer."""
        return any(linear_attention_pattern(self.num_layers, self.linear_attention_freq))

    def layer_types(self) -> list[str]:
        """transformers' ``layer_types``."""
        return [LINEAR_ATTENTION if la else INDEXED_ATTENTION
                for la in linear_attention_pattern(self.num_layers, self.linear_attention_freq)]

    def computes_topk(self, layer_number: int) -> bool:
        """Whether DSA layer ``layer_number`` runs its own indexer (False for KDA layers)."""
        if self.is_linear_attention(layer_number):
            return False
        if self.indexer_types is not None:
            return self.indexer_types[layer_number - 1] == "full"
        return computes_topk(layer_number, self.topk_freq, self.skip_topk_offset)

    def topk_source_layer(self, layer_number: int) -> int:
        """The computing layer whose top-k DSA layer ``layer_number`` uses (itself if it
        computes); ValueError when no earlier layer computes one."""
        if self.indexer_types is None:
            return topk_source_layer(layer_number, self.topk_freq, self.skip_topk_offset)
        for n in range(layer_number, 0, -1):
            if self.computes_topk(n):
                return n
        raise ValueError(f"DSA layer {layer_number} is 'shared' but no earlier DSA layer is 'full'")

    def topk_layers(self) -> list[int]:
        """The layers that compute their own top-k."""
        return [n for n in range(1, self.num_layers + 1) if self.computes_topk(n)]

    @property
    def shares_topk(self) -> bool:
        """Whether some DSA layer reuses another's top-k (IndexShare)."""
        dsa = [n for n in range(1, self.num_layers + 1) if not self.is_linear_attention(n)]
        return any(not self.computes_topk(n) for n in dsa)

    def indexer_types_problem(self) -> Optional[str]:
        """Why ``indexer_types`` is invalid (None when it is valid or not given)."""
        types = self.indexer_types
        if types is None:
            return None
        if len(types) != self.num_layers or any(t not in INDEXER_TYPES for t in types):
            return f"a list of {self.num_layers} (model.num_layers) entries, each of {list(INDEXER_TYPES)}"
        for n in range(1, self.num_layers + 1):
            if not self.is_linear_attention(n) and not any(self.computes_topk(m) for m in range(1, n + 1)):
                return f"'full' on the first DSA layer (layer {n} is 'shared' with no 'full' DSA layer before it)"
        return None

    def hf_shareable(self) -> Optional[int]:
        """The first ``shared`` DSA layer whose previous layer is not a ``full`` DSA layer
        (transformers' glm5_next hands a top-k only to the next layer), or None."""
        for n in range(2, self.num_layers + 1):
            if not self.is_linear_attention(n) and not self.computes_topk(n) and not self.computes_topk(n - 1):
                return n
        if self.num_layers and not self.is_linear_attention(1) and not self.computes_topk(1):
            return 1
        return None
