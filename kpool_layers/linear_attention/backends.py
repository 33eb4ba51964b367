"""Which kernels run a KDA layer's short convolution, forget gate, chunked delta rule and gated
norm: the ``model.linear_attention_kernels`` key (one :class:`~kpool_layers.linear_attention.layer_ops.KDAKernels`
bundle per backend; its entries' contracts are in :mod:`kpool_layers.linear_attention.layer_ops`).

==========  ==================================================================================
backend     kernels
==========  ==================================================================================
``torch``   :data:`~kpool_layers.linear_attention.layer_ops.TORCH_KERNELS`: PyTorch ops and
            :func:`~kpool_layers.linear_attention.delta_rule.chunk_kda_torch` (any device;
            fp32 math, fp64 for fp64 inputs; autograd through PyTorch ops)
``fla``     flash-linear-attention's Triton kernels (:mod:`kpool_layers.linear_attention.fla_kernels`:
            ``causal_conv1d``, ``fused_kda_gate``, ``chunk_kda``, ``rms_norm_gated``; CUDA; the
            optional extra ``pip install -e '.[fla]'``, fla-core 0.6.0; its Triton comes with
            PyTorch's CUDA wheels)
==========  ==================================================================================

The kernel route :data:`LINEAR_ATTENTION` (:mod:`kpool_layers.kernel_routes`) holds the table,
tried in the order fla, torch: ``auto`` is ``fla`` on a CUDA machine where flash-linear-attention
is installed (and for a dry run planning for GPUs), else ``torch`` (models without KDA layers need
no extra). ``fla`` requested by name is checked by :func:`check_backend` before the build: it
raises, naming the fix, when the package or a CUDA device is missing. The layer spec
(:func:`kpool_layers.linear_attention.kda.kda_spec`) takes the resolved backend's kernels
through :func:`layer_kernels`, which records it as the route's choice (the precision map's
``route.linear_attention`` row).
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from kpool_layers.kernel_routes import (KernelBackend, KernelUnavailable, Machine, Route, needs_cuda, needs_package,
                                        register)
from kpool_layers.linear_attention import fla_kernels
from kpool_layers.linear_attention.layer_ops import TORCH_KERNELS, KDAKernels


class Backend(str, Enum):
    """Values of ``model.linear_attention_kernels``."""

    auto = "auto"
    torch = "torch"
    fla = "fla"


BACKENDS = tuple(b.value for b in Backend)
KEY = fla_kernels.KEY
FLA_EXTRA = fla_kernels.FLA_EXTRA

_needs_fla = needs_package("fla", FLA_EXTRA)
"""The ``fla`` backend's package check (with :func:`needs_cuda`, what it needs of the machine)."""


LINEAR_ATTENTION = register(Route("linear_attention", (
    KernelBackend("fla", lambda: fla_kernels.FLA_KERNELS, "flash-linear-attention's Triton kernels (conv, gate, chunk_kda, gated norm)",
                  declines=(needs_cuda, _needs_fla)),
    KernelBackend("torch", lambda: TORCH_KERNELS, "PyTorch ops and the chunked PyTorch delta rule (fp32 math)"),
), summary="KDA short conv, gate, delta rule and gated norm", config_key=KEY))
"""The ``linear_attention_kernels`` route: each backend's ``load`` gives its :class:`KDAKernels`."""


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


def layer_kernels(backend: str) -> KDAKernels:
    """The kernels of resolved ``backend`` (``torch`` or ``fla``), recorded as
    :data:`LINEAR_ATTENTION`'s choice (the layer spec calls this at the build)."""
    if backend not in LINEAR_ATTENTION.names:
        raise KernelUnavailable(f"{KEY}={backend!r} is not resolved; allowed here: "
                                f"{sorted(LINEAR_ATTENTION.names)} ('auto' is resolved by resolve())")
    return LINEAR_ATTENTION.take(backend).kernel
