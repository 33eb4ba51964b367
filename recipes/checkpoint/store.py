"""Atomic save / exact resume through megatron-core's ``dist_checkpointing``, with manifests.

Layout under the checkpoint root::

    iter_0000020/      a complete dist checkpoint (model, optimizer, scheduler, progress) and its
                       kpool_manifest.json (files, checksums, config, code version, lineage)
    latest             text file: the name of the newest complete checkpoint (a malformed one or
                       one naming anything but a directory in the root counts as missing,
                       recipes.checkpoint.integrity)

A save writes into ``iter_N.tmp``, hashes it into the manifest and is renamed to ``iter_N`` by
rank 0 only after every rank finished writing; ``latest`` is replaced atomically afterwards. A run
killed mid-save therefore leaves the previous checkpoint and ``latest`` untouched. Pruning keeps
the ``keep`` newest checkpoints *of the current lineage* (recipes.checkpoint.manifest) and never
removes the one ``latest`` names. Loads are strict: a tensor missing from the checkpoint or one the
model does not have is an error naming it. dist_checkpointing reshards on load, so a checkpoint
saved at one TP/PP/EP loads at another (model weights; the optimizer state needs the same
distributed-optimizer layout).

The save is synchronous and runs in this process: megatron's writer would otherwise start a
``multiprocessing`` manager process (and a resource tracker) that outlives a killed trainer.
"""

from __future__ import annotations

import copy
import errno
import os
import queue
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from kpool_layers.moe.experts import check_resumable_experts, experts_module
from recipes.checkpoint.integrity import LATEST, MANIFEST_EXPECTED, latest_checkpoint
from recipes.checkpoint.lineage import check_save_target
from recipes.checkpoint.manifest import CheckpointError, read_manifest, write_manifest
from recipes.train.nonfinite import check_weights_finite
from recipes.train.optimizer import adam_step, inner_optimizers
from recipes.checkpoint.resume_schedule import follow_current_settings

OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
"""Distributed-optimizer format: every rank writes its own shard in parallel (reshardable over DP)."""
EXPERTS = "experts_module"
"""Saved with every training checkpoint: the routed-experts module, whose parameter order the
distributed-optimizer state depends on (kpool_layers.moe.experts.check_resumable_experts)."""


@dataclass
class Progress:
    """Where training stands: completed optimizer steps and samples consumed (global)."""

    step: int = 0
    consumed_samples: int = 0


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"iter_{step:07d}"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dirs(root: str | os.PathLike) -> list[Path]:
    """Every ``iter_N`` directory under ``root`` (complete or not; unfinished ``.tmp`` excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("iter_*") if p.is_dir() and ".tmp" not in p.name)


def _manifest_or_none(path: Path) -> Optional[dict[str, Any]]:
    try:
        return read_manifest(path)
    except CheckpointError:
        return None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoints that finished writing, newest first (by the time their manifest was written,
    then step; one without a manifest counts when megatron's metadata is there)."""
    def order(path: Path) -> tuple[float, str]:
        manifest = _manifest_or_none(path)
        return (manifest or {}).get("written_at", 0.0), path.name

    done = [p for p in checkpoint_dirs(root)
            if _manifest_or_none(p) is not None or (p / ".metadata").is_file()]
    return sorted(done, key=order, reverse=True)


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


@dataclass(frozen=True)
class Owner:
    """What every checkpoint of a run records: its lineage and the composed config."""

    lineage: str
    config: dict[str, Any]


def _write_in_process() -> None:
    """Give megatron's file writer an in-process results queue (the save is synchronous), so it
    starts no ``multiprocessing`` manager process that a killed trainer would leave orphaned."""
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(root: str | os.PathLike, model: Any, optimizer: Any, scheduler: Any,
                    progress: Progress, keep: int, owner: Owner) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path. Weights with NaN/inf
    are refused before anything is written (:func:`recipes.train.nonfinite.check_weights_finite`), and
    so is a step whose name another lineage's checkpoint holds (recipes.checkpoint.lineage)."""
    root = Path(root)
    previous = latest_checkpoint(root)
    check_weights_finite(unwrap(model), progress.step,
                         f"{previous} is the last saved state" if previous else f"nothing is saved in {root}")
    final = root / checkpoint_name(progress.step)
    check_save_target(final, owner.lineage)  # never another run's checkpoint
    tmp = root / (final.name + ".tmp")
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    _write_in_process()
    state = _sharded_state(model, optimizer, loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = {"step": progress.step, "consumed_samples": progress.consumed_samples}
    state[EXPERTS] = experts_module(unwrap(model))
    state[MANIFEST_EXPECTED] = True  # a later missing manifest is an error (recipes.checkpoint.integrity)
    try:
        dist_checkpointing.save(state, str(tmp))
        _barrier()
        write_manifest(tmp, config=owner.config, lineage=owner.lineage, step=progress.step)
    except BaseException as err:  # CheckpointException is a BaseException
        full = no_space_left(err, root)
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save only fills the disk
        if full:
            raise CheckpointError(
                f"no space left on device: {root} (saving {final.name}; its partial {tmp.name} was "
                f"removed; {previous or 'no earlier checkpoint'} is the last saved state). Free space "
                "there, lower train.keep_checkpoints or save elsewhere (train.save)") from err
        raise
    _barrier()
    if _is_rank0():
        replaced = root / (final.name + ".replaced")  # a complete checkpoint until the new one is in place
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        marker_tmp = root / (LATEST + ".tmp")
        marker_tmp.write_text(final.name)
        os.replace(marker_tmp, root / LATEST)
        shutil.rmtree(replaced, ignore_errors=True)
        prune(root, keep, owner.lineage)
    _barrier()
    return final


FULL_BYTES = 2**20
"""A write that failed where less than this is available failed on a full file system (torch's
stream writer reports ENOSPC only as "file write failed")."""


def no_space_left(err: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC anywhere in ``err``'s chain or text, or
    less than :data:`FULL_BYTES` available under ``root`` now."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "no space left on device" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(root).free < FULL_BYTES
    except OSError:
        return False


def prune(root: Path, keep: int, lineage: str) -> list[Path]:
    """Remove all but the ``keep`` most recently written checkpoints of ``lineage``; never one of
    another lineage, an unfinished one or the one ``latest`` names. Returns what was removed."""
    latest = latest_checkpoint(root)
    owned = [p for p in complete_checkpoints(root)
             if (_manifest_or_none(p) or {}).get("lineage") == lineage]
    removed = [p for p in owned[keep:] if p != latest]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def _materialize_adam_state(optimizer: Any) -> None:
    """Give every parameter of a fresh torch Adam its (zero) state so that megatron's distributed
    optimizer can describe the state it is about to load (it reads ``state[p]["step"]``)."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = adam_step(0, param, group)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _restore_adam_steps(optimizer: Any, step: int) -> None:
    """Set every parameter's Adam ``step`` to the number of optimizer steps taken.

    megatron 0.19's distributed optimizer on the torch-Adam path (no apex/TE) neither saves the
    per-parameter ``step`` with the parameter state nor restores it into separate tensors (it
    shares one), which breaks Adam's bias correction after a resume. Every step of ours updates
    every parameter (the distributed optimizer gives each main parameter a gradient, and bf16/fp32
    training skips no steps), so the count is the completed step count."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if param in inner.state:
                    inner.state[param]["step"] = adam_step(step, param, group)


def _tensor_keys(model_sd: dict[str, Any]) -> set[str]:
    """Global keys of every tensor in a model's sharded state dict (factories expanded)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    keys = set()
    for entry in nested_values(model_sd):
        if isinstance(entry, ShardedTensorFactory):
            built = {"x": copy.copy(entry)}
            apply_factories(built)
            keys |= {sh.key for sh in nested_values(built) if isinstance(sh, ShardedTensor)}
        elif isinstance(entry, ShardedTensor):
            keys.add(entry.key)
    return keys


def check_tensors(model_sd: dict[str, Any], path: str | os.PathLike) -> None:
    """Raise naming every model tensor the checkpoint lacks and every model tensor it holds that
    the model does not have (its optimizer entries aside). Collective under torch.distributed."""
    stored = {k for k in dist_checkpointing.load_tensors_metadata(str(path)) if not k.startswith("optimizer.")}
    mine = _tensor_keys(model_sd)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different layers
        everyone = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
    missing, unexpected = mine - stored, stored - set().union(*everyone)
    if missing or unexpected:
        def show(keys: set[str]) -> str:
            listed = sorted(keys)
            return ", ".join(listed[:8]) + (f" and {len(listed) - 8} more" if len(listed) > 8 else "")

        parts = [f"missing in the checkpoint: {show(missing)}"] if missing else []
        parts += [f"not in the model: {show(unexpected)}"] if unexpected else []
        raise CheckpointError(f"{path} does not match the model ({'; '.join(parts)}): "
                              "load it with the model config it was saved with")


def load_checkpoint(path: str | os.PathLike, model: Any, optimizer: Any, scheduler: Any) -> Progress:
    """Collective: restore model, optimizer and scheduler. Returns the saved progress.

    The LR schedule keeps the saved step count but follows the current ``train.*`` settings
    (steps, warmup, lr, min_lr): a resume with a changed ``train.steps`` re-plans the decay."""
    check_resumable_experts(dist_checkpointing.load_common_state_dict(str(path)).get(EXPERTS), unwrap(model), path)
    _materialize_adam_state(optimizer)
    state = _sharded_state(model, optimizer, loading=True)
    check_tensors(state["model"], path)
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = {"step": 0, "consumed_samples": 0}
    loaded = dist_checkpointing.load(state, str(path))
    with torch.no_grad():  # restores in place into parameter (views) that require grad
        unwrap(model).load_state_dict(loaded["model"])
        follow_current_settings(loaded["optimizer"], optimizer.param_groups)  # a changed train.lr
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.override_opt_param_scheduler = True  # the current config's schedule, saved position
    scheduler.load_state_dict(loaded["scheduler"])
    prog = loaded["progress"]
    _restore_adam_steps(optimizer, int(prog["step"]))
    return Progress(step=int(prog["step"]), consumed_samples=int(prog["consumed_samples"]))


def load_weights(path: str | os.PathLike, model: Any) -> None:
    """Initialise model weights from a checkpoint (``train.load``), resharding as needed; every
    model tensor must be in it and it may hold no other model tensor."""
    model_sd = unwrap(model).sharded_state_dict()
    check_tensors(model_sd, path)
    loaded = dist_checkpointing.load({"model": model_sd}, str(path))
    unwrap(model).load_state_dict(loaded["model"])
