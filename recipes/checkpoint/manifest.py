"""Per-checkpoint manifest: what wrote a checkpoint, and proof that its bytes are intact.

Every checkpoint directory (training saves and ``convert_checkpoint.py import``) holds
``kpool_manifest.json``::

    {"format": 1, "step": 20, "lineage": "<uuid>", "written_at": 1764580000.0,
     "code_version": "v0.3-12-gabc1234", "config": {...composed config...},
     "files": {"__0_0.distcp": {"size": 123, "sha256": "..."}, ...}}

``lineage`` names the training run that owns the checkpoint (a fresh run draws one, a resumed run
keeps its checkpoint's); pruning only ever touches checkpoints of the current lineage.
:func:`verify` recomputes sizes and checksums before anything is loaded and raises
:class:`CheckpointError` naming the first damaged file. Hashing is spread over the ranks.

:func:`incompatibilities` compares a checkpoint's saved config with the current one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

MANIFEST = "kpool_manifest.json"
FORMAT = 1
_ROOT = Path(__file__).resolve().parents[2]

SHAPE_KEYS = (
    "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.ffn_hidden_size",
    "model.vocab_size", "model.normalization", "model.untie_embeddings_and_output_weights",
    "model.q_lora_rank", "model.kv_lora_rank", "model.qk_head_dim", "model.qk_pos_emb_head_dim",
    "model.v_head_dim", "model.dsa_indexer_n_heads", "model.dsa_indexer_head_dim",
    "model.dsa_indexer_kpool", "model.dsa_indexer_kpool_train_ape", "model.dsa_indexer_topk_freq",
    "model.dsa_indexer_skip_topk_offset", "model.num_moe_experts", "model.moe_first_k_dense_layers",
    "model.moe_ffn_hidden_size", "model.moe_shared_expert_intermediate_size",
    "model.moe_router_enable_expert_bias", "model.mtp_num_layers", "model.dsa_indexer_types",
    "model.linear_attention_freq",
)
"""Config keys that change which tensors a checkpoint holds or their shapes."""

RESUME_KEYS = ("precision.dtype", "parallelism.use_distributed_optimizer")
"""Keys that change the optimizer state's layout as well: strict for a resume, not for train.load."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the file or key and the fix."""


@functools.cache
def code_version() -> str:
    """``git describe`` of the recipes' checkout, else the installed package version."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=_ROOT,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"kpool-recipes {version('kpool-recipes')}"
    except PackageNotFoundError:
        return "unknown"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digests(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of ``names``; every rank hashes its share, all ranks get all results."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {n: {"size": (directory / n).stat().st_size, "sha256": _sha256(directory / n)}
            for n in names[rank::world]}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _payload_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: str | os.PathLike, *, config: dict[str, Any], lineage: str,
                   step: int) -> None:
    """Collective when torch.distributed is initialized (hashing is shared); rank 0 writes."""
    directory = Path(directory)
    files = _digests(directory, _payload_files(directory))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    manifest = {"format": FORMAT, "step": step, "lineage": lineage, "written_at": time.time(),
                "code_version": code_version(), "config": config, "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The manifest of ``directory`` (``None`` for a checkpoint written before manifests)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err})") from err


def verify(directory: str | os.PathLike) -> Optional[dict[str, Any]]:
    """Check every file of the manifest (size, then sha256); returns the manifest.

    Raises :class:`CheckpointError` naming the first missing, truncated or corrupted file.
    Returns ``None`` (nothing to verify) for a checkpoint without a manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the manifest lists it); the checkpoint is incomplete")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or "
                                  "overwritten)")
    actual = _digests(directory, sorted(files))
    for name, want in files.items():
        if actual[name]["sha256"] != want["sha256"]:
            raise CheckpointError(f"{directory / name}: checksum mismatch (corrupted bytes)")
    return manifest


def _select(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def incompatibilities(saved: dict[str, Any], current: dict[str, Any],
                      *, resume: bool) -> tuple[list[str], list[str]]:
    """(errors, notes) comparing the ``model`` (and, for a resume, ``precision.dtype`` and the
    optimizer layout) of a checkpoint's saved config with the current one.

    An error names a key whose difference changes tensors or their shapes; a note names any other
    ``model.*`` key that differs (the current value is used)."""
    if "model" not in saved:
        return [], []
    strict = SHAPE_KEYS + tuple(k for k in RESUME_KEYS if resume and _select(saved, k) is not None)
    errors = [f"{key}: checkpoint {_select(saved, key)!r}, now {_select(current, key)!r}"
              for key in strict if _select(saved, key) != _select(current, key)]
    saved_model, now_model = _flat(saved["model"], "model."), _flat(current.get("model") or {}, "model.")
    notes = [f"{key}: checkpoint {saved_model.get(key)!r}, now {now_model.get(key)!r}"
             for key in sorted(set(saved_model) | set(now_model))
             if key not in strict and key != "model.name" and saved_model.get(key) != now_model.get(key)]
    return errors, notes
