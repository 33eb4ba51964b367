"""Atomic save / exact resume through megatron-core's ``dist_checkpointing``.

Layout under the checkpoint root::

    iter_0000020/      a complete dist checkpoint (model, optimizer, scheduler, progress)
    latest             text file: the name of the newest complete checkpoint

A save writes into ``iter_N.tmp-<run id>`` and is renamed to ``iter_N`` by rank 0 only after every
rank finished writing; ``latest`` is replaced atomically afterwards. A run killed mid-save therefore
leaves the previous checkpoint and ``latest`` untouched. dist_checkpointing reshards on load, so a
checkpoint saved at one TP/PP/EP loads at another (model weights; the optimizer state needs the
same distributed-optimizer layout).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from kpool_layers.grouped_experts import check_resumable_experts, experts_module

LATEST = "latest"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
"""Distributed-optimizer format: every rank writes its own shard in parallel (reshardable over DP)."""
EXPERTS = "experts_module"
"""Saved with every training checkpoint: the routed-experts module, whose parameter order the
distributed-optimizer state depends on (kpool_layers.grouped_experts.check_resumable_experts)."""


@dataclass
class Progress:
    """Where training stands: completed optimizer steps and samples consumed (global)."""

    step: int = 0
    consumed_samples: int = 0


def _name(step: int) -> str:
    return f"iter_{step:07d}"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (``None`` if there is none)."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def unwrap(model: Any) -> Any:
    """The ``GPTModel`` inside megatron's DDP / Float16Module wrappers (checkpoint keys are its)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _sharded_state(model: Any, optimizer: Any, *, loading: bool) -> dict[str, Any]:
    model_sd = unwrap(model).sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata=OPTIMIZER_SHARDING)
    return state


def save_checkpoint(root: str | os.PathLike, model: Any, optimizer: Any, scheduler: Any,
                    progress: Progress, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    root = Path(root)
    final = root / _name(progress.step)
    tmp = root / (final.name + ".tmp")
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state = _sharded_state(model, optimizer, loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = {"step": progress.step, "consumed_samples": progress.consumed_samples}
    state[EXPERTS] = experts_module(unwrap(model))
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _is_rank0():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = root / (LATEST + ".tmp")
        marker_tmp.write_text(final.name)
        os.replace(marker_tmp, root / LATEST)
        _prune(root, keep)
    _barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _materialize_adam_state(optimizer: Any) -> None:
    """Give every parameter of a fresh torch Adam its (zero) state so that megatron's distributed
    optimizer can describe the state it is about to load (it reads ``state[p]["step"]``)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _restore_adam_steps(optimizer: Any, step: int) -> None:
    """Set every parameter's Adam ``step`` to the number of optimizer steps taken.

    megatron 0.19's distributed optimizer on the torch-Adam path (no apex/TE) neither saves the
    per-parameter ``step`` with the parameter state nor restores it into separate tensors (it
    shares one), which breaks Adam's bias correction after a resume. Every step of ours updates
    every parameter (the distributed optimizer gives each main parameter a gradient, and bf16/fp32
    training skips no steps), so the count is the completed step count."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            state["step"] = torch.tensor(float(step), dtype=torch.float32)


def load_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any, scheduler: Any) -> Progress:
    """Collective: restore model, optimizer and scheduler. Returns the saved progress."""
    check_resumable_experts(dist_checkpointing.load_common_state_dict(str(path)).get(EXPERTS), unwrap(model), path)
    _materialize_adam_state(optimizer)
    state = _sharded_state(model, optimizer, loading=True)
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = {"step": 0, "consumed_samples": 0}
    loaded = dist_checkpointing.load(state, str(path))
    with torch.no_grad():  # restores in place into parameter (views) that require grad
        unwrap(model).load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    prog = loaded["progress"]
    _restore_adam_steps(optimizer, int(prog["step"]))
    return Progress(step=int(prog["step"]), consumed_samples=int(prog["consumed_samples"]))


def load_weights(path: str | os.PathLike, model: Any) -> None:
    """Initialise model weights from a checkpoint (``train.load``), resharding as needed."""
    loaded = dist_checkpointing.load({"model": unwrap(model).sharded_state_dict()}, str(path))
    unwrap(model).load_state_dict(loaded["model"])
