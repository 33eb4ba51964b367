"""Benchmark the DSA lightning indexer for kpool = 1, 2, 4, 8 in one run.

Per sequence length and kpool it measures (GLM-5 indexer shape: 32 heads x 128, top-2048, hidden
6144, q_lora_rank 2048, rope 64 channels, ReLU scoring; main attention 64 heads, absorbed latent
keys of 512 + 64 channels; bf16 on GPU):

    topk     indexer forward (projections, pooling, chunked top-k) without grad
    fwd+bwd  indexer forward + KL indexer loss + backward

with each ``--kernels`` backend of ``model.dsa_kernels`` (torch by default), time (median of
``--repeats`` after one warm-up) and extra peak GPU memory (peak minus what was
allocated before the step), and their ratios to kpool = 1 with the same kernels. Megatron-core's
``fused_qk_topk_naive`` (plain DSA, materialises [b, s, h, s]) runs side by side at each length;
out-of-memory is caught and reported. Prints a table and writes JSON to ``--out``.

    python scripts/bench/kpool.py --out runs/bench_kpool.json            # H200
    python scripts/bench/kpool.py --small --out /tmp/bench_kpool.json     # tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kpool_layers.compat import cpu as _cpu
from timing import init_single_rank, measure


@dataclass(frozen=True)
class Shape:
    hidden: int
    q_lora: int
    index_heads: int
    index_dim: int
    topk: int
    rope: int
    main_heads: int
    main_dim: int
    chunk: int


GLM5 = Shape(hidden=6144, q_lora=2048, index_heads=32, index_dim=128, topk=2048, rope=64,
             main_heads=64, main_dim=576, chunk=1024)
SMALL = Shape(hidden=64, q_lora=32, index_heads=4, index_dim=16, topk=32, rope=4,
              main_heads=4, main_dim=24, chunk=64)


def _config(shape: Shape, kpool: int, dtype: torch.dtype, kernels: str) -> "GLMTransformerConfig":
    from kpool_layers.config import GLMTransformerConfig

    return GLMTransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.main_heads,
        q_lora_rank=shape.q_lora, kv_lora_rank=shape.main_dim - shape.rope, qk_head_dim=shape.index_dim,
        qk_pos_emb_head_dim=shape.rope, v_head_dim=shape.index_dim, dsa_indexer_n_heads=shape.index_heads,
        dsa_indexer_head_dim=shape.index_dim, dsa_indexer_topk=shape.topk, dsa_indexer_scoring_relu=True,
        dsa_indexer_loss_coeff=1.0, dsa_indexer_query_chunk_size=shape.chunk, dsa_indexer_kpool=kpool,
        dsa_indexer_kpool_always_select_tail=kpool > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(), dsa_kernels=kernels,
    )


def _rotary(s: int, dim: int, device: torch.device, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rotate-half rotary on [s, b, n, dim] with fixed tables (cost stand-in for the real one)."""
    freq = 10000.0 ** (-torch.arange(0, dim, 2, device=device) / dim)
    angle = torch.arange(s, device=device)[:, None] * freq
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)[:, None, None]
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)[:, None, None]

    def apply(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], dim=-1) * sin

    return apply


def bench_indexer(shape: Shape, s: int, kpool: int, kernels: str, repeats: int, device: torch.device,
                  dtype: torch.dtype) -> dict:
    from kpool_layers.dsa.indexer import DSAIndexer
    from kpool_layers.dsa.indexer_loss import indexer_kl_loss

    torch.manual_seed(0)
    indexer = DSAIndexer(_config(shape, kpool, dtype, kernels), layer_number=1).to(device)
    hidden = torch.randn(s, 1, shape.hidden, device=device, dtype=dtype)
    latent = torch.randn(s, 1, shape.q_lora, device=device, dtype=dtype)
    main_q = torch.randn(s, 1, shape.main_heads, shape.main_dim, device=device, dtype=dtype)
    main_k = torch.randn(s, 1, 1, shape.main_dim, device=device, dtype=dtype)
    rotary = _rotary(s, shape.rope, device, dtype)
    cuda = device.type == "cuda"

    def topk() -> None:
        with torch.no_grad():
            indexer(hidden, latent, rotary)

    def fwd_bwd() -> None:
        out = indexer(hidden, latent, rotary)
        indexer_kl_loss(indexer, out, main_q, main_k, shape.main_dim**-0.5, sparse=True).backward()
        indexer.zero_grad(set_to_none=True)

    return {"s": s, "kpool": kpool, "kernels": kernels, "topk": measure(topk, repeats, cuda),
            "fwd_bwd": measure(fwd_bwd, repeats, cuda)}


def bench_megatron_naive(shape: Shape, s: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    from megatron.core.transformer.experimental_attention_variant.dsa import fused_qk_topk_naive

    q = torch.randn(s, 1, shape.index_heads, shape.index_dim, device=device, dtype=dtype)
    k = torch.randn(s, 1, shape.index_dim, device=device, dtype=dtype)
    w = torch.randn(s, 1, shape.index_heads, device=device, dtype=dtype)
    try:
        mask = torch.triu(torch.full((s, s), float("-inf"), device=device), diagonal=1)
    except torch.OutOfMemoryError:
        return {"s": s, "topk": {"ms": None, "peak_mib": None, "oom": True}}

    def topk() -> None:
        with torch.no_grad():
            fused_qk_topk_naive(q, k, w, shape.topk, mask=mask, use_relu=True)

    result = {"s": s, "topk": measure(topk, repeats, device.type == "cuda")}
    del mask
    return result


def _fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], naive: list[dict]) -> None:
    print(f"{'s':>6} {'kpool':>5} {'kernels':>8} | {'topk ms':>9} {'MiB':>9} {'x k1':>5} {'mem':>5} | "
          f"{'fwd+bwd ms':>10} {'MiB':>9} {'x k1':>5} {'mem':>5}")
    for r in rows:
        cells = []
        for key in ("topk", "fwd_bwd"):
            m = r[key]
            cells.append("OOM" if m["oom"] else
                         f"{_fmt(m['ms']):>9} {_fmt(m['peak_mib']):>9} {_fmt(m.get('time_vs_kpool1'), '.2f'):>5} "
                         f"{_fmt(m.get('mem_vs_kpool1'), '.2f'):>5}")
        print(f"{r['s']:>6} {r['kpool']:>5} {r['kernels']:>8} | {cells[0]} | {cells[1]}")
    for r in naive:
        m = r["topk"]
        print(f"{r['s']:>6} {'naive':>5} {'':>8} | " + ("OOM" if m["oom"] else f"{_fmt(m['ms']):>9} {_fmt(m['peak_mib']):>9}")
              + "   (megatron fused_qk_topk_naive, plain DSA)")


def _add_ratios(rows: list[dict]) -> None:
    base = {(r["s"], r["kernels"]): r for r in rows if r["kpool"] == 1}
    for r in rows:
        for key in ("topk", "fwd_bwd"):
            ref, m = base.get((r["s"], r["kernels"]), {}).get(key), r[key]
            if ref and ref["ms"] and m["ms"]:
                m["time_vs_kpool1"] = m["ms"] / ref["ms"]
            if ref and ref["peak_mib"] and m["peak_mib"] is not None:
                m["mem_vs_kpool1"] = m["peak_mib"] / ref["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 8192 16384; small: 128 256)")
    parser.add_argument("--kpool", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--kernels", nargs="+", default=["torch"],
                        choices=["torch", "tilelang", "triton"], help="model.dsa_kernels backends")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    _cpu.install()
    init_single_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMALL if args.small else GLM5
    seqs = args.seq or ([128, 256] if args.small else [8192, 16384])

    rows, naive = [], []
    for s in seqs:
        for kernels in args.kernels:
            for kpool in args.kpool:
                rows.append(bench_indexer(shape, s, kpool, kernels, args.repeats, device, dtype))
        naive.append(bench_megatron_naive(shape, s, args.repeats, device, dtype))
    _add_ratios(rows)
    print_table(rows, naive)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype),
        "shape": shape.__dict__,
        "indexer": rows,
        "megatron_fused_qk_topk_naive": naive,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
