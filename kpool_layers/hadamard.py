"""Walsh-Hadamard transform over the last dimension, pure torch (no fast_hadamard_transform).

``hadamard_transform(x, scale)`` returns ``(x @ H_n) * scale`` for the Sylvester Hadamard matrix
``H_n`` (n = x.shape[-1], a power of two), computed in the dtype of ``x`` by log2(n) butterfly
stages. DSA's ``rotate_activation`` is ``hadamard_transform(x, n ** -0.5)``.
"""

from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard transform of ``x [..., n]`` times ``scale``."""
    n = x.shape[-1]
    if n & (n - 1) != 0 or n == 0:
        raise ValueError(f"hadamard_transform needs a power-of-two last dim, got {n}")
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


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2 / GLM-5 indexer rotation: orthonormal Hadamard over the last dim."""
    return hadamard_transform(x, x.shape[-1] ** -0.5)
