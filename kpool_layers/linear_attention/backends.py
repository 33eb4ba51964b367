"""Which kernel computes KDA's chunked delta rule: the ``model.linear_attention_kernels`` key.

==========  ==================================================================================
backend     delta rule
==========  ==================================================================================
``torch``   :func:`kpool_layers.linear_attention.delta_rule.chunk_kda_torch` (any device; fp32
            math, fp64 for fp64 inputs; autograd through PyTorch ops)
``fla``     flash-linear-attention's Triton ``chunk_kda`` (CUDA; the optional extra
            ``pip install -e '.[fla]'``, fla-core 0.6.0; its Triton comes with PyTorch's CUDA wheels)
==========  ==================================================================================

The kernel route :data:`LINEAR_ATTENTION` (:mod:`kpool_layers.kernel_routes`) holds the table,
tried in the order fla, torch: ``auto`` is ``fla`` on a CUDA machine where flash-linear-attention
is installed (and for a dry run planning for GPUs), else ``torch`` (models without KDA layers need
no extra). ``fla`` requested by name is checked by :func:`check_backend` before the build: it
raises, naming the fix, when the package or a CUDA device is missing. The layer spec
(:func:`kpool_layers.linear_attention.kda.kda_spec`) takes the resolved backend's delta rule
through :func:`delta_rule`, which records it as the route's choice (the precision map's
``route.linear_attention`` row).

Every backend is a :data:`DeltaRule`: ``(q, k, v, g, beta, scale, cu_seqlens) -> o`` with
``q, k [B, T, H, K]`` and ``v [B, T, H, V]`` in the model dtype (q and k are L2-normalised inside),
``g [B, T, H, K]`` float32 log decay, ``beta [B, T, H]``, ``cu_seqlens`` int ``[N + 1]`` (``B == 1``,
last entry ``T``) or None; ``o [B, T, H, V]`` in ``v``'s dtype.
"""

from __future__ import annotations

import importlib
from enum import Enum
from typing import Callable, Optional

import torch
from torch import Tensor

from kpool_layers.kernel_routes import (KernelBackend, KernelUnavailable, Machine, Route, needs_cuda, needs_package,
                                        register)
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

_needs_fla = needs_package("fla", FLA_EXTRA)
"""The ``fla`` backend's package check (with :func:`needs_cuda`, what it needs of the machine)."""


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


LINEAR_ATTENTION = register(Route("linear_attention", (
    KernelBackend("fla", lambda: chunk_kda_fla, "flash-linear-attention's Triton chunk_kda",
                  declines=(needs_cuda, _needs_fla)),
    KernelBackend("torch", lambda: chunk_kda_torch, "chunked PyTorch delta rule (fp32 math)"),
), summary="KDA chunked delta rule", config_key=KEY))
"""The ``linear_attention_kernels`` route: each backend's ``load`` gives its :data:`DeltaRule`."""


def resolve(requested: str, *, on_device: Optional[bool] = None) -> str:
    """The backend ``requested`` stands for: ``auto`` -> :data:`LINEAR_ATTENTION`'s automatic
    resolution on this machine (``on_device=False``: on the GPU machine a dry run plans for, so
    ``fla``), recorded there; other values unchanged."""
    if requested not in BACKENDS:
        raise KernelUnavailable(f"{KEY}={requested!r}; allowed: {list(BACKENDS)}")
    if requested != "auto":
        return requested
    machine = Machine.planned_gpu() if on_device is False else Machine.here()
    return LINEAR_ATTENTION.resolve(machine=machine).backend


def check_backend(backend: str, *, on_device: bool = True) -> None:
    """Raise :class:`KernelUnavailable` unless resolved ``backend`` runs here: for ``fla`` the
    package imports and a CUDA device is present (the route's decline checks; ``on_device=False``,
    a dry run planning for another machine, checks neither)."""
    if backend not in LINEAR_ATTENTION.names:
        raise KernelUnavailable(f"{KEY}={backend!r}; allowed: {list(BACKENDS)}")
    if backend == "torch" or not on_device:
        return
    machine = Machine.here()
    if _needs_fla(machine) is not None:
        raise KernelUnavailable(f"{KEY}=fla needs flash-linear-attention: {FLA_EXTRA}; "
                                f"or set {KEY}=torch")
    if needs_cuda(machine) is not None:
        raise KernelUnavailable(f"{KEY}=fla needs a CUDA device; set {KEY}=torch on this machine")


def delta_rule(backend: str) -> DeltaRule:
    """The delta rule of resolved ``backend`` (``torch`` or ``fla``), recorded as
    :data:`LINEAR_ATTENTION`'s choice (the layer spec calls this at the build)."""
    if backend not in LINEAR_ATTENTION.names:
        raise KernelUnavailable(f"{KEY}={backend!r} is not resolved; allowed here: "
                                f"{sorted(LINEAR_ATTENTION.names)} ('auto' is resolved by resolve())")
    return LINEAR_ATTENTION.take(backend).kernel
