"""The rollout record format (docs/replay.md): one safetensors file per sample, and its validator.

Tensors of a record of ``s`` tokens:

* ``tokens`` int64 ``[s]``: the sample (prompt + response), one document;
* ``loss_mask`` (optional) ``[s]`` bool/int/float, 0 or 1: token ``i`` is trained on (predicted
  from its prefix); absent = every token but the first;
* ``logprobs`` (optional) float32 ``[s]``: the rollout's log-probability of token ``i`` given
  tokens ``0 .. i-1``; entry 0 (no prefix) is not read;
* ``indexer_topk.layer_<L>`` int32 ``[s, W]`` for every DSA layer ``L`` (megatron's 1-based layer
  number) that computes its own top-k, ``W = dsa_indexer_topk (+ kpool - 1 tail slots)``: the key
  positions (relative to the sample start) query ``i`` attended to, ``-1`` = empty slot;
* ``routed_experts.layer_<L>`` int32 ``[s, moe_router_topk]`` for every MoE layer ``L``: the
  experts token ``i`` was routed to.

The file's string metadata (optional, written by ``scripts/record_rollout.py``) names the model
facts the record depends on (:data:`MODEL_FACTS`); where present they must equal the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

TOPK_PREFIX = "indexer_topk.layer_"
EXPERTS_PREFIX = "routed_experts.layer_"
MODEL_FACTS = ("num_layers", "vocab_size", "dsa_indexer_topk", "dsa_indexer_kpool",
               "dsa_indexer_kpool_always_select_tail", "num_moe_experts", "moe_router_topk")
"""Metadata keys a record may carry; each must equal the model's value (as ``str``)."""


class RecordError(ValueError):
    """A rollout record that cannot be trained on: names the file, the key and the row."""

    def __init__(self, path: Path | str, key: str, problem: str, row: Optional[int] = None) -> None:
        where = f"{key}" if row is None else f"{key} row {row}"
        self.path, self.key, self.row = str(path), key, row
        super().__init__(f"rollout record {path}: {where}: {problem}")


@dataclass(frozen=True)
class ModelLayers:
    """What a record must hold for a model: its layer sets and widths."""

    topk_layers: tuple[int, ...]
    """DSA layers that compute their own top-k (IndexShare skip layers excluded), 1-based."""
    topk_width: int
    """``W`` of ``indexer_topk``: ``dsa_indexer_topk`` (+ ``kpool - 1`` tail slots)."""
    moe_layers: tuple[int, ...]
    """MoE layers, 1-based."""
    num_experts: int
    router_topk: int
    vocab_size: int
    facts: dict[str, str]
    """:data:`MODEL_FACTS` of the model as strings (the metadata a record is compared with)."""


@dataclass
class RolloutRecord:
    """One sample's record (layouts in the module docstring; indices int64 in memory)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    """bool ``[s]`` (the default when the file has none: every token but the first)."""
    logprobs: Optional[torch.Tensor]
    topk: dict[int, torch.Tensor]
    experts: dict[int, torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def write_record(path: Path, tokens: torch.Tensor, *, loss_mask: Optional[torch.Tensor] = None,
                 logprobs: Optional[torch.Tensor] = None, topk: Optional[dict[int, torch.Tensor]] = None,
                 experts: Optional[dict[int, torch.Tensor]] = None,
                 facts: Optional[dict[str, str]] = None) -> None:
    """Write one record (module docstring) to ``path``; ``facts``: :data:`MODEL_FACTS` metadata."""
    tensors = {"tokens": tokens.to(torch.int64).contiguous()}
    if loss_mask is not None:
        tensors["loss_mask"] = loss_mask.to(torch.uint8).contiguous()
    if logprobs is not None:
        tensors["logprobs"] = logprobs.to(torch.float32).contiguous()
    for layer, idx in (topk or {}).items():
        tensors[f"{TOPK_PREFIX}{layer}"] = idx.to(torch.int32).contiguous()
    for layer, idx in (experts or {}).items():
        tensors[f"{EXPERTS_PREFIX}{layer}"] = idx.to(torch.int32).contiguous()
    save_file(tensors, str(path), metadata=dict(facts or {}))


def _first_bad_row(bad: torch.Tensor) -> Optional[int]:
    """The first row (dim 0) of ``bad [s, ...]`` with a True entry, or None."""
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()
    return int(rows[0]) if rows.numel() else None


def _layers(path: Path, keys: list[str], prefix: str) -> dict[int, str]:
    layers = {}
    for key in keys:
        if key.startswith(prefix):
            suffix = key[len(prefix):]
            if not suffix.isdigit() or int(suffix) < 1:
                raise RecordError(path, key, "layer suffix must be a 1-based layer number")
            layers[int(suffix)] = key
    return layers


def _check_layer_set(path: Path, found: dict[int, str], want: tuple[int, ...], prefix: str,
                     required: bool) -> None:
    if not found and not required:
        return
    if set(found) != set(want):
        raise RecordError(path, prefix + "*",
                          f"layers {sorted(found)} recorded; the model's are {list(want)}")


def read_record(path: Path, model: ModelLayers, *, require_topk: bool = False,
                require_experts: bool = False) -> RolloutRecord:
    """Read and validate the record at ``path`` against ``model``: dtypes, shapes, the layer sets
    (each family all-or-nothing; required when the replay needs it), ranges (tokens < vocab,
    top-k ``-1`` or ``0 <= j <= i`` of the query row ``i``, experts ``< num_experts`` and distinct
    per token) and the metadata facts. Raises :class:`RecordError` at the first problem."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as err:  # safetensors raises its own error types for unreadable files
        raise RecordError(path, "(file)", f"not a readable safetensors file: {err}") from err
    for fact, value in meta.items():
        if fact in model.facts and value != model.facts[fact]:
            what = ("KPool records of another dsa_indexer_kpool" if fact == "dsa_indexer_kpool"
                    else "records of another model")
            raise RecordError(path, f"metadata {fact}",
                              f"{what}: {value!r}, the model has {model.facts[fact]!r}")
    known = {"tokens", "loss_mask", "logprobs"}
    extra = [k for k in keys if k not in known and not k.startswith((TOPK_PREFIX, EXPERTS_PREFIX))]
    if extra:
        raise RecordError(path, extra[0], f"unknown key; allowed: {sorted(known)}, "
                          f"{TOPK_PREFIX}<L>, {EXPERTS_PREFIX}<L>")
    if "tokens" not in tensors:
        raise RecordError(path, "tokens", "missing")
    tokens = tensors["tokens"]
    if tokens.dtype != torch.int64 or tokens.dim() != 1 or tokens.numel() < 2:
        raise RecordError(path, "tokens", f"must be int64 [s] with s >= 2, got {tokens.dtype} "
                          f"{tuple(tokens.shape)}")
    s = tokens.shape[0]
    row = _first_bad_row((tokens < 0) | (tokens >= model.vocab_size))
    if row is not None:
        raise RecordError(path, "tokens", f"id {int(tokens[row])} outside [0, {model.vocab_size})", row)
    loss_mask = torch.ones(s, dtype=torch.bool)
    loss_mask[0] = False
    if "loss_mask" in tensors:
        given = tensors["loss_mask"]
        if given.shape != (s,):
            raise RecordError(path, "loss_mask", f"must be [s]=[{s}], got {tuple(given.shape)}")
        row = _first_bad_row((given != 0) & (given != 1))
        if row is not None:
            raise RecordError(path, "loss_mask", f"value {given[row].item()} is not 0 or 1", row)
        loss_mask = given != 0
    logprobs = tensors.get("logprobs")
    if logprobs is not None:
        if logprobs.dtype != torch.float32 or logprobs.shape != (s,):
            raise RecordError(path, "logprobs", f"must be float32 [s]=[{s}], got {logprobs.dtype} "
                              f"{tuple(logprobs.shape)}")
        row = _first_bad_row(~torch.isfinite(logprobs[1:]) | (logprobs[1:] > 0))
        if row is not None:
            raise RecordError(path, "logprobs", f"{float(logprobs[row + 1])} is not a finite "
                              "log-probability (<= 0)", row + 1)
    topk_keys = _layers(path, keys, TOPK_PREFIX)
    expert_keys = _layers(path, keys, EXPERTS_PREFIX)
    _check_layer_set(path, topk_keys, model.topk_layers, TOPK_PREFIX, require_topk)
    _check_layer_set(path, expert_keys, model.moe_layers, EXPERTS_PREFIX, require_experts)
    topk = {layer: _checked_topk(path, key, tensors[key], s, model.topk_width)
            for layer, key in sorted(topk_keys.items())}
    experts = {layer: _checked_experts(path, key, tensors[key], s, model)
               for layer, key in sorted(expert_keys.items())}
    return RolloutRecord(tokens, loss_mask, logprobs, topk, experts)


def _checked_topk(path: Path, key: str, idx: torch.Tensor, s: int, width: int) -> torch.Tensor:
    if idx.dtype != torch.int32 or idx.shape != (s, width):
        raise RecordError(path, key, f"must be int32 [s, W]=[{s}, {width}], got {idx.dtype} "
                          f"{tuple(idx.shape)}")
    idx = idx.to(torch.int64)
    query = torch.arange(s).unsqueeze(1)
    row = _first_bad_row(idx < -1)
    if row is not None:
        raise RecordError(path, key, f"index {int(idx[row].min())} < -1 (-1 = empty slot)", row)
    row = _first_bad_row(idx > query)
    if row is not None:
        raise RecordError(path, key, f"index {int(idx[row].max())} > the query's position {row} "
                          "(a key after the query, or outside the sample)", row)
    return idx


def _checked_experts(path: Path, key: str, idx: torch.Tensor, s: int, model: ModelLayers) -> torch.Tensor:
    k = model.router_topk
    if idx.dtype != torch.int32 or idx.shape != (s, k):
        raise RecordError(path, key, f"must be int32 [s, moe_router_topk]=[{s}, {k}], got "
                          f"{idx.dtype} {tuple(idx.shape)}")
    idx = idx.to(torch.int64)
    row = _first_bad_row((idx < 0) | (idx >= model.num_experts))
    if row is not None:
        raise RecordError(path, key, f"experts {idx[row].tolist()} outside [0, {model.num_experts})", row)
    ordered = idx.sort(dim=1).values
    row = _first_bad_row(ordered[:, 1:] == ordered[:, :-1])
    if row is not None:
        raise RecordError(path, key, f"experts {idx[row].tolist()} repeat an expert", row)
    return idx
