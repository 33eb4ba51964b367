"""Walsh-Hadamard transform over the last dimension (no fast_hadamard_transform).

``hadamard_transform(x, scale)`` returns ``(x @ H_n) * scale`` for the Sylvester Hadamard matrix
``H_n`` (n = x.shape[-1], a power of two) for ``x [..., n]`` of any leading shape, in ``x``'s
dtype and shape, computed by log2(n) butterfly stages (``h = 1, 2, .., n / 2``: each row viewed as
``[n / 2h, 2, h]``, every pair ``(a, b) -> (a + b, a - b)`` rounded to the dtype), then the
multiply by ``scale``. DSA's ``rotate_activation`` is ``hadamard_transform(x, n ** -0.5)``.

Two implementations, the same bits (forward and gradient, signed zeros included), the kernel route
:data:`HADAMARD` (:mod:`kpool_layers.kernel_routes`; ``triton`` where a CUDA device and the
``triton`` package are there, else ``torch``):

* CUDA tensors of dtype fp32 / bf16 / fp16 with ``2 <= n <= 1024``: one Triton kernel forward and
  one backward (:mod:`kpool_layers.kernels.hadamard_triton`) instead of the ``3 log2(n) + 1``
  torch kernels of the butterfly's forward (22 at n = 128) and about 8 per stage of its backward;
* everything else (CPU, fp64, larger n): the torch butterfly :func:`hadamard_butterfly`, which is
  the reference the kernel is tested against (``tests/test_hadamard_triton.py``).
  The kernel also declines, per call, a tensor it does not take (``hadamard_triton.supports``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from kpool_layers.kernel_routes import KernelBackend, Route, needs_cuda, needs_package, register


def hadamard_butterfly(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The torch butterfly: :func:`hadamard_transform` as ``3 log2(n) + 1`` aten ops (add, sub and
    stack per stage, then the scale), each rounded to ``x``'s dtype."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        # [m, n] -> [m, n / 2h, 2, h]: pairs (a, b) -> (a + b, a - b)
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, n) * scale).to(x.dtype)


def _triton() -> ModuleType:
    from kpool_layers.kernels import hadamard_triton

    return hadamard_triton


HADAMARD = register(Route("hadamard", (
    KernelBackend("triton", _triton, "one Triton kernel forward, one backward (fp32/bf16/fp16, 2 <= n <= 1024)",
                  declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: hadamard_butterfly, "the torch butterfly, 3 log2(n) + 1 aten ops"),
), summary="Walsh-Hadamard transform (DSA indexer rotation)"))
"""``hadamard``: the Triton kernel module (its ``supports`` and ``hadamard_triton`` looked up per
call) or :func:`hadamard_butterfly`."""


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard transform of ``x [..., n]`` times ``scale``."""
    n = x.shape[-1]
    if n & (n - 1) != 0 or n == 0:
        raise ValueError(f"hadamard_transform needs a power-of-two last dim, got {n}")
    route = HADAMARD.default()
    if route.backend == "triton" and x.is_cuda and route.kernel.supports(x):
        return route.kernel.hadamard_triton(x, scale)
    return hadamard_butterfly(x, scale)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2 / GLM-5 indexer rotation: orthonormal Hadamard over the last dim."""
    return hadamard_transform(x, x.shape[-1] ** -0.5)
