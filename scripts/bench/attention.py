"""Benchmark DSA top-k + sparse absorbed-MLA attention against megatron-core's reference path.

Per sequence length (batch 1; GLM-5 shape: indexer 32 heads x 128, top-2048, hidden 6144,
q_lora_rank 2048, rope 64; main attention 64 heads over latent keys of 512 + 64 channels; bf16 on
GPU, fp32 on CPU) and per path, three stages are timed (median of ``--repeats`` after one warm-up)
with their extra peak GPU memory (peak minus what was allocated before the step):

    topk     top-k selection without grad
    attn     sparse attention forward + backward (grads of queries and latent keys)
    total    both in one step

Paths:
    ours      ``kpool_layers.indexer.DSAIndexer`` (projections, rotary, chunked top-k) and
              ``kpool_layers.sparse_attention.sparse_mla_attention`` (chunked gather)
    megatron  ``fused_qk_topk_naive`` on index q/k/weights of the same shapes (materialises
              [b, s, h, s]) and ``_unfused_absorbed_dsa_fn`` (dense [b, n, s, s] scores masked to
              the top-k), both with megatron's additive causal mask [s, s] (an input, not counted)

Both attention stages use the indices of our indexer, so their outputs are compared
(``max_abs_diff``). Out-of-memory is caught and reported; ``ratio`` is megatron / ours.
Prints a table and writes JSON to ``--out``.

    python scripts/bench/attention.py --out runs/bench_attention.json          # H200
    python scripts/bench/attention.py --small --out /tmp/bench_attention.json  # tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kpool_layers import _cpu
from timing import OOM, init_single_rank, measure


@dataclass(frozen=True)
class Shape:
    hidden: int
    q_lora: int
    index_heads: int
    index_dim: int
    topk: int
    rope: int
    heads: int
    kv_lora: int
    chunk: int


GLM5 = Shape(hidden=6144, q_lora=2048, index_heads=32, index_dim=128, topk=2048, rope=64,
             heads=64, kv_lora=512, chunk=1024)
SMALL = Shape(hidden=64, q_lora=32, index_heads=4, index_dim=16, topk=32, rope=8, heads=4,
              kv_lora=24, chunk=64)
STAGES = ("topk", "attn", "total")


def _config(shape: Shape, dtype: torch.dtype):  # noqa: ANN202 (GLMTransformerConfig)
    from kpool_layers.config import GLMTransformerConfig

    return GLMTransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        q_lora_rank=shape.q_lora, kv_lora_rank=shape.kv_lora, qk_head_dim=shape.index_dim,
        qk_pos_emb_head_dim=shape.rope, v_head_dim=shape.index_dim, rope_type="rope",
        dsa_indexer_n_heads=shape.index_heads, dsa_indexer_head_dim=shape.index_dim,
        dsa_indexer_topk=shape.topk, dsa_indexer_query_chunk_size=shape.chunk,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, add_bias_linear=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def _attention_inputs(shape: Shape, s: int, device: torch.device, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Absorbed queries [s, 1, n, d_k], latent keys [s, 1, 1, d_k] (leaf, need grad) and an output
    gradient [s, 1, n, kv_lora]."""
    d_k = shape.kv_lora + shape.rope
    query = torch.randn(s, 1, shape.heads, d_k, device=device, dtype=dtype).requires_grad_()
    key = torch.randn(s, 1, 1, d_k, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(s, 1, shape.heads, shape.kv_lora, device=device, dtype=dtype)
    return query, key, grad


def _backward(out: torch.Tensor, grad: torch.Tensor, *leaves: torch.Tensor) -> None:
    torch.autograd.backward(out, grad)
    for leaf in leaves:
        leaf.grad = None


def bench_length(shape: Shape, s: int, repeats: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        _unfused_absorbed_dsa_fn,
        fused_qk_topk_naive,
    )

    from kpool_layers.indexer import DSAIndexer
    from kpool_layers.rope import Rotary
    from kpool_layers.sparse_attention import sparse_mla_attention

    cuda = device.type == "cuda"
    config = _config(shape, dtype)
    scale = (shape.kv_lora + shape.rope) ** -0.5
    torch.manual_seed(0)
    indexer = DSAIndexer(config, layer_number=1).to(device)
    hidden = torch.randn(s, 1, shape.hidden, device=device, dtype=dtype)
    latent = torch.randn(s, 1, shape.q_lora, device=device, dtype=dtype)
    rotary = Rotary.from_config(config).bind(torch.arange(s, device=device), mla_interleaved=False)
    query, key, grad = _attention_inputs(shape, s, device, dtype)

    def our_topk() -> torch.Tensor:
        with torch.no_grad():
            return indexer(hidden, latent, rotary).topk_indices

    def our_attn(indices: torch.Tensor) -> torch.Tensor:
        out = sparse_mla_attention(query, key, indices, scale, v_channels=shape.kv_lora,
                                   chunk_size=shape.chunk)
        _backward(out, grad, query, key)
        return out.detach()

    result: dict[str, Any] = {"s": s, "ours": {}, "megatron": {}}
    try:
        indices = our_topk()
    except torch.OutOfMemoryError:
        result["ours"] = {stage: OOM for stage in STAGES}
        return result
    ours = result["ours"]
    ours["topk"] = measure(our_topk, repeats, cuda)
    ours["attn"] = measure(lambda: our_attn(indices), repeats, cuda)
    ours["total"] = measure(lambda: our_attn(our_topk()), repeats, cuda)

    index_q = torch.randn(s, 1, shape.index_heads, shape.index_dim, device=device, dtype=dtype)
    index_k = torch.randn(s, 1, shape.index_dim, device=device, dtype=dtype)
    index_w = torch.randn(s, 1, shape.index_heads, device=device, dtype=dtype)
    theirs = result["megatron"]
    try:
        mask = torch.triu(torch.full((s, s), float("-inf"), device=device), diagonal=1)
    except torch.OutOfMemoryError:
        result["megatron"] = {stage: OOM for stage in STAGES}
        return result

    def their_topk() -> torch.Tensor:
        with torch.no_grad():
            return fused_qk_topk_naive(index_q, index_k, index_w, shape.topk, mask=mask,
                                       use_relu=True)[1]

    def their_attn(topk_indices: torch.Tensor) -> torch.Tensor:
        out = _unfused_absorbed_dsa_fn(query, key, topk_indices, scale, shape.kv_lora, mask=mask)
        _backward(out, grad, query, key)
        return out.detach()

    theirs["topk"] = measure(their_topk, repeats, cuda)
    theirs["attn"] = measure(lambda: their_attn(indices), repeats, cuda)
    theirs["total"] = measure(lambda: their_attn(their_topk()), repeats, cuda)
    if not theirs["attn"]["oom"]:
        try:
            diff = (our_attn(indices).float() - their_attn(indices).float()).abs().max()
            result["max_abs_diff"] = float(diff)
        except torch.OutOfMemoryError:
            result["max_abs_diff"] = None
        if cuda:
            torch.cuda.empty_cache()
    for stage in STAGES:
        mine, other = ours[stage], theirs[stage]
        mine["ratio"] = {
            "time": other["ms"] / mine["ms"] if other["ms"] and mine["ms"] else None,
            "mem": (other["peak_mib"] / mine["peak_mib"]
                    if other["peak_mib"] and mine["peak_mib"] else None),
        }
    return result


def _cell(m: dict[str, Any]) -> str:
    if m.get("oom"):
        return f"{'OOM':>10} {'':>10}"
    peak = "-" if m["peak_mib"] is None else f"{m['peak_mib']:.0f}"
    return f"{m['ms']:>10.1f} {peak:>10}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = " | ".join(f"{stage + ' ms':>10} {'MiB':>10}" for stage in STAGES)
    print(f"{'s':>6} {'path':>8} | {head} | ratio time/mem (megatron / ours)")
    for row in rows:
        for path in ("ours", "megatron"):
            cells = [_cell(row[path][stage]) if stage in row[path] else f"{'-':>10} {'-':>10}"
                     for stage in STAGES]
            extra = ""
            if path == "ours":
                ratios = [row[path][stage].get("ratio", {}) for stage in STAGES]
                extra = "  ".join(
                    f"{stage}: {_ratio(r.get('time'))}/{_ratio(r.get('mem'))}"
                    for stage, r in zip(STAGES, ratios))
            elif "max_abs_diff" in row:
                extra = f"max |ours - megatron| = {row['max_abs_diff']}"
            print(f"{row['s']:>6} {path:>8} | {' | '.join(cells)} | {extra}")


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--seq", type=int, nargs="+",
                        help="sequence lengths (default 4096 8192 16384 32768; small: 128 256)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    _cpu.install()
    init_single_rank(29519)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMALL if args.small else GLM5
    seqs = args.seq or ([128, 256] if args.small else [4096, 8192, 16384, 32768])

    rows = [bench_length(shape, s, args.repeats, device, dtype) for s in seqs]
    print_table(rows)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype),
        "shape": shape.__dict__,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
