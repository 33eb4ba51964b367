"""Shared by the benchmark scripts in this folder (imported as a sibling module when they run as
``python scripts/bench/<name>.py``): one-process parallel state, a timing/peak-memory probe, expert
routings and the composed config of the command line's Hydra overrides."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CONF = Path(__file__).resolve().parents[2] / "conf"
"""The project's Hydra config directory."""

OOM = {"ms": None, "peak_mib": None, "oom": True}


def init_single_rank() -> None:
    """A one-process NCCL (GPU) or gloo (CPU) group and megatron's parallel state at TP = 1; its
    rendezvous port is ``MASTER_PORT`` if set, else a free one (two benchmarks on a host coexist)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from recipes.launch.distributed import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)


def bench_device() -> tuple[bool, torch.device, torch.dtype]:
    """:func:`init_single_rank` and, on a GPU, megatron's model-parallel RNG seeded (1234); returns
    whether CUDA runs the benchmark, its device and its dtype (bf16 on the GPU, fp32 on the CPU)."""
    cuda = torch.cuda.is_available()
    init_single_rank()
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)
    return cuda, torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32


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


def routings(experts: int, rows: int) -> dict[str, torch.Tensor]:
    """Tokens per expert (int64, host) summing to ``rows``: ``balanced`` (equal counts) and
    ``skewed`` (geometric, ratio 0.8, the remainder to the first expert, the last expert empty)."""
    balanced = torch.full((experts,), rows // experts, dtype=torch.long)
    weights = 0.8 ** torch.arange(experts - 1, dtype=torch.float64)
    skewed = torch.floor(weights / weights.sum() * rows).long()
    skewed[0] += rows - int(skewed.sum())
    return {"balanced": balanced, "skewed": torch.cat([skewed, torch.zeros(1, dtype=torch.long)])}


def compose_config(overrides: list[str]) -> Any:
    """The typed config (``recipes.config.schema.Config``) ``train.py`` composes from ``overrides``."""
    from hydra import compose, initialize_config_dir

    from recipes.launch.distributed import register_resolvers
    from recipes.config.schema import register_configs
    from recipes.config.typed import to_config

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose("config", overrides=overrides))


def out_and_config(doc: str) -> tuple[str | None, list[str], Any]:
    """A benchmark's command line: ``--out`` (where to write its JSON), the Hydra overrides and
    the config they compose."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--out", help="write the figures as JSON here")
    args, overrides = parser.parse_known_args()
    return args.out, overrides, compose_config(overrides)


class TrainerStep:
    """``cfg``'s trainer built as ``train.py`` builds it (``recipes.loop``) on this process's device,
    its data, and one training step per call: megatron's forward-backward over the step's micro
    batches (``recipes.train.cuda_graph.ForwardBackward``, graphed as ``train.cuda_graph_impl``
    says), then the optimizer step; synchronised on CUDA, returns its seconds. :meth:`close` frees
    the graph."""

    def __init__(self, cfg: Any) -> None:
        from recipes import loop
        from recipes.launch import distributed
        from recipes.train import data as data_lib
        from recipes.train.cuda_graph import ForwardBackward

        self.cfg = cfg
        self.trainer = loop._build(cfg)
        tokenizer = data_lib.build_tokenizer(cfg.data, cfg.model.vocab_size)
        self._batches = loop._batches(cfg, 0, tokenizer)
        self.device = distributed.device()
        self._forward_step = partial(loop.forward_step, self.device, loop.packed_eod_id(cfg, tokenizer))
        self._fwd_bwd = ForwardBackward(cfg.train)

    def __call__(self) -> float:
        start = time.perf_counter()
        trainer = self.trainer
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        self._fwd_bwd(forward_step_func=self._forward_step, data_iterator=self._batches,
                      model=[trainer.model], num_microbatches=trainer.num_microbatches,
                      seq_length=self.cfg.data.seq_length, micro_batch_size=self.cfg.train.micro_batch_size,
                      forward_only=False)
        trainer.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        self._fwd_bwd.close()

