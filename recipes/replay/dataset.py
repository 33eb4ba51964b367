"""``data=rollout``: rollout records packed into THD rows (docs/replay.md).

Samples are taken in file-name order and packed greedily: a row holds consecutive samples while
they fit in ``data.seq_length``; the rest of a row is padding (token 0, no loss, its own segment).
Each sample ``[o, o + s)`` of a row contributes (row position ``p = o + i``)::

    tokens[p]          = tokens[i]
    labels[p]          = tokens[i + 1]               (0 at the sample's last token)
    loss_mask[p]       = loss_mask[i + 1]            (0 at the sample's last token)
    rollout_logprobs[p] = logprobs[i + 1]            (the rollout's logprob of labels[p])
    position_ids[p]    = i
    sample_starts[p]   = (i == 0)                    (padding starts a segment too)
    sample_tokens[p]   = True                        (False on padding)
    has_rollout_logprobs[p] = the record has logprobs and i + 1 < s
    indexer_topk.layer_L[p]   = topk[i] + o          (-1 stays -1; padding rows all -1)
    routed_experts.layer_L[p] = experts[i]           (padding rows 0 .. k-1)

so every index points into the packed row. ``cu_seqlens`` follow from ``sample_starts``
(:func:`packed_seq_params_from_starts`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from kpool_layers import model_facts
from recipes.replay.records import (EXPERTS_PREFIX, TOPK_PREFIX, ModelLayers, RolloutRecord,
                                    read_record)
from recipes.config.schema import Config, ConfigError, ModelConfig


def model_layers(m: ModelConfig) -> ModelLayers:
    """The layer sets and widths a record of model ``m`` holds."""
    freq = model_facts.moe_layer_freq(m.num_layers, m.num_moe_experts, m.moe_first_k_dense_layers)
    tail = m.dsa_indexer_kpool - 1 if m.dsa_indexer_kpool_always_select_tail else 0
    facts = {"num_layers": m.num_layers, "vocab_size": m.vocab_size,
             "dsa_indexer_topk": m.dsa_indexer_topk, "dsa_indexer_kpool": m.dsa_indexer_kpool,
             "dsa_indexer_kpool_always_select_tail": m.dsa_indexer_kpool_always_select_tail,
             "num_moe_experts": m.num_moe_experts, "moe_router_topk": m.moe_router_topk}
    return ModelLayers(
        topk_layers=tuple(model_facts.LayerPattern.of(m).topk_layers()),
        topk_width=m.dsa_indexer_topk + tail,
        moe_layers=tuple(n for n in range(1, m.num_layers + 1)
                         if model_facts.is_moe(n, m.num_moe_experts, freq)),
        num_experts=m.num_moe_experts or 0,
        router_topk=m.moe_router_topk,
        vocab_size=m.vocab_size,
        facts={k: str(v) for k, v in facts.items()},
    )


def record_files(rollout_dir: str) -> list[Path]:
    """The ``*.safetensors`` records of ``data.rollout_dir``, by file name."""
    directory = Path(rollout_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ConfigError("data.rollout_dir", rollout_dir,
                          "a directory holding rollout records (*.safetensors, docs/replay.md)")
    return files


def pack(records: list[RolloutRecord], seq_length: int) -> list[list[int]]:
    """Greedy packing in order: the record indices of each row."""
    rows: list[list[int]] = []
    used = seq_length
    for i, record in enumerate(records):
        if used + record.length > seq_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += record.length
    return rows


class RolloutDataset(torch.utils.data.Dataset):
    """Packed rows of rollout records (module docstring); every record is read and validated
    when the dataset is built, before any training; fewer than ``min_rows`` rows is an error."""

    def __init__(self, cfg: Config, min_rows: int = 0) -> None:
        m, d = cfg.model, cfg.data
        self.layers = model_layers(m)
        self.seq_length = d.seq_length
        self.files = record_files(d.rollout_dir)
        self.records = [read_record(f, self.layers, require_topk=m.dsa_topk_replay,
                                    require_experts=m.moe_router_replay) for f in self.files]
        for path, record in zip(self.files, self.records):
            if record.length > d.seq_length:
                raise ConfigError("data.seq_length", d.seq_length,
                                  f">= every rollout sample's length ({path} has {record.length} tokens)")
        self.rows = pack(self.records, d.seq_length)
        if len(self.rows) < min_rows:
            raise ConfigError("train.steps", cfg.train.steps,
                              f"steps * train.global_batch_size <= the {len(self.rows)} packed rows "
                              f"of {len(self.files)} records in {d.rollout_dir}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return pack_row([self.records[i] for i in self.rows[index]], self.seq_length, self.layers)


def pack_row(records: list[RolloutRecord], seq_length: int, layers: ModelLayers) -> dict[str, torch.Tensor]:
    """One packed row ``{key: [seq_length, ...]}`` of ``records`` (module docstring)."""
    n = seq_length
    row = {"tokens": torch.zeros(n, dtype=torch.int64), "labels": torch.zeros(n, dtype=torch.int64),
           "loss_mask": torch.zeros(n, dtype=torch.float32),
           "position_ids": torch.zeros(n, dtype=torch.int64),
           "sample_starts": torch.zeros(n, dtype=torch.bool),
           "sample_tokens": torch.zeros(n, dtype=torch.bool),
           "rollout_logprobs": torch.zeros(n, dtype=torch.float32),
           "has_rollout_logprobs": torch.zeros(n, dtype=torch.bool)}
    topk_layers = sorted(records[0].topk) if records else []
    expert_layers = sorted(records[0].experts) if records else []
    for layer in topk_layers:
        row[f"{TOPK_PREFIX}{layer}"] = torch.full((n, layers.topk_width), -1, dtype=torch.int64)
    for layer in expert_layers:
        row[f"{EXPERTS_PREFIX}{layer}"] = torch.arange(layers.router_topk).expand(n, -1).clone()
    offset = 0
    for record in records:
        s, span = record.length, slice(offset, offset + record.length)
        if sorted(record.topk) != topk_layers or sorted(record.experts) != expert_layers:
            raise ValueError("records packed into one row must hold the same layer families")
        row["tokens"][span] = record.tokens
        row["labels"][offset:offset + s - 1] = record.tokens[1:]
        row["loss_mask"][offset:offset + s - 1] = record.loss_mask[1:].float()
        row["position_ids"][span] = torch.arange(s)
        row["sample_starts"][offset] = True
        row["sample_tokens"][span] = True
        if record.logprobs is not None:
            row["rollout_logprobs"][offset:offset + s - 1] = record.logprobs[1:]
            row["has_rollout_logprobs"][offset:offset + s - 1] = True
        for layer, idx in record.topk.items():
            row[f"{TOPK_PREFIX}{layer}"][span] = torch.where(idx < 0, idx, idx + offset)
        for layer, idx in record.experts.items():
            row[f"{EXPERTS_PREFIX}{layer}"][span] = idx
        offset += s
    if offset < n:
        row["sample_starts"][offset] = True  # the padding is a segment of its own
        row["position_ids"][offset:] = torch.arange(n - offset)
    return row


def packed_seq_params_from_starts(sample_starts: torch.Tensor) -> PackedSeqParams:
    """THD ``PackedSeqParams`` of a packed row ``sample_starts`` bool ``[1, s]``: int32
    ``cu_seqlens`` ``[0, ..., s]`` at every segment start, for q and kv."""
    if sample_starts.dim() != 2 or sample_starts.shape[0] != 1:
        raise ValueError(f"packed rows need sample_starts of shape [1, s], got {tuple(sample_starts.shape)}")
    s = sample_starts.shape[1]
    starts = sample_starts[0].nonzero().flatten()
    cu_seqlens = torch.cat([starts, starts.new_tensor([s])]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
