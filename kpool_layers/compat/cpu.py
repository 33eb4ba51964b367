"""Run megatron-core on machines without CUDA.

megatron-core 0.19 hard-codes CUDA in a few places that are otherwise device agnostic:
factory calls with ``device='cuda'`` / ``torch.cuda.current_device()``, ``.cuda()`` moves,
``Tensor.type()`` checks for ``torch.cuda.*`` names (grad clipping), and the CUDA RNG tracker.
:func:`install` redirects all of them to the CPU so that the *same* megatron code paths that run
on GPUs run on CPU/gloo in tests. It is a no-op when CUDA is available and is idempotent.

Besides this module, only two fill megatron's own seams for optional TE/apex kernels, where
neither is installed: :mod:`kpool_layers.compat.multi_tensor` (multi-tensor norm and scale) and
:mod:`kpool_layers.compat.wgrad_accumulation` (apex's fused weight-gradient accumulation).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_TARGET = "cpu"  # where CUDA factory calls land; ``redirect_cuda_to("meta")`` for dry runs

# Factory functions whose ``device=`` keyword megatron sets to CUDA.
_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.rand,
    torch.randn, torch.randint, torch.empty_like, torch.zeros_like, torch.ones_like,
    torch.full_like, torch.as_tensor, torch.linspace, torch.eye, torch.randperm, torch.empty_strided,
}
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # megatron passes torch.cuda.current_device() (an int)


def _run_backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None,
                  create_graph: bool = False, inputs: Any = None) -> None:
    """``torch.autograd.backward`` without its ``__torch_function__`` dispatch (same engine call);
    also serves ``Tensor.backward(gradient, retain_graph, create_graph, inputs)``."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    outs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    ins = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _make_grads(outs, _tensor_or_tensors_to_tuple(grad_tensors, len(outs)), is_grads_batched=False)
    _engine_run_backward(outs, grads, create_graph if retain_graph is None else retain_graph,
                         create_graph, ins, allow_unreachable=True, accumulate_grad=True)


class _CudaToCpu(TorchFunctionMode):
    """Maps CUDA devices in factory calls to CPU; makes ``.cuda()``/``.to('cuda')`` no-ops;
    reports ``torch.cuda.*`` names from ``Tensor.type()`` (megatron asserts on them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            # torch >= 2.14 dispatches backward through modes, and a mode is switched off while its
            # handler runs; megatron's backward code (sequence-parallel gathers) allocates on CUDA,
            # so run the engine with a fresh redirecting mode active.
            if func is torch.Tensor.backward and "gradient" in kwargs:
                kwargs["grad_tensors"] = kwargs.pop("gradient")
            with _CudaToCpu():
                return _run_backward(*args, **kwargs)
        if func in _FACTORIES and _is_cuda(kwargs.get("device")):
            kwargs["device"] = _TARGET
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.to:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = _TARGET
            if len(args) > 1 and _is_cuda(args[1]) and not isinstance(args[1], int | bool):
                args = (args[0], _TARGET, *args[2:])
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Drop-in for megatron's ``CudaRNGStatesTracker`` that forks the CPU generator."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} / seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _NullStream:
    """Stands in for ``torch.cuda.current_stream()``: CPU work is already ordered."""

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


def install() -> bool:
    """Activate the CPU redirection when CUDA is unavailable. Returns True if active."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute (megatron's CheckpointFunction) saves and restores "the CUDA generator":
    # here the CPU one, which it also saves itself.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _CudaToCpu().__enter__()  # stays active for the life of the process
    _INSTALLED = True
    return True


@contextlib.contextmanager
def redirect_cuda_to(device: str) -> Iterator[None]:
    """While active, CUDA factory calls land on ``device`` (e.g. ``meta``) instead of the CPU.
    No effect when the shim is not installed (real GPUs)."""
    global _TARGET
    saved, _TARGET = _TARGET, device
    try:
        yield
    finally:
        _TARGET = saved


def active() -> bool:
    """Whether the CPU redirection is in force."""
    return _INSTALLED
