"""Shared by the benchmark scripts in this folder (imported as a sibling module when they run as
``python scripts/bench/<name>.py``): one-process parallel state and a timing/peak-memory probe."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

OOM = {"ms": None, "peak_mib": None, "oom": True}


def init_single_rank(port: int) -> None:
    """A one-process NCCL (GPU) or gloo (CPU) group and megatron's parallel state at TP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)


def measure(step: Callable[[], Any], repeats: int, cuda: bool) -> dict[str, Any]:
    """Median ms of ``step`` after one warm-up and its extra peak GPU memory in MiB (peak minus what
    was allocated before the step; None on CPU); ``OOM`` when the GPU runs out of memory."""
    try:
        step()
        times, peak = [], None
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            times.append(time.perf_counter() - start)
        return {"ms": 1e3 * statistics.median(times), "peak_mib": peak, "oom": False}
    except torch.OutOfMemoryError:
        return dict(OOM)
    finally:
        if cuda:
            torch.cuda.empty_cache()
