"""Host-to-device copies that do not wait for the device."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A host tensor bound for CUDA goes through pinned memory with a
    non-blocking copy: a copy from pageable memory is ordered behind the stream's queued kernels
    and blocks the host until it is done (a host synchronization per copy); the pinned staging
    tensor is kept alive by torch's caching host allocator until the copy has run."""
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
