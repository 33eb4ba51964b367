"""Benchmark the mHC hyper-connection of one block: the gates (pre, post and the mixing matrix by
row softmax + Sinkhorn) alone, the stream mixing alone, the stream norm + projection alone, the
pre-weighted sum alone, and the whole ``HyperConnection`` with the stream mixing, forward +
backward, with the ``mhc_gates``, ``mhc_stream_mix``, ``mhc_norm_proj`` and ``mhc_pre_sum`` routes
on their Triton kernels and on the torch ops, side by side in one run.

Per token count (GLM-5.3's blocks: hidden 4096, 4 streams, 20 Sinkhorn iterations; bf16 streams
and weights on the GPU, the mixing in FP32 as the model computes it):

    gates_<backend>   the gates of ``tokens`` FP32 projections ``[tokens, 24]`` (``mhc_gates``)
    mix_<backend>     ``post (x) block output + comb^T @ streams`` on ``[tokens, 4, hidden]`` streams
    proj_<backend>    ``z = rsqrt(mean(x^2) + eps) (x @ fn^T)`` of those streams (``mhc_norm_proj``)
    presum_<backend>  the block input ``sum_n pre_n streams_n`` (``mhc_pre_sum``)
    block_<backend>   ``HyperConnection`` (stream norm, projection, gates, block input) and
                      ``mix_streams`` on a stand-in block output, as a decoder layer runs
                      them, all four routes on ``<backend>``

Each entry is the median of ``--repeats`` forward + backward passes after one warm-up (the first
compiles the kernels), with the extra peak GPU memory; ``*_speedup`` is torch over triton.

    python scripts/bench/mhc.py --tokens 4096 16384 65536 --out runs/mhc.json    # H200
    python scripts/bench/mhc.py --small --out /tmp/mhc.json                      # tiny, CPU (torch)
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import torch

from timing import bench_device, measure

GLM53 = dict(hidden=4096, streams=4, iters=20)
SMALL = dict(hidden=16, streams=4, iters=20)


def gates_step(backend: str, tokens: int, shape: dict[str, Any], device: torch.device) -> Callable[[], None]:
    """One forward + backward of the gates on a random projection through ``backend``."""
    from kpool_layers.hyper_connections.mhc import GATES

    n = shape["streams"]
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(tokens, (2 + n) * n, generator=gen).to(device).requires_grad_()
    base = torch.randn((2 + n) * n, generator=gen).to(device).requires_grad_()
    scale = torch.ones(3, device=device).requires_grad_()
    grads = [torch.randn(tokens, *dims, generator=gen).to(device) for dims in ((n,), (n,), (n, n))]
    kernel = GATES.backend(backend).load()
    fn = kernel.gates if backend == "triton" else kernel

    def step() -> None:
        torch.autograd.backward(fn(z, base, scale, n, shape["iters"], 1e-6), grads)
        z.grad = base.grad = scale.grad = None
    return step


def mix_step(backend: str, tokens: int, shape: dict[str, Any], dtype: torch.dtype,
             device: torch.device) -> Callable[[], None]:
    """One forward + backward of the stream mixing on ``[tokens, N, h]`` streams through ``backend``."""
    from kpool_layers.hyper_connections.mhc import STREAM_MIX

    n, h = shape["streams"], shape["hidden"]
    gen = torch.Generator().manual_seed(2)
    post = (2 * torch.sigmoid(torch.randn(tokens, n, generator=gen))).to(device).requires_grad_()
    comb = torch.softmax(torch.randn(tokens, n, n, generator=gen), dim=-2).to(device).requires_grad_()
    block_output = torch.randn(tokens, h, generator=gen).to(device, dtype).requires_grad_()
    streams = torch.randn(tokens, n, h, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens, n, h, generator=gen).to(device, dtype)
    kernel = STREAM_MIX.backend(backend).load()
    fn = kernel.mix_streams if backend == "triton" else kernel

    def step() -> None:
        fn(post, comb, block_output, streams).backward(grad)
        post.grad = comb.grad = block_output.grad = streams.grad = None
    return step


def pre_step(what: str, backend: str, tokens: int, shape: dict[str, Any], dtype: torch.dtype,
             device: torch.device) -> Callable[[], None]:
    """One forward + backward of the stream norm + projection (``what="proj"``) or of the
    pre-weighted sum (``"presum"``) on ``[tokens, N, h]`` streams through ``backend``."""
    from kpool_layers.hyper_connections.mhc import NORM_PROJECT, PRE_SUM

    n, h = shape["streams"], shape["hidden"]
    gen = torch.Generator().manual_seed(3)
    streams = torch.randn(tokens, n, h, generator=gen).to(device, dtype).requires_grad_()
    if what == "proj":
        fn = (0.02 * torch.randn((2 + n) * n, n * h, generator=gen)).to(device, dtype).requires_grad_()
        grad = torch.randn(tokens, (2 + n) * n, generator=gen).to(device)
        kernel = NORM_PROJECT.backend(backend).load()
        op = kernel.norm_project if backend == "triton" else kernel
        leaves, call = (streams, fn), lambda: op(streams, fn, 1e-5)
    else:
        pre = torch.sigmoid(torch.randn(tokens, n, generator=gen)).to(device).requires_grad_()
        grad = torch.randn(tokens, h, generator=gen).to(device, dtype)
        kernel = PRE_SUM.backend(backend).load()
        op = kernel.pre_sum if backend == "triton" else kernel
        leaves, call = (pre, streams), lambda: op(pre, streams)

    def step() -> None:
        call().backward(grad)
        for leaf in leaves:
            leaf.grad = None
    return step


def block_step(tokens: int, shape: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """One forward + backward of ``HyperConnection`` and ``mix_streams`` on ``[tokens, 1, N, h]``
    streams (the route as pinned by the caller)."""
    from kpool_layers.config import GLMTransformerConfig
    from kpool_layers.hyper_connections.mhc import HyperConnection, mix_streams

    n, h = shape["streams"], shape["hidden"]
    config = GLMTransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, params_dtype=dtype,
                                  bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type != "cuda",
                                  hc_mult=n, hc_sinkhorn_iters=shape["iters"], hc_eps=1e-6)
    hc = HyperConnection(config).to(device)
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(tokens, 1, n, h, generator=gen).to(device, dtype).requires_grad_()
    block_output = torch.randn(tokens, 1, h, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens, 1, n, h, generator=gen).to(device, dtype)

    def step() -> None:
        post, comb, block_input = hc(streams)
        (mix_streams(post, comb, block_output * block_input, streams)).backward(grad)
        hc.zero_grad(set_to_none=True)
        streams.grad = block_output.grad = None
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    from kpool_layers.hyper_connections.mhc import GATES, NORM_PROJECT, PRE_SUM, STREAM_MIX

    routes = (GATES, STREAM_MIX, NORM_PROJECT, PRE_SUM)
    cuda, device, dtype = bench_device()
    shape = SMALL if args.small else GLM53
    backends = ["triton", "torch"] if cuda else ["torch"]
    rows = []
    for tokens in args.tokens:
        row: dict[str, Any] = {"tokens": tokens}
        for backend in backends:
            row[f"gates_{backend}"] = measure(gates_step(backend, tokens, shape, device), args.repeats, cuda)
            row[f"mix_{backend}"] = measure(mix_step(backend, tokens, shape, dtype, device), args.repeats, cuda)
            for what in ("proj", "presum"):
                row[f"{what}_{backend}"] = measure(pre_step(what, backend, tokens, shape, dtype, device),
                                                   args.repeats, cuda)
            for route in routes:
                route.pin(backend)
            try:
                row[f"block_{backend}"] = measure(block_step(tokens, shape, dtype, device), args.repeats, cuda)
            finally:
                for route in routes:
                    route.pin(None)
        for what in ("block", "gates", "mix", "proj", "presum"):
            if cuda and row[f"{what}_triton"].get("ms") and row[f"{what}_torch"].get("ms"):
                row[f"{what}_speedup"] = row[f"{what}_torch"]["ms"] / row[f"{what}_triton"]["ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype), "shape": shape,
               "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
