"""Norm layers for the local (no Transformer Engine) backend that support sequence parallelism.

megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel=True``, which TP>1 with MoE needs.
These norms are the same math as ``torch.nn.RMSNorm``/``LayerNorm``; under sequence parallelism each
TP rank sees a different slice of the sequence, so their parameters are tagged
``param.sequence_parallel = True`` and megatron's ``finalize_model_grads`` all-reduces their
gradients over the TP group (exactly as it does for Transformer Engine's norms).

Layout: any ``[..., hidden]`` input (megatron passes ``[s, b, h]``); normalisation is over the last dim.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


def _tag_sequence_parallel(module: torch.nn.Module, config: TransformerConfig) -> None:
    for param in module.parameters():
        param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


class SPRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over the last dim, sequence-parallel aware."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        _tag_sequence_parallel(self, config)


class SPLayerNorm(torch.nn.LayerNorm):
    """LayerNorm (with bias) over the last dim, sequence-parallel aware."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        _tag_sequence_parallel(self, config)


class SPNorm:
    """Builds :class:`SPRMSNorm` or :class:`SPLayerNorm` from ``config.normalization``; a drop-in
    for megatron's ``WrappedTorchNorm`` in layer specs."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: object) -> torch.nn.Module:
        if config.normalization == "RMSNorm":
            return SPRMSNorm(config, hidden_size, eps)
        if config.normalization == "LayerNorm":
            return SPLayerNorm(config, hidden_size, eps)
        raise ValueError(
            f"model.normalization={config.normalization!r} is not supported; allowed: RMSNorm, LayerNorm"
        )
