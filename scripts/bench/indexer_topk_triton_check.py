"""Check and time the Triton indexer top-k (``range_topk_triton``: scoring kernel + radix-select
kernel) against the chunked PyTorch reference (``chunked_range_topk``) on one GPU, GLM-5 indexer
shape (32 heads x 128, top-2048, ReLU scoring, bf16 inputs, FP32 weights).

1. Correctness at t = 4096 (two packed documents, 3:5), kpool 1 (token keys) and kpool 4 (pooled keys
   from ``pool_keys``, top-512 of the pools each query sees), with the default launch config and
   with one of 11/11/10-bit radix passes, 2 rows per selection program and an 8 MiB score buffer
   (several query chunks): determinism (bit-identical twice),
   rows identical to the reference, rows with the same set, and for the keys where the sets differ
   their exact (FP64) score distance to the reference's k-th score over an FP32 rounding bound
   (``swap ratio <= 1`` passes); every row in ascending key order, -1 slots last.
2. Timing (``triton.testing.do_bench``, median ms) and extra peak memory of scoring + top-k at
   s = 4K .. 32K (one causal document, t = s queries), kpool 1 and 4, reference vs Triton; the
   Triton row also gives the FLOP rate of its scoring (every visible pair scored once) over the
   whole call's time, and, timed alone, a ``torch.sort`` of a ``[t, topk]`` int64 tensor (what
   ordering each row best first would add; the select kernel writes ascending key order and the
   call does not sort).
3. A sweep of launch configs at s = 16K, kpool 1.

Prints a table last and writes JSON to ``--out``. Runs on torch >= 2.6 and triton >= 3.4.

    python scripts/bench/indexer_topk_triton_check.py --out runs/indexer_topk_triton.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from kpool_layers.kernels.indexer_topk_triton import LaunchConfig, range_topk_triton
from kpool_layers.dsa.kpool import pool_keys, pool_layout
from kpool_layers.dsa.topk import chunked_range_topk

HEADS, DIM, TOPK = 32, 128, 2048
DEVICE = "cuda"
SWEEP = [  # scoring tiles and pipeline, then the selection's rows, block, warps and radix width
    LaunchConfig(**kw) for kw in [
        {}, {"num_warps": 8}, {"num_stages": 2}, {"num_stages": 4}, {"block_n": 64},
        {"block_n": 256, "num_warps": 8}, {"block_t": 128, "num_warps": 8}, {"block_t": 128, "block_n": 64},
        {"select_block": 2048}, {"select_block": 2048, "select_warps": 8}, {"select_block": 512},
        {"select_warps": 8}, {"radix_bits": 11}, {"radix_bits": 6},
        {"score_buffer_bytes": 64 * 2**20}, {"score_buffer_bytes": 2 * 2**30},
    ]
]
KNOBS = ("block_t", "block_n", "num_warps", "num_stages", "select_block", "select_warps",
         "radix_bits", "score_buffer_bytes")
CHECK_CONFIGS = {  # the default, and 11/11/10-bit passes with 8 query chunks at 4K
    "default": LaunchConfig(),
    "radix11_chunks": LaunchConfig(radix_bits=11, score_buffer_bytes=8 * 2**20),
}


def inputs(t: int, kpool: int, cu: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q [t, h, d] bf16, keys [n, d] bf16 (pooled for kpool > 1), weights [t, h] FP32, lo, hi."""
    dev = DEVICE
    layout = pool_layout(t, kpool, torch.tensor(cu), device=dev)
    q = torch.randn(t, HEADS, DIM, generator=gen, device=dev).bfloat16()
    keys = torch.randn(t, DIM, generator=gen, device=dev).bfloat16()
    if kpool > 1:
        gate = torch.randn(t, DIM, generator=gen, device=dev).bfloat16()
        ape = 0.1 * torch.randn(kpool, DIM, generator=gen, device=dev)
        keys = pool_keys(keys, gate, ape, layout)
    w = torch.rand(t, HEADS, generator=gen, device=dev) * (HEADS * DIM) ** -0.5
    return q, keys, w, layout.query_lo, layout.query_hi


def exact_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """FP64 ReLU scores [len(rows), n] of the given query rows."""
    out = []
    for part in rows.split(64):
        logits = torch.einsum("rhd,nd->rhn", q[part].double(), keys.double()).relu()
        out.append(torch.einsum("rh,rhn->rn", w[part].double(), logits))
    return torch.cat(out)


def correctness(kpool: int, t: int, variant: str, gen: torch.Generator) -> dict[str, Any]:
    topk = TOPK // kpool
    q, keys, w, lo, hi = inputs(t, kpool, [0, 3 * t // 8, t], gen)
    config = CHECK_CONFIGS[variant]
    got = range_topk_triton(q, keys, w, lo, hi, topk=topk, relu=True, config=config)
    again = range_topk_triton(q, keys, w, lo, hi, topk=topk, relu=True, config=config)
    ref = chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=True, chunk_size=1024)
    n = keys.shape[0]
    differs = torch.nonzero((got != ref).any(1)).flatten()
    member = torch.zeros(differs.numel(), n + 1, dtype=torch.bool, device=DEVICE)
    in_got = member.scatter(1, got[differs] + 1, True)[:, 1:]  # column 0 collects the -1 slots
    in_ref = member.scatter(1, ref[differs] + 1, True)[:, 1:]
    sym = in_got ^ in_ref
    # Both sides sum d products and h heads in FP32; Cauchy-Schwarz bounds the absolute terms.
    bound = (w.double().abs() * q.double().norm(dim=2)).sum(1) * keys.double().norm(dim=1).max()
    tol = 4 * (DIM + HEADS) * 2**-24 * bound  # [t]
    exact = exact_scores(q, keys, w, torch.arange(t, device=DEVICE))  # [t, n]
    ascending = bool(((got[:, 1:] < 0) | ((got[:, :-1] >= 0) & (got[:, 1:] > got[:, :-1]))).all())
    ratio = 0.0
    if differs.numel():  # the reference's k-th score: the lowest it selected
        kth = exact[differs].gather(1, ref[differs].clamp_min(0)).masked_fill(
            ref[differs] < 0, float("inf")).min(1, keepdim=True).values
        ratio = float(((exact[differs] - kth).abs() / tol[differs, None]).masked_fill(~sym, 0).max())
    return {
        "kpool": kpool, "t": t, "topk": topk, "config": variant,
        "deterministic": bool(torch.equal(got, again)),
        "empty_slots_match": bool(torch.equal(got < 0, ref < 0)),
        "rows_identical": float((got == ref).all(1).float().mean()),
        "rows_same_set": 1.0 - float(sym.any(1).sum()) / t,
        "keys_swapped": int(sym.sum()) // 2,
        "max_swap_ratio": ratio,
        "ascending": ascending,
        "ok": bool(torch.equal(got, again) and torch.equal(got < 0, ref < 0) and ascending and ratio <= 1.0),
    }


def peak_mib(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(fn: Callable[[], Any], rep: int) -> dict[str, Any]:
    try:
        return {"ms": do_bench(fn, warmup=25, rep=rep, return_mode="median"), "peak_mib": peak_mib(fn)}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"ms": None, "peak_mib": None, "error": "OOM"}
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result too
        return {"ms": None, "peak_mib": None, "error": f"{type(exc).__name__}: {exc}"[:500]}


def timing(s: int, kpool: int, rep: int, chunk: int, gen: torch.Generator) -> dict[str, Any]:
    topk = TOPK // kpool
    layout = pool_layout(s, kpool, device=DEVICE)
    n = layout.n_pools
    q = torch.randn(s, HEADS, DIM, generator=gen, device=DEVICE).bfloat16()
    keys = torch.randn(n, DIM, generator=gen, device=DEVICE).bfloat16()
    w = torch.rand(s, HEADS, generator=gen, device=DEVICE)
    lo, hi = layout.query_lo, layout.query_hi
    pairs = int((hi - lo).clamp_min(0).sum())
    ref = bench(lambda: chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=True, chunk_size=chunk), rep)
    tri = bench(lambda: range_topk_triton(q, keys, w, lo, hi, topk=topk, relu=True), rep)
    if tri["ms"]:  # scoring FLOPs (every visible pair once) over the whole call's time
        tri["score_tflops"] = 2 * HEADS * DIM * pairs / (tri["ms"] * 1e-3) / 1e12
        packed = torch.randint(0, 2**62, (s, topk), generator=gen, device=DEVICE)
        tri["removed_sort_ms"] = bench(lambda: torch.sort(packed, dim=1), rep)["ms"]  # not in "ms"
    return {"s": s, "kpool": kpool, "n_keys": n, "topk": topk, "pairs": pairs, "torch": ref, "triton": tri}


def sweep(s: int, rep: int, gen: torch.Generator) -> list[dict[str, Any]]:
    layout = pool_layout(s, 1, device=DEVICE)
    q = torch.randn(s, HEADS, DIM, generator=gen, device=DEVICE).bfloat16()
    keys = torch.randn(s, DIM, generator=gen, device=DEVICE).bfloat16()
    w = torch.rand(s, HEADS, generator=gen, device=DEVICE)
    args = (q, keys, w, layout.query_lo, layout.query_hi)
    base = range_topk_triton(*args, topk=TOPK, relu=True)
    rows = []
    for cfg in SWEEP:
        t0 = time.perf_counter()
        try:
            same = float((range_topk_triton(*args, topk=TOPK, relu=True, config=cfg) == base).all(1).float().mean())
        except Exception as exc:  # noqa: BLE001
            rows.append({"config": vars(cfg), "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        compile_s = time.perf_counter() - t0
        res = bench(lambda: range_topk_triton(*args, topk=TOPK, relu=True, config=cfg), rep)
        rows.append({"config": vars(cfg), "first_call_s": compile_s, "rows_equal_default": same, **res})
    return rows


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}")
    print(f"correctness (t={result['args']['check_t']}): kpool  config  ok  determ  rows_identical  rows_same_set  "
          "swapped  swap_ratio  ascending")
    for c in result["correctness"]:
        print(f"  {c['kpool']:>5}  {c['config']:>14}  {c.get('ok')!s:>5}  {c.get('deterministic')!s:>6}  "
              f"{fmt(c.get('rows_identical'), '.4f'):>14}  {fmt(c.get('rows_same_set'), '.4f'):>13}  "
              f"{fmt(c.get('keys_swapped'), 'd'):>7}  {fmt(c.get('max_swap_ratio'), '.3f'):>10}  "
              f"{c.get('ascending')!s:>9}")
    print("timing:     s  kpool  torch_ms  triton_ms  (removed_sort_ms)  speedup  torch_MiB  triton_MiB  score_TFLOP/s")
    for r in result["timing"]:
        a, b = r["torch"], r["triton"]
        speed = a["ms"] / b["ms"] if a["ms"] and b["ms"] else None
        print(f"  {r['s']:>10}  {r['kpool']:>5}  {fmt(a['ms']):>8}  {fmt(b['ms']):>9}  {fmt(b.get('removed_sort_ms')):>17}  "
              f"{fmt(speed):>7}  "
              f"{fmt(a['peak_mib'], '.0f'):>9}  {fmt(b['peak_mib'], '.0f'):>10}  {fmt(b.get('score_tflops'), '.0f'):>13}"
              + (f"  {b['error'][:80]}" if "error" in b else ""))
    if result["sweep"]:
        print(f"sweep (s={result['args']['sweep_s']}, kpool 1): {' '.join(KNOBS)} (buffer in MiB)  ms  "
              "rows_equal_default")
        for r in result["sweep"]:
            c = {**r["config"], "score_buffer_bytes": r["config"]["score_buffer_bytes"] // 2**20}
            print("  " + " ".join(f"{c[k]:>{len(k)}}" for k in KNOBS) + f"  {fmt(r.get('ms')):>8}  "
                  f"{fmt(r.get('rows_equal_default'), '.4f')}" + (f"  {r['error'][:80]}" if "error" in r else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--kpools", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--check-t", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024, help="reference query chunk (GLM-5 config)")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition budget, ms")
    parser.add_argument("--sweep-s", type=int, default=16384, help="0 skips the config sweep")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "args": vars(args), "correctness": [], "timing": [], "sweep": [],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        Path(args.out).write_text(json.dumps(result, indent=2))

    for kpool in args.kpools:
        for variant in CHECK_CONFIGS:
            try:
                result["correctness"].append(correctness(kpool, args.check_t, variant, gen))
            except Exception:  # noqa: BLE001 - keep timing the reference
                result["correctness"].append(
                    {"kpool": kpool, "config": variant, "ok": False, "error": traceback.format_exc()[-2000:]})
                print(result["correctness"][-1]["error"], flush=True)
            print(result["correctness"][-1], flush=True)
            save()
    for s in args.sizes:
        for kpool in args.kpools:
            result["timing"].append(timing(s, kpool, args.rep, args.chunk, gen))
            print(result["timing"][-1], flush=True)
            save()
    if args.sweep_s:
        result["sweep"] = sweep(args.sweep_s, args.rep, gen)
        save()

    print_table(result)
    print(f"json: {args.out}")


if __name__ == "__main__":
    main()
