"""Which kernel computes KDA's chunked delta rule: the ``model.linear_attention_kernels`` key.

==========  ==================================================================================
backend     delta rule
==========  ==================================================================================
``torch``   :func:`kpool_layers.linear_attention.delta_rule.chunk_kda_torch` (any device; fp32
            math, fp64 for fp64 inputs; autograd through PyTorch ops)
``fla``     flash-linear-attention's Triton ``chunk_kda`` (CUDA; the optional extra
            ``pip install -e '.[fla]'``, fla-core 0.6.0; its Triton comes with PyTorch's CUDA wheels)
==========  ==================================================================================

``auto`` is ``fla`` on a CUDA machine where flash-linear-attention is installed (and for a dry run
planning for GPUs), else ``torch`` (models without KDA layers need no extra). ``fla`` requested by
name is checked by :func:`check_backend` before the build: it raises, naming the fix, when the
package or a CUDA device is missing.

Every backend is a :data:`DeltaRule`: ``(q, k, v, g, beta, scale, cu_seqlens) -> o`` with
``q, k [B, T, H, K]`` and ``v [B, T, H, V]`` in the model dtype (q and k are L2-normalised inside),
``g [B, T, H, K]`` float32 log decay, ``beta [B, T, H]``, ``cu_seqlens`` int ``[N + 1]`` (``B == 1``,
last entry ``T``) or None; ``o [B, T, H, V]`` in ``v``'s dtype.
"""

from __future__ import annotations

import importlib
import importlib.util
from enum import Enum
from typing import Callable, Optional

import torch
from torch import Tensor

from kpool_layers.linear_attention.delta_rule import chunk_kda_torch


class Backend(str, Enum):
    """Values of ``model.linear_attention_kernels``."""

    auto = "auto"
    torch = "torch"
    fla = "fla"


BACKENDS = tuple(b.value for b in Backend)
KEY = "model.linear_attention_kernels"
FLA_EXTRA = "pip install -e '.[fla]' (fla-core==0.6.0)"

DeltaRule = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Optional[Tensor]], Tensor]


class KernelUnavailable(ValueError):
    """A backend that cannot run here; the message names the fix."""


def resolve(requested: str, *, on_device: Optional[bool] = None) -> str:
    """The backend ``requested`` stands for: ``auto`` -> ``fla`` with CUDA and the package
    installed (or ``on_device=False``: a dry run planning for GPUs), else ``torch``; other values
    unchanged."""
    if requested not in BACKENDS:
        raise KernelUnavailable(f"{KEY}={requested!r}; allowed: {list(BACKENDS)}")
    if requested != "auto":
        return requested
    if on_device is False:
        return "fla"
    usable = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
    return "fla" if usable else "torch"


def check_backend(backend: str, *, on_device: bool = True) -> None:
    """Raise :class:`KernelUnavailable` unless resolved ``backend`` runs here: for ``fla`` the
    package imports and a CUDA device is present (``on_device=False``, a dry run planning for
    another machine, checks neither)."""
    if backend not in ("torch", "fla"):
        raise KernelUnavailable(f"{KEY}={backend!r}; allowed: {list(BACKENDS)}")
    if backend == "torch" or not on_device:
        return
    if importlib.util.find_spec("fla") is None:
        raise KernelUnavailable(f"{KEY}=fla needs flash-linear-attention: {FLA_EXTRA}; "
                                f"or set {KEY}=torch")
    if not torch.cuda.is_available():
        raise KernelUnavailable(f"{KEY}=fla needs a CUDA device; set {KEY}=torch on this machine")


def chunk_kda_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """flash-linear-attention's ``chunk_kda`` behind :data:`DeltaRule` (precomputed log decay,
    q/k L2 norm in the kernel, no initial or final state)."""
    try:
        chunk_kda = importlib.import_module("fla.ops.kda").chunk_kda
    except ImportError as err:
        raise KernelUnavailable(f"{KEY}=fla needs flash-linear-attention: {FLA_EXTRA}") from err
    out, _ = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=None,
                       output_final_state=False, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.long))
    return out.to(v.dtype)


DELTA_RULES: dict[str, DeltaRule] = {"torch": chunk_kda_torch, "fla": chunk_kda_fla}
"""Resolved backend -> its delta rule."""


def delta_rule(backend: str) -> DeltaRule:
    """The delta rule of resolved ``backend`` (``torch`` or ``fla``)."""
    if backend not in DELTA_RULES:
        raise KernelUnavailable(f"{KEY}={backend!r} is not resolved; allowed here: "
                                f"{sorted(DELTA_RULES)} ('auto' is resolved by resolve())")
    return DELTA_RULES[backend]
