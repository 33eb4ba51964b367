"""Check and time the Triton sparse-MLA kernels against the chunked torch path on one CUDA GPU.

1. Correctness (bf16): GLM-5 shape (s=2048, n=64, d_k=576 = 512 latent + 64 rope, v=512, W=2048)
   and NoPE shape (d_k=v=512), plus a packed-document (THD) variant; relative errors
   ``||x - ref|| / ||ref||`` of out, dq, dkv against the fp32 torch reference
   (``kpool_layers.dsa.sparse_attention``) on the same bf16 inputs, next to the bf16 torch path's.
2. Determinism: two Triton runs bit-identical (out, dq, dkv).
3. Timing (``triton.testing.do_bench`` median) of forward and forward+backward at each ``--sizes``
   (n=64, W=2048, GLM-5 dims) for Triton and the torch path, with useful TFLOP/s
   (forward ``2*s*W*n*(d_k+v)``, backward twice that) and extra peak memory, and the Triton
   forward with the slot probabilities; plus a per-kernel CUDA time breakdown of one Triton
   forward+backward (torch profiler).
4. With ``--sweep`` (about a dozen more kernel compiles; ``--sweep-only``: this alone), at the first
   size: each kernel's alternatives of ``SWEEP`` in turn (the others at their defaults), timing
   forward (``fwd``) or forward+backward (``grad``, ``dq``), with the relative difference of the
   results from the default table's (a wrong variant shows there; bits differ anyway, as BK and
   BH fix the summation order). It sweeps the kernels of the layout the runs use (``--layout``;
   ``auto``: the one :func:`~kpool_layers.kernels.sparse_mla_dense_triton.dense_pays` picks at
   that size): the gather kernels' ``SWEEP`` and the backward's buffer budgets ``BUFFER_SWEEP``
   (with their extra peak memory), or the dense kernels' ``DENSE_SWEEP``, their query-chunk
   counts ``CHUNK_SWEEP`` and the backward's ``P``/``dS`` budgets ``DENSE_BUFFER_SWEEP`` (with
   their extra peak memory).

Top-k indices: per query, W distinct random keys of its causal prefix (fewer early on, padded with
-1), so the first W queries have empty slots, as from the indexer.

    python scripts/bench/sparse_mla_triton_check.py --out runs/sparse_mla_triton.json
    python scripts/bench/sparse_mla_triton_check.py --sizes 4096 --no-torch --sweep --out x.json
    python scripts/bench/sparse_mla_triton_check.py --sizes 8192 --layout gather --sweep-only --out x.json
    python scripts/bench/sparse_mla_triton_check.py --sizes 32768 --layout gather --sweep-only \
        --sweep-kernels grad dq buffer --out x.json
    python scripts/bench/sparse_mla_triton_check.py --sizes 4096 --heads 16 --sweep-only --out x.json
Works with torch >= 2.4 and triton >= 3.0 (uses only ``do_bench(..., return_mode="median")``).
Each kernel compiles at first use (checked offline for sm_90 with ptxas: the default table fits
Hopper's 227 KiB of shared memory at d_k 576 and 512, n = 16..128).
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, get_args

import torch
from triton.testing import do_bench

from kpool_layers.kernels import sparse_mla_dense_triton as dense
from kpool_layers.kernels import sparse_mla_triton as smla
from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton
from kpool_layers.dsa.sparse_attention import sparse_mla_attention

TORCH_CHUNK = 512
SWEEP = {
    "fwd": [dict(BK=32), dict(BC=128, num_stages=2), dict(num_stages=2), dict(SKIP_EMPTY=False),
            dict(BK=128, num_stages=2), dict(BH=32, num_warps=4)],
    "grad": [dict(BK=64), dict(SKIP_EMPTY=False), dict(BC=128, num_stages=2),
             dict(num_stages=2), dict(num_stages=4), dict(BK=128, BC=32, num_stages=4)],
    "dq": [dict(BK=64), dict(BK=64, BC=128, num_warps=8), dict(num_stages=2)],
}
"""Alternatives to ``smla.CONFIGS`` tried by the gather layout's sweep (each updates the kernel's
default)."""

BUFFER_SWEEP = [1 << 30, 4 << 30]
"""Alternatives to ``smla.PARTIAL_BUFFER_BYTES`` tried by the gather layout's sweep."""

DENSE_SWEEP = {
    "softmax": [dict(BN=128), dict(BN=512, num_warps=8), dict(num_warps=8)],
    "ds": [dict(BM=128, BN=128), dict(BN=128, num_warps=4), dict(BM=128, BN=64, num_warps=4),
           dict(BC=32, num_stages=4), dict(num_stages=2)],
}
"""Alternatives to ``dense.CONFIGS`` tried by the dense layout's sweep."""

CHUNK_SWEEP = [2, 8, 16]
"""Alternatives to ``dense.QUERY_CHUNKS`` tried by the dense layout's sweep."""

DENSE_BUFFER_SWEEP = [1 << 29, 1 << 27]
"""Alternatives to ``dense.DS_BUFFER_BYTES`` tried by the dense layout's sweep."""


def causal_topk(s: int, width: int, key_start: torch.Tensor | None, seed: int) -> torch.Tensor:
    """int32 ``[1, s, W]``: per query up to W distinct random keys of its document's causal
    prefix, then -1 (built 1024 queries at a time)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    start = key_start if key_start is not None else torch.zeros(s, dtype=torch.int64, device="cuda")
    keys = torch.arange(s, device="cuda")
    rows = []
    for r0 in range(0, s, 1024):
        i = torch.arange(r0, min(r0 + 1024, s), device="cuda")
        visible = (keys[None] <= i[:, None]) & (keys[None] >= start[i, None])
        score = torch.rand(len(i), s, generator=gen, device="cuda").masked_fill(~visible, -1.0)
        top, idx = score.topk(min(width, s), dim=-1)
        rows.append(torch.where(top >= 0, idx, -1))
    out = torch.cat(rows)
    if width > s:
        out = torch.cat([out, out.new_full((s, width - s), -1)], -1)
    return out[None].int()


def inputs(s: int, n: int, d: int, v: int, width: int, thd: bool, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    key_start = None
    if thd:  # documents [0, s/5), [s/5, s/2), [s/2, s)
        bounds = torch.tensor([0, s // 5, s // 2], device="cuda")
        doc = torch.searchsorted(bounds, torch.arange(s, device="cuda"), right=True) - 1
        key_start = bounds[doc]
    return dict(
        query=torch.randn(s, 1, n, d, generator=gen, device="cuda").bfloat16().requires_grad_(),
        latent_kv=torch.randn(s, 1, 1, d, generator=gen, device="cuda").bfloat16().requires_grad_(),
        topk_indices=causal_topk(s, width, key_start, seed),
        key_start=key_start,
        grad_out=torch.randn(s, 1, n, v, generator=gen, device="cuda").bfloat16(),
        softmax_scale=d ** -0.5, v_channels=v)


LAYOUT: list[smla.Layout] = ["auto"]
"""The Triton layout every run here uses (``--layout``)."""


def attention(path: str, x: dict, query: torch.Tensor, latent_kv: torch.Tensor) -> torch.Tensor:
    if path == "triton":
        return sparse_mla_triton(query, latent_kv, x["topk_indices"], x["softmax_scale"],
                                 v_channels=x["v_channels"], key_start=x["key_start"],
                                 layout=LAYOUT[0])
    return sparse_mla_attention(query, latent_kv, x["topk_indices"], x["softmax_scale"],
                                v_channels=x["v_channels"], chunk_size=TORCH_CHUNK,
                                key_start=x["key_start"])


def forward_backward(path: str, x: dict, query: torch.Tensor | None = None,
                     latent_kv: torch.Tensor | None = None) -> list[torch.Tensor]:
    query = x["query"] if query is None else query
    latent_kv = x["latent_kv"] if latent_kv is None else latent_kv
    out = attention(path, x, query, latent_kv)
    grad_out = x["grad_out"].to(out.dtype)
    return [out, *torch.autograd.grad(out, (query, latent_kv), grad_out)]


def check(name: str, s: int, n: int, d: int, v: int, width: int, thd: bool) -> dict:
    x = inputs(s, n, d, v, width, thd)
    got, again = forward_backward("triton", x), forward_backward("triton", x)
    q32, kv32 = (x[k].detach().float().requires_grad_() for k in ("query", "latent_kv"))
    ref = forward_backward("torch", x, q32, kv32)
    bf16 = forward_backward("torch", x)
    row = dict(case=name, s=s, n=n, d_k=d, v=v, W=width, thd=thd,
               deterministic=all(torch.equal(g, a) for g, a in zip(got, again)),
               finite=all(bool(g.isfinite().all()) for g in got))
    for tensor, g, b, r in zip(("out", "dq", "dkv"), got, bf16, ref):
        row[f"err_{tensor}"] = ((g.float() - r).norm() / r.norm()).item()
        row[f"torch_bf16_err_{tensor}"] = ((b.float() - r).norm() / r.norm()).item()
    row["ok"] = row["deterministic"] and row["finite"] and all(
        row[f"err_{t}"] <= 2e-2 for t in ("out", "dq", "dkv"))
    return row


def bench(fn: Callable[[], object]) -> tuple[float, float]:
    """(median ms, extra peak GiB of one call)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return do_bench(fn, warmup=50, rep=300, return_mode="median"), peak


def with_probs(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_mla_triton(x["query"], x["latent_kv"], x["topk_indices"], x["softmax_scale"],
                             v_channels=x["v_channels"], key_start=x["key_start"],
                             return_slot_probs=True, layout=LAYOUT[0])


def timing(s: int, n: int, d: int, v: int, width: int, paths: list[str]) -> list[dict]:
    x = inputs(s, n, d, v, width, thd=False, seed=1)
    flops_fwd = 2 * s * width * n * (d + v)
    rows = []
    for path in paths:
        stages = [("fwd", lambda: attention(path, x, x["query"], x["latent_kv"]), flops_fwd),
                  ("fwd+bwd", lambda: forward_backward(path, x), 3 * flops_fwd)]
        if path == "triton":
            stages.append(("fwd+probs", lambda: with_probs(x), flops_fwd))
        for stage, fn, flops in stages:
            try:
                ms, peak = bench(fn)
            except torch.cuda.OutOfMemoryError:
                rows.append(dict(path=path, stage=stage, s=s, oom=True))
                continue
            rows.append(dict(path=path, stage=stage, s=s, n=n, W=width, ms=ms,
                             tflops=flops / ms / 1e9, peak_gib=peak))
    return rows


def sweep(s: int, n: int, d: int, v: int, width: int, dense_layout: bool,
          kernels: list[str] | None = None) -> list[dict]:
    """Each alternative of ``SWEEP`` (gather) or of ``DENSE_SWEEP`` and ``CHUNK_SWEEP`` (dense)
    against the default table (see the module docstring); ``kernels``: only those tables' rows
    (default all, the buffer budgets and query-chunk counts included)."""
    x = inputs(s, n, d, v, width, thd=False, seed=3)
    table, variants = (dense.CONFIGS, DENSE_SWEEP) if dense_layout else (smla.CONFIGS, SWEEP)
    default = {kernel: dict(cfg) for kernel, cfg in table.items()}
    ref = forward_backward("triton", x)

    def measure(row: dict, timed_fwd: bool) -> dict:
        try:
            got = forward_backward("triton", x)
            row["rel_diff"] = max(((g.float() - r.float()).norm() / r.float().norm()).item()
                                  for g, r in zip(got, ref))
            if timed_fwd:
                row["ms_fwd"] = do_bench(
                    lambda: attention("triton", x, x["query"], x["latent_kv"]), warmup=25,
                    rep=100, return_mode="median")
            row["ms_fwd_bwd"] = do_bench(lambda: forward_backward("triton", x), warmup=25,
                                         rep=100, return_mode="median")
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        print(row, flush=True)
        return row

    rows = []
    for kernel, alternatives in variants.items():
        if kernels and kernel not in kernels:
            continue
        for variant in [{}, *alternatives]:
            table[kernel] = {**default[kernel], **variant}
            rows.append(measure(dict(kernel=kernel, **table[kernel]),
                                kernel in ("fwd", "softmax")))
        table[kernel] = default[kernel]
    if not kernels or "buffer" in kernels:
        module, name, sizes = ((dense, "DS_BUFFER_BYTES", DENSE_BUFFER_SWEEP) if dense_layout
                               else (smla, "PARTIAL_BUFFER_BYTES", BUFFER_SWEEP))
        budget = getattr(module, name)
        for size in [budget, *sizes]:
            setattr(module, name, size)
            row = measure({"kernel": "buffer", name: size}, False)
            row["peak_gib"] = bench(lambda: forward_backward("triton", x))[1]
            rows.append(row)
        setattr(module, name, budget)
    if dense_layout and (not kernels or "chunks" in kernels):
        chunks = dense.QUERY_CHUNKS
        for count in [chunks, *CHUNK_SWEEP]:
            dense.QUERY_CHUNKS = count
            rows.append(measure(dict(kernel="chunks", QUERY_CHUNKS=count), True))
        dense.QUERY_CHUNKS = chunks
    return rows


def kernel_breakdown(s: int, n: int, d: int, v: int, width: int) -> dict[str, float]:
    """CUDA ms per kernel name over one Triton forward+backward (after a warm-up)."""
    x = inputs(s, n, d, v, width, thd=False, seed=2)
    forward_backward("triton", x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward_backward("triton", x)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = event.cuda_time_total
        if device_us > 0:
            times[event.key[:60]] = device_us / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:12])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--no-torch", action="store_true", help="time only the Triton path")
    parser.add_argument("--layout", choices=get_args(smla.Layout), default="auto",
                        help="the Triton kernels every run uses (default auto: by shape)")
    parser.add_argument("--sweep", action="store_true", help="also sweep block sizes")
    parser.add_argument("--sweep-only", action="store_true",
                        help="only the sweep (no checks, timing or kernel breakdown)")
    parser.add_argument("--sweep-kernels", nargs="+", metavar="TABLE",
                        choices=sorted({*SWEEP, *DENSE_SWEEP, "buffer", "chunks"}),
                        help="sweep only these rows: kernel names of the sweep tables, 'buffer' "
                             "(the layout's backward buffer budgets), 'chunks' (dense query "
                             "chunks)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    LAYOUT[0] = args.layout
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, layout=args.layout,
                  checks=[], timing=[], kernels_ms={})
    if not args.sweep_only:
        report["checks"] = [check("glm5", 2048, 64, 576, 512, 2048, False),
                            check("glm5_thd", 2048, 64, 576, 512, 2048, True),
                            check("nope", 2048, 64, 512, 512, 2048, False)]
        for row in report["checks"]:
            print(row)
        paths = ["triton"] if args.no_torch else ["triton", "torch"]
        report["timing"] = [row for s in args.sizes
                            for row in timing(s, args.heads, 576, 512, args.width, paths)]
        report["kernels_ms"] = kernel_breakdown(args.sizes[0], args.heads, 576, 512, args.width)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.sweep or args.sweep_only:
        dense_layout = args.layout == "dense" or (args.layout == "auto" and dense.dense_pays(
            args.sizes[0], args.width, args.heads))
        report["sweep_layout"] = "dense" if dense_layout else "gather"
        report["sweep"] = sweep(args.sizes[0], args.heads, 576, 512, args.width, dense_layout,
                                args.sweep_kernels)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nsweep of the {report['sweep_layout']} kernels (s={args.sizes[0]}; first row per "
              "kernel = default)")
        for r in report["sweep"]:
            cfg = " ".join(f"{k}={val}" for k, val in r.items()
                           if k not in ("rel_diff", "ms_fwd", "ms_fwd_bwd", "error", "peak_gib"))
            if "error" in r:
                print(f"{cfg:<60}  {r['error'][:80]}")
            else:
                print(f"{cfg:<60}  fwd {r.get('ms_fwd', float('nan')):7.2f} ms  fwd+bwd "
                      f"{r['ms_fwd_bwd']:7.2f} ms  rel diff {r['rel_diff']:.1e}"
                      + (f"  peak {r['peak_gib']:.2f} GiB" if "peak_gib" in r else ""))
    print(f"\nkernels (s={args.sizes[0]}, ms): {report['kernels_ms']}")
    print("\ncheck       ok    det   err out / dq / dkv (torch bf16 path)")
    for r in report["checks"]:
        print(f"{r['case']:<10} {r['ok']!s:<5} {r['deterministic']!s:<5} "
              + " / ".join(f"{r['err_' + t]:.2e} ({r['torch_bf16_err_' + t]:.2e})"
                           for t in ("out", "dq", "dkv")))
    print("\npath    stage          s       ms   TFLOP/s  peak GiB")
    for r in report["timing"]:
        if r.get("oom"):
            print(f"{r['path']:<7} {r['stage']:<9} {r['s']:>6}  OOM")
        else:
            print(f"{r['path']:<7} {r['stage']:<9} {r['s']:>6} {r['ms']:8.2f} {r['tflops']:9.1f} "
                  f"{r['peak_gib']:9.2f}")


if __name__ == "__main__":
    main()
