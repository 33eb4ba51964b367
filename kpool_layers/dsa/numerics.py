"""The numerics an indexer computation runs under: how its projections compute and how it scores.

:class:`IndexerNumerics` is one value per computation (training, or a drift reference that
recomputes the selection under another profile); :func:`indexer_numerics` is the one a
:class:`~kpool_layers.precision.policy.PrecisionPolicy` gives with unquantized projections. The
policy does not know the indexer: this module reads the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from kpool_layers.precision.policy import DType, PrecisionPolicy, Role


@dataclass(frozen=True)
class RoutedProjections:
    """The q / k / head-weights projections and the KPool gate run their role-tagged linears'
    forwards (:mod:`kpool_layers.precision.linears`: FP8, or the role's dtype, as the policy says): the
    training path."""

    def qk(self, linear: torch.nn.Linear, x: Tensor) -> Tensor:
        """``linear(x)``: ``x [..., n_in]`` -> ``[..., n_out]`` (q / k projection, KPool gate)."""
        return linear(x)

    def weights(self, linear: torch.nn.Linear, x: Tensor) -> Tensor:
        """``linear(x)``: ``x [..., hidden]`` -> ``[..., n_heads]`` (head weights, ``kpool == 1``)."""
        return linear(x)


@dataclass(frozen=True)
class PlainProjections:
    """The projections as unquantized GEMMs ``x @ w.T`` in a given dtype (input and weight cast;
    the same GEMM a role-tagged linear computes for an unquantized role), bypassing the linears'
    own numerics: the drift reference.

    ``qk_dtype``: q / k projections and KPool gate; ``weights_dtype``: head-weights projection
    (``kpool > 1`` keeps the KPool contract's FP32 GEMM whatever the numerics)."""

    qk_dtype: torch.dtype
    weights_dtype: torch.dtype

    def qk(self, linear: torch.nn.Linear, x: Tensor) -> Tensor:
        """``x [..., n_in]`` -> ``[..., n_out]`` in ``qk_dtype``."""
        return x.to(self.qk_dtype) @ linear.weight.to(self.qk_dtype).t()

    def weights(self, linear: torch.nn.Linear, x: Tensor) -> Tensor:
        """``x [..., hidden]`` -> ``[..., n_heads]`` in ``weights_dtype``."""
        return x.to(self.weights_dtype) @ linear.weight.to(self.weights_dtype).t()


@dataclass(frozen=True)
class IndexerNumerics:
    """The numerics of one indexer computation (training or a drift reference).

    ``projections``: how the linears run (:class:`RoutedProjections` = training,
    :class:`PlainProjections` = plain GEMMs in given dtypes); ``k_norm_fp32``: key LayerNorm in
    FP32; ``index_quant``: serving scale format (``ue8m0`` | ``amax``) to score with
    :func:`~kpool_layers.precision.fp8.serving_index_quant`-ed inputs, None = score the (rotated) q / keys as they are."""

    projections: RoutedProjections | PlainProjections
    k_norm_fp32: bool
    index_quant: Optional[str]


def indexer_numerics(policy: PrecisionPolicy) -> IndexerNumerics:
    """The DSA indexer's numerics under ``policy``, with unquantized projections (what a drift
    reference of this profile recomputes): q/k projections in the q/k roles' dtype, the
    head-weights projection in its role's, the key LayerNorm in FP32 when
    ``dsa_indexer_k_norm_fp32`` or an FP32 model, and serving-quantized scoring in
    ``scale_format`` when ``dsa_indexer_kpool_use_quantization``."""
    return IndexerNumerics(
        projections=PlainProjections(
            qk_dtype=policy.compute_dtype(Role.INDEXER_Q, policy.params_dtype),
            weights_dtype=policy.compute_dtype(Role.INDEXER_WEIGHTS, policy.params_dtype),
        ),
        k_norm_fp32=policy.dsa_indexer_k_norm_fp32 or policy.dtype == DType.fp32,
        index_quant=policy.scale_format.value if policy.dsa_indexer_kpool_use_quantization else None,
    )
