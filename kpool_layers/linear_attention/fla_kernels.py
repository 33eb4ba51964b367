"""flash-linear-attention's Triton kernels as a KDA layer's :class:`~kpool_layers.linear_attention.layer_ops.KDAKernels`
(the ``fla`` backend; CUDA, fla-core 0.6.0):

==============  ================================================================================
entry           fla 0.6 kernel
==============  ================================================================================
``conv``        ``fla.modules.causal_conv1d.causal_conv1d`` (Triton backend, SiLU fused, packed
                documents through ``cu_seqlens``), one kernel forward and one backward
``decay``       ``fla.ops.kda.gate.fused_kda_gate`` (``dt_bias`` add, ``exp(A_log)`` and the
                sigmoid / softplus in one kernel each way)
``delta_rule``  ``fla.ops.kda.chunk_kda`` (precomputed log decay, q/k L2 norm in the kernel, no
                initial or final state)
``gated_norm``  ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` with the sigmoid gate
==============  ================================================================================

Each kernel imports its fla function on its first call (a dry run planning for GPUs builds the
model with them on a machine without fla), so CPU CI imports this module without the extra.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any, Optional

import torch
from torch import Tensor

from kpool_layers.linear_attention.layer_ops import Documents, KDAKernels

FLA_EXTRA = "pip install -e '.[fla]' (fla-core==0.6.0)"
KEY = "model.linear_attention_kernels"


class FlaMissing(ImportError):
    """flash-linear-attention is not installed; the message names the extra."""


@cache
def _fla(module: str, name: str) -> Any:
    """``name`` of fla's ``module``, imported on the first call (:class:`FlaMissing` without fla)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise FlaMissing(f"{KEY}=fla needs flash-linear-attention: {FLA_EXTRA}") from err


def _cu(bounds: Optional[Tensor]) -> Optional[Tensor]:
    return None if bounds is None else bounds.to(torch.long)


def short_conv_fla(x: Tensor, weight: Tensor, docs: Documents) -> Tensor:
    """fla's ``causal_conv1d`` (Triton backend, SiLU) behind ``KDAKernels.conv``."""
    y, _ = _fla("fla.modules.causal_conv1d", "causal_conv1d")(
        x=x, weight=weight, activation="silu", backend="triton", cu_seqlens=_cu(docs.bounds))
    return y


def decay_fla(f: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: Optional[float]) -> Tensor:
    """fla's ``fused_kda_gate`` behind ``KDAKernels.decay`` (float32 output)."""
    return _fla("fla.ops.kda.gate", "fused_kda_gate")(f, a_log, dt_bias, lower_bound, torch.float32)


def chunk_kda_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """fla's ``chunk_kda`` behind ``KDAKernels.delta_rule`` (precomputed log decay, q/k L2 norm in
    the kernel, no initial or final state)."""
    out, _ = _fla("fla.ops.kda", "chunk_kda")(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=True, cu_seqlens=_cu(cu_seqlens))
    return out.to(v.dtype)


def gated_norm_fla(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fla's ``rms_norm_gated`` with the sigmoid gate behind ``KDAKernels.gated_norm``."""
    return _fla("fla.modules.norm.fused_norm_gate", "rms_norm_gated")(
        x=o, g=gate, weight=weight, bias=None, activation="sigmoid", eps=eps)


FLA_KERNELS = KDAKernels(conv=short_conv_fla, decay=decay_fla, delta_rule=chunk_kda_fla, gated_norm=gated_norm_fla)
"""The ``fla`` backend (each kernel imports fla on its first call)."""
