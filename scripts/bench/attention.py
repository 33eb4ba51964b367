"""Benchmark DSA's two kernels per ``model.dsa_kernels`` backend, side by side in one run.

Per sequence length (batch 1, bf16 on GPU) and per backend, with the model's shapes:

    topk     indexer scores + top-k of given index queries / keys / weights (no projections)
    fwd      sparse MLA forward over given top-k indices
    fwdbwd   sparse MLA forward + backward (gradients of queries and latent keys)

time (median of ``--repeats`` after one warm-up), extra peak GPU memory (peak minus what was
allocated before the stage) and useful TFLOP/s: the sparse forward counts ``2 * s * topk * heads *
(d_k + v)`` FLOPs (top-k keys per query, not s), forward + backward three times that; ``floor`` is
that count at ``--peak-tflops`` (756, the H200's measured bf16 matmul rate). Every backend's
forward output and gradients are compared with the torch path's (``rel_err`` = ||x - torch|| /
||torch|| over out, dq, dkv, the largest) and its top-k with torch's (``topk_overlap``).

Backends: ``torch`` (chunked PyTorch), ``tilelang`` (megatron-core's TileLang SparseMLA and indexer
logits kernel; needs ``tilelang``), ``triton`` (ours, the layout ``sparse_mla_triton`` picks for the
shape; ``triton_gather`` / ``triton_dense`` force its gather / contiguous-block kernels), ``megatron`` (megatron-core's naive
``fused_qk_topk_naive`` / ``_unfused_absorbed_dsa_fn``: dense [n, s, s] scores; plain DSA only).
A backend that cannot run here is reported with its reason. Shapes (``--shape``):

    glm5        64 heads, latent 512 + rope 64, indexer 32 x 128, top-2048 (GLM-5 / 5.1 / 5.2)
    glm5_kpool  64 heads, NoPE latent 512, indexer 32 x 128, kpool 4 + tail, top-2048 (GLM-5.3-Flash)
    glm5_proxy  16 heads, latent 512 + rope 64, indexer 32 x 128, top-2048 (model=glm5_proxy)

    python scripts/bench/attention.py --out runs/attention.json                           # H200
    python scripts/bench/attention.py --shape glm5_kpool --out runs/kpool.json
    python scripts/bench/attention.py --small --out /tmp/attention.json                   # CPU

With ``--kernels N`` each backend's forward + backward also runs once under ``torch.profiler``, and
its ``N`` ops with the most self time (GPU time on a GPU, host time on the CPU) land under
``kernels`` (name, calls, ms), largest first: where a layout's time goes, kernel by kernel.

    python scripts/bench/attention.py --seq 32768 --backends triton_gather --kernels 12 --out runs/k.json

``scripts/bench/record_result.py`` adds an ``--out`` file to ``docs/results/attention_h200.json``
or ``kpool_h200.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from kpool_layers.compat import cpu as _cpu
from timing import init_single_rank, measure

BACKENDS = ("torch", "tilelang", "triton", "triton_gather", "triton_dense", "megatron")


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_lora: int
    rope: int
    index_heads: int
    index_dim: int
    topk: int
    kpool: int
    tail: bool
    chunk: int

    @property
    def d_k(self) -> int:
        return self.kv_lora + self.rope


SHAPES = {
    "glm5": Shape(heads=64, kv_lora=512, rope=64, index_heads=32, index_dim=128, topk=2048,
                  kpool=1, tail=False, chunk=1024),
    "glm5_kpool": Shape(heads=64, kv_lora=512, rope=0, index_heads=32, index_dim=128, topk=2048,
                        kpool=4, tail=True, chunk=1024),
    "glm5_proxy": Shape(heads=16, kv_lora=512, rope=64, index_heads=32, index_dim=128, topk=2048,
                        kpool=1, tail=False, chunk=1024),
}
SMALL = Shape(heads=4, kv_lora=32, rope=16, index_heads=4, index_dim=16, topk=32, kpool=1,
              tail=False, chunk=64)


def _sparse_fn(backend: str, shape: Shape) -> Callable[..., torch.Tensor]:
    """``(query [s,1,n,d], kv [s,1,1,d], indices [1,s,W], scale) -> [s,1,n,v]`` of ``backend``."""
    if backend == "torch":
        from kpool_layers.dsa.sparse_attention import sparse_mla_attention

        return lambda q, kv, idx, scale: sparse_mla_attention(
            q, kv, idx, scale, v_channels=shape.kv_lora, chunk_size=shape.chunk)
    if backend == "tilelang":
        from kpool_layers.kernels.tilelang_dsa import megatron_sparse_mla, sparse_mla_tilelang

        kernel = megatron_sparse_mla()
        return lambda q, kv, idx, scale: sparse_mla_tilelang(
            q, kv, idx, scale, v_channels=shape.kv_lora, key_start=None, kernel=kernel)
    if backend.startswith("triton"):
        from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

        layout = backend.removeprefix("triton").removeprefix("_") or "auto"
        return lambda q, kv, idx, scale: sparse_mla_triton(q, kv, idx, scale,
                                                           v_channels=shape.kv_lora, layout=layout)
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        _unfused_absorbed_dsa_fn,
    )

    def naive(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
        s = q.shape[0]
        mask = torch.triu(torch.full((s, s), float("-inf"), device=q.device), diagonal=1)
        return _unfused_absorbed_dsa_fn(q, kv, idx, scale, shape.kv_lora, mask=mask)

    return naive


def _topk_fn(backend: str, shape: Shape) -> Callable[..., torch.Tensor]:
    """``(q [t,h,d], keys [n,d], weights [t,h], lo, hi, topk) -> [t, topk]`` of ``backend``."""
    if backend == "megatron":
        from megatron.core.transformer.experimental_attention_variant.dsa import fused_qk_topk_naive

        if shape.kpool != 1:
            raise RuntimeError("megatron's naive indexer has no KPool")

        def naive(q, keys, weights, lo, hi, topk):  # noqa: ANN001, ANN202
            s = q.shape[0]
            mask = torch.triu(torch.full((s, s), float("-inf"), device=q.device), diagonal=1)
            return fused_qk_topk_naive(q[:, None], keys[:, None], weights[:, None], topk,
                                       mask=mask, use_relu=True)[1][0]

        return naive
    from kpool_layers.dsa.backends import range_topk_kernel

    kernel = range_topk_kernel(backend.split("_")[0], shape.chunk if backend == "torch" else 4096)
    return lambda q, keys, weights, lo, hi, topk: kernel(q, keys, weights, lo, hi, topk=topk,
                                                         relu=True)


def _causal_indices(s: int, width: int, device: torch.device, seed: int) -> torch.Tensor:
    """[1, s, width]: ``width`` distinct random causal keys per query (all of them while fewer
    exist), -1 padded; made 1024 queries at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.full((1, s, width), -1, dtype=torch.long, device=device)
    keys = torch.arange(s, device=device)
    for r0 in range(0, s, 1024):
        rows = torch.arange(r0, min(r0 + 1024, s), device=device)
        score = torch.rand(rows.numel(), s, device=device, generator=g)
        score = score.masked_fill(keys[None] > rows[:, None], -1.0)
        val, idx = torch.topk(score, min(width, s), dim=-1)
        out[0, r0:r0 + rows.numel(), :idx.shape[1]] = torch.where(val >= 0, idx, -1)
    return out


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def top_ops(step: Callable[[], Any], n: int, cuda: bool) -> list[dict[str, Any]]:
    """The ``n`` ops with the most self time in one run of ``step`` under ``torch.profiler``
    (GPU time with ``cuda``, else host time): ``[{"name", "calls", "ms"}]``, largest first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted((e for e in prof.key_averages() if getattr(e, attr) > 0),
                    key=lambda e: -getattr(e, attr))
    return [{"name": e.key, "calls": e.count, "ms": getattr(e, attr) / 1e3} for e in events[:n]]


def bench_length(shape: Shape, s: int, backends: list[str], repeats: int, device: torch.device,
                 dtype: torch.dtype, peak_tflops: float, kernels: int = 0) -> dict[str, Any]:
    """One sequence length: per backend its stages' times, peaks, useful TFLOP/s and agreement with
    the torch path, and with ``kernels`` its forward + backward's top ops (:func:`top_ops`)."""
    from kpool_layers.dsa.kpool import pool_layout

    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(s)
    scale = shape.d_k ** -0.5
    query = torch.randn(s, 1, shape.heads, shape.d_k, device=device, dtype=dtype,
                        generator=g).requires_grad_()
    kv = torch.randn(s, 1, 1, shape.d_k, device=device, dtype=dtype, generator=g).requires_grad_()
    grad = torch.randn(s, 1, shape.heads, shape.kv_lora, device=device, dtype=dtype, generator=g)
    indices = _causal_indices(s, shape.topk, device, seed=s)
    layout = pool_layout(s, shape.kpool, device=device)
    iq = torch.randn(s, shape.index_heads, shape.index_dim, device=device, dtype=dtype, generator=g)
    ik = torch.randn(layout.n_pools, shape.index_dim, device=device, dtype=dtype, generator=g)
    iw = torch.randn(s, shape.index_heads, device=device, dtype=torch.float32, generator=g)
    n_sel = shape.topk // shape.kpool
    fwd_flops = 2 * s * shape.topk * shape.heads * (shape.d_k + shape.kv_lora)
    row: dict[str, Any] = {"s": s, "floor": {"fwd_ms": 1e3 * fwd_flops / (peak_tflops * 1e12),
                                             "fwdbwd_ms": 3e3 * fwd_flops / (peak_tflops * 1e12)}}
    reference: dict[str, torch.Tensor] = {}
    for backend in backends:
        res: dict[str, Any] = {}
        row[backend] = res
        try:
            sparse = _sparse_fn(backend, shape)
            topk = _topk_fn(backend, shape)
        except (ImportError, RuntimeError) as err:
            res["error"] = f"{type(err).__name__}: {err}"
            continue

        def fwd() -> torch.Tensor:
            with torch.no_grad():
                return sparse(query, kv, indices, scale)

        def fwdbwd() -> None:
            out = sparse(query, kv, indices, scale)
            torch.autograd.backward(out, grad)
            query.grad = kv.grad = None

        def select() -> torch.Tensor:
            return topk(iq, ik, iw, layout.query_lo, layout.query_hi, n_sel)

        for stage, step in (("topk", select), ("fwd", fwd), ("fwdbwd", fwdbwd)):
            try:
                m = measure(step, repeats, cuda)
            except Exception as err:  # noqa: BLE001 - a failing backend is reported, not fatal
                m = {"ms": None, "peak_mib": None, "oom": False,
                     "error": f"{type(err).__name__}: {str(err)[:300]}"}
            res[f"{stage}_ms"], res[f"{stage}_peak_mib"] = m["ms"], m["peak_mib"]
            if m.get("oom") or m.get("error"):
                res[f"{stage}_error"] = "OOM" if m.get("oom") else m["error"]
        res["peak_mib"] = res.get("fwdbwd_peak_mib")  # forward + backward, the stage's peak
        if res.get("fwd_ms"):
            res["fwd_tflops"] = fwd_flops / res["fwd_ms"] / 1e9
        if res.get("fwdbwd_ms"):
            res["fwdbwd_tflops"] = 3 * fwd_flops / res["fwdbwd_ms"] / 1e9
        if kernels and res.get("fwdbwd_ms"):
            res["kernels"] = top_ops(fwdbwd, kernels, cuda)
        try:
            _compare(backend, sparse, topk, (query, kv, indices, scale, grad),
                     (iq, ik, iw, layout, n_sel), reference, res)
        except Exception as err:  # noqa: BLE001 - OOM and kernel errors are reported
            res["compare_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"s={s} {backend}: " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()
            if k != "kernels"), flush=True)
        for op in res.get("kernels", []):
            print(f"    {op['ms']:10.3f} ms {op['calls']:6d} x  {op['name'][:110]}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return row


def _compare(backend: str, sparse: Callable[..., torch.Tensor], topk: Callable[..., torch.Tensor],
             attn_in: tuple, topk_in: tuple, reference: dict[str, torch.Tensor],
             res: dict[str, Any]) -> None:
    """Outputs and gradients against the first backend run (torch), and two runs bit for bit."""
    query, kv, indices, scale, grad = attn_in
    iq, ik, iw, layout, n_sel = topk_in
    runs = []
    for _ in range(2):
        out = sparse(query, kv, indices, scale)
        dq, dkv = torch.autograd.grad(out, (query, kv), grad)
        runs.append((out.detach(), dq, dkv))
    res["bitwise_deterministic"] = all(torch.equal(a, b) for a, b in zip(*runs))
    chosen = topk(iq, ik, iw, layout.query_lo, layout.query_hi, n_sel)
    if not reference:
        reference.update(out=runs[0][0], dq=runs[0][1], dkv=runs[0][2], topk=chosen)
        return
    res["rel_err"] = max(_rel_err(x, reference[k]) for k, x in zip(("out", "dq", "dkv"), runs[0]))
    ref = reference["topk"]
    same = [len((set(a.tolist()) & set(b.tolist())) - {-1}) / max(1, (b >= 0).sum().item())
            for a, b in zip(chosen[::97], ref[::97])]
    res["topk_overlap"] = sum(same) / len(same)


def print_table(rows: list[dict[str, Any]], backends: list[str]) -> None:
    print(f"{'s':>6} {'backend':>13} | {'topk ms':>8} | {'fwd ms':>8} {'TF/s':>6} | "
          f"{'fwdbwd ms':>9} {'TF/s':>6} {'MiB':>7} | {'rel_err':>8} det")
    for row in rows:
        fl = row["floor"]
        print(f"{row['s']:>6} {'floor':>13} | {'':>8} | {fl['fwd_ms']:>8.2f} {'':>6} | "
              f"{fl['fwdbwd_ms']:>9.2f}")
        for b in backends:
            r = row[b]
            if "error" in r:
                print(f"{row['s']:>6} {b:>13} | {r['error'][:90]}")
                continue

            def f(key: str, fmt: str) -> str:
                v = r.get(key)
                return format(v, fmt) if v is not None else "-"

            print(f"{row['s']:>6} {b:>13} | {f('topk_ms', '8.2f'):>8} | {f('fwd_ms', '8.2f'):>8} "
                  f"{f('fwd_tflops', '6.0f'):>6} | {f('fwdbwd_ms', '9.2f'):>9} "
                  f"{f('fwdbwd_tflops', '6.0f'):>6} {f('fwdbwd_peak_mib', '7.0f'):>7} | "
                  f"{f('rel_err', '8.1e'):>8} {r.get('bitwise_deterministic', '-')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="glm5")
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--seq", type=int, nargs="+",
                        help="sequence lengths (default 4096 8192 16384 32768; small: 64 128)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=756.0)
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also profile one forward + backward per backend: its N ops with the "
                             "most self time (default 0: off)")
    args = parser.parse_args()
    if args.kernels < 0:
        parser.error(f"--kernels must be >= 0, got {args.kernels}")

    _cpu.install()
    init_single_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMALL if args.small else SHAPES[args.shape]
    seqs = args.seq or ([64, 128] if args.small else [4096, 8192, 16384, 32768])
    backends = ["torch"] + [b for b in args.backends if b != "torch"]  # torch is the reference
    rows = [bench_length(shape, s, backends, args.repeats, device, dtype, args.peak_tflops,
                         args.kernels) for s in seqs]
    print_table(rows, backends)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
              "shape": "small" if args.small else args.shape, "shape_dims": asdict(shape),
              "peak_tflops": args.peak_tflops, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
