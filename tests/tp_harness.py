"""Two gloo processes that compare a layer at TP = 2 with TP = 1 on CPU (``tests/test_attention_tp.py``,
``tests/test_kda_tp.py``): spawning the ranks, copying TP = 1's weights into a rank's shards, one
forward and backward over a rank's slice of the input (its sequence slice under SP), the gradient
reductions megatron's ``finalize_model_grads`` does over TP, and the full sequence back.

Layout: ``x``, ``weight`` and the layer's output are ``[s, b, h]``; under sequence parallelism rank
``r`` holds rows ``[r * s / TP, (r + 1) * s / TP)``."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port


def shard(full: torch.Tensor, local: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """``full`` (a TP = 1 tensor) as rank ``rank``'s part of ``local``: its slice along
    ``local.partition_dim`` for a TP-split parameter, whole otherwise."""
    if getattr(local, "tensor_model_parallel", False):
        return full.chunk(tp, dim=local.partition_dim)[rank]
    return full


def gather_sequence(t: torch.Tensor, tp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The ranks' sequence slices ``[s / TP, ...]`` -> the full ``[s, ...]``."""
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def copy_sharded(module: torch.nn.Module, reference: torch.nn.Module, rank: int, tp: int) -> None:
    """``reference``'s (TP = 1) parameters into ``module``'s, each as this rank's shard."""
    with torch.no_grad():
        for param, ref in zip(module.parameters(), reference.parameters()):
            param.copy_(shard(ref, param, rank, tp))


def forward_backward(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, sp: bool, tp: int,
                     group: dist.ProcessGroup, **forward_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``module(x_rank, None, **forward_kwargs)`` and the backward of ``sum(output * weight)``, with
    ``x_rank`` / ``weight`` this rank's sequence slice under SP (whole otherwise); then the TP
    reductions of ``finalize_model_grads`` (sum of sequence-parallel parameters' gradients, mean
    of ``average_gradients_across_tp_domain`` ones; frozen parameters skipped). Returns the full
    ``(output, input gradient)``, detached."""
    rank = dist.get_rank(group)
    x_in = (x.detach().chunk(tp)[rank] if sp else x.detach()).clone().requires_grad_(True)
    out, _ = module(x_in, None, **forward_kwargs)
    (out * (weight.chunk(tp)[rank] if sp else weight)).sum().backward()
    for param in module.parameters():  # what megatron's finalize_model_grads does over TP
        if param.grad is None:  # frozen (the KPool ape)
            continue
        if sp and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=group)
        if getattr(param, "average_gradients_across_tp_domain", False):
            dist.all_reduce(param.grad, group=group)
            param.grad /= tp
    if sp:
        return gather_sequence(out.detach(), tp, group), gather_sequence(x_in.grad, tp, group)
    return out.detach(), x_in.grad


def _worker(rank: int, port: int, body: Callable[[], None]) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    from kpool_layers.compat import cpu as _cpu

    _cpu.install()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    body()
    dist.destroy_process_group()


def spawn_two_ranks(body: Callable[[], None]) -> None:
    """Run ``body`` (a module-level function, so the spawned processes can import it) on two gloo
    ranks of one CPU process group, with megatron-core's CUDA calls redirected
    (:mod:`kpool_layers.compat.cpu`)."""
    mp.spawn(_worker, args=(free_port(), body), nprocs=2, join=True)


def assert_sharded_grads(mod: torch.nn.Module, ref: torch.nn.Module, tp_rank: int, tp: int,
                         close: Callable[[torch.Tensor, torch.Tensor, str], None], case: str) -> None:
    """Every parameter gradient of ``mod`` (this TP rank's shard) against ``ref``'s full one cut
    to the same shard (:func:`shard`), by ``close(got, want, label)``; a parameter ``ref`` gives no
    gradient has none in ``mod`` either and takes none."""
    for (name, param), ref_param in zip(mod.named_parameters(), ref.parameters()):
        if ref_param.grad is None:
            assert param.grad is None and not param.requires_grad, f"{case} {name}"
            continue
        close(param.grad, shard(ref_param.grad, param, tp_rank, tp), f"{case} grad {name}")

