"""Checks that run before the model is built, so that a run does not fail hours later at a save.

* every size the build or a checkpoint divides by or allocates with is a positive integer (and a
  multiple of TP where megatron splits it): ``model.ffn_hidden_size=0``, say, would train and then
  crash in the final save;
* the checkpoint directory is not ``/`` or a system directory (unless
  ``train.save_in_system_dir=true``) and is writable;
* its file system has room for the checkpoints the run will hold at once (``keep_checkpoints`` + the
  one being written, less those already there), estimated from the parameter count.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from kpool_layers.precision.policy import DType
from recipes.plan.dry_run import analytic_param_count
from recipes.config.schema import Config, ConfigError

_POSITIVE = ("ffn_hidden_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim",
             "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_query_chunk_size",
             "max_position_embeddings")
_TP_SPLIT = ("ffn_hidden_size", "vocab_size")


def check_sizes(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the first size the build or a save cannot work with."""
    m = cfg.model
    tp = cfg.parallelism.tensor_model_parallel_size
    for key in _POSITIVE:
        value = getattr(m, key)
        if value < 1:
            raise ConfigError(f"model.{key}", value, "an integer >= 1 (it sizes weight tensors)")
    if m.num_moe_experts:
        if m.moe_ffn_hidden_size < 1:
            raise ConfigError("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size,
                              "an integer >= 1 when model.num_moe_experts is set")
        shared = m.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ConfigError("model.moe_shared_expert_intermediate_size", shared,
                              "null (no shared expert) or an integer >= 1")
    for key in ("qk_pos_emb_head_dim", "mtp_num_layers"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}", getattr(m, key), "an integer >= 0")
    for key in _TP_SPLIT:
        value = getattr(m, key)
        if value % tp:
            raise ConfigError(f"model.{key}", value,
                              f"a multiple of parallelism.tensor_model_parallel_size={tp} (split over TP)")


def checkpoint_bytes(cfg: Config) -> int:
    """Estimated size of one training checkpoint: the weights in the parameter dtype plus the
    distributed optimizer's fp32 main weights and Adam's two fp32 moments."""
    total, _ = analytic_param_count(cfg.model)
    return total * ((2 if cfg.precision.dtype is DType.bf16 else 4) + 12)


SYSTEM_DIRS = tuple(Path(p) for p in ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64",
                                       "/proc", "/sbin", "/sys", "/usr"))
"""Directories of the operating system: checkpoints go there (or into ``/`` itself) only with
``train.save_in_system_dir=true``."""


def check_not_system_dir(root: Path, allowed: bool) -> None:
    """Raise :class:`ConfigError` when ``root`` is ``/`` or inside :data:`SYSTEM_DIRS` and not
    ``allowed``."""
    resolved = root.resolve()
    system = next((d for d in SYSTEM_DIRS if resolved == d or d in resolved.parents), None)
    if not allowed and (resolved == Path("/") or system is not None):
        where = "the file system root" if system is None else f"inside the system directory {system}"
        raise ConfigError("train.save", str(root),
                          f"a checkpoint directory outside / and {', '.join(map(str, SYSTEM_DIRS))} "
                          f"({resolved} is {where}); set train.save_in_system_dir=true to save there anyway")


def check_checkpoint_dir(root: Path, checkpoint_size: int, count: int = 1) -> None:
    """The checkpoint root (or its nearest existing parent) is writable and has room for ``count``
    checkpoints of ``checkpoint_size`` bytes."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError("train.save", str(root),
                          f"a writable directory for checkpoints ({err.strerror or err})") from err
    free = shutil.disk_usage(root).free
    if free < checkpoint_size * count:
        raise ConfigError("train.save", str(root),
                          f"a directory with room for one checkpoint: ~{checkpoint_size / 2**30:.2f} GiB, "
                          f"times {count} held at once (train.keep_checkpoints + the one being "
                          f"written, less those present) = ~{checkpoint_size * count / 2**30:.2f} GiB "
                          f"needed, {free / 2**30:.2f} GiB free")


def preflight(cfg: Config, root: Path) -> None:
    """All checks; raises :class:`ConfigError` before anything is built."""
    check_sizes(cfg)
    if cfg.train.save_interval or cfg.train.save_final:
        check_not_system_dir(root, cfg.train.save_in_system_dir)
        check_checkpoint_dir(root, checkpoint_bytes(cfg), checkpoints_to_fit(cfg, root))


def checkpoints_to_fit(cfg: Config, root: Path) -> int:
    """How many more checkpoints the file system must hold: ``train.keep_checkpoints`` are kept
    and the next one is written before the oldest is pruned (``keep + 1`` at the peak), less the
    complete ones already in ``root``; at least the one in progress."""
    present = sum(1 for p in root.glob("iter_*") if p.is_dir() and ".tmp" not in p.name) if root.is_dir() else 0
    return max(1, cfg.train.keep_checkpoints + 1 - present)
