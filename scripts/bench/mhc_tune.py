"""Sweep the launch shapes of the mHC kernels on one GPU and print the fastest of each.

The kernels' block sizes and warps are module constants (``mhc_pre_triton.TILES``,
``mhc_mix_triton.BLOCK_T``/``BLOCK_H``/``WARPS`` and their ``BACKWARD_`` twins,
``mhc_gates_triton.BLOCK_ENTRIES``/``WARPS`` and their ``BACKWARD_`` twins). For each launch this
script varies that one launch's shape, keeps the others at the modules' values, and times the
kernel family's forward + backward at every stream width given (GLM-5.3's 4096 and glm5_3_proxy's
2048 by default; ``--tokens`` tokens of 4 streams, bf16, 20 Sinkhorn iterations) with
``triton.testing.do_bench`` (median ms); a shape is ranked by its summed time over the widths. The
first entry of each launch is the modules' current value, so ``speedup`` is current over best.

    python scripts/bench/mhc_tune.py --out runs/mhc_tune.json        # one GPU, a few minutes

What the results are used for: the constants in the three modules. A shape changes the order of
the norm projection's, the stream mixing's and the gates' parameter-gradient FP32 sums (within the
tests' bounds), never the gates' per-token results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch


def _pre_steps(widths: list[int], tokens: int) -> list[Callable[[], None]]:
    from kpool_layers.kernels import mhc_pre_triton as pre

    steps = []
    for h in widths:
        n = 4
        x = torch.randn(tokens, n, h, device="cuda").bfloat16().requires_grad_()
        fn = (0.02 * torch.randn((2 + n) * n, n * h, device="cuda")).requires_grad_()
        dz = torch.randn(tokens, (2 + n) * n, device="cuda")

        def step(x: torch.Tensor = x, fn: torch.Tensor = fn, dz: torch.Tensor = dz) -> None:
            pre.norm_project(x, fn, 1e-6).backward(dz)
        steps.append(step)
    return steps


def _mix_steps(widths: list[int], tokens: int) -> list[Callable[[], None]]:
    from kpool_layers.kernels import mhc_mix_triton as mix

    steps = []
    for h in widths:
        n = 4
        post = torch.rand(tokens, n, device="cuda").requires_grad_()
        comb = torch.rand(tokens, n, n, device="cuda").requires_grad_()
        bo = torch.randn(tokens, h, device="cuda").bfloat16().requires_grad_()
        s = torch.randn(tokens, n, h, device="cuda").bfloat16().requires_grad_()
        g = torch.randn(tokens, n, h, device="cuda").bfloat16()

        def step(ops: tuple = (post, comb, bo, s), g: torch.Tensor = g) -> None:
            mix.mix_streams(*ops).backward(g)
        steps.append(step)
    return steps


def _gates_steps(widths: list[int], tokens: int) -> list[Callable[[], None]]:
    from kpool_layers.kernels import mhc_gates_triton as gates

    z = torch.randn(tokens, 24, device="cuda").requires_grad_()
    base = torch.randn(24, device="cuda").bfloat16().requires_grad_()
    scale = torch.ones(3, device="cuda").bfloat16().requires_grad_()
    grads = [torch.randn(tokens, *dims, device="cuda") for dims in ((4,), (4,), (4, 4))]

    def step() -> None:
        torch.autograd.backward(gates.gates(z, base, scale, 4, 20, 1e-6), grads)
    return [step]


def _tiles_shapes(name: str) -> Iterator[dict[str, int]]:
    if name == "proj_forward":
        grid = itertools.product((16, 32, 64), (64, 128), (512, 1024, 2048, 0), (4, 8))
    elif name == "proj_backward_x":
        grid = ((bt, bk, 0, w) for bt, bk, w in itertools.product((16, 32, 64), (32, 64, 128, 256), (4, 8)))
    else:
        grid = itertools.product((16, 32, 64), (32, 64, 128), (256, 512, 1024, 0), (4,))
    for bt, bk, chunk, w in grid:
        yield {"block_t": bt, "block_k": bk, "chunk": chunk, "warps": w}


def _launches() -> Iterator[tuple[str, Any, list[str], Iterator[dict[str, int]], Callable]]:
    """(launch, module, its constants or TILES key, candidate shapes, steps builder)."""
    from kpool_layers.kernels import mhc_mix_triton as mix
    from kpool_layers.kernels import mhc_pre_triton as pre
    from kpool_layers.kernels import mhc_gates_triton as gates

    for key in pre.TILES:
        yield key, pre, [key], _tiles_shapes(key), _pre_steps
    mix_grid = [(bt, bh, w) for bt, bh, w in itertools.product((1, 2, 4, 8), (128, 256, 512), (2, 4, 8))
                if bt * bh <= 2048]
    yield ("mix_forward", mix, ["BLOCK_T", "BLOCK_H", "WARPS"],
           (dict(zip(("BLOCK_T", "BLOCK_H", "WARPS"), c)) for c in mix_grid), _mix_steps)
    yield ("mix_backward", mix, ["BACKWARD_BLOCK_T", "BACKWARD_BLOCK_H", "BACKWARD_WARPS"],
           (dict(zip(("BACKWARD_BLOCK_T", "BACKWARD_BLOCK_H", "BACKWARD_WARPS"), c)) for c in mix_grid), _mix_steps)
    gates_grid = list(itertools.product((16, 64, 128, 256, 512, 1024), (1, 2, 4)))
    yield ("gates_forward", gates, ["BLOCK_ENTRIES", "WARPS"],
           (dict(zip(("BLOCK_ENTRIES", "WARPS"), c)) for c in gates_grid), _gates_steps)
    yield ("gates_backward", gates, ["BACKWARD_BLOCK_ENTRIES", "BACKWARD_WARPS"],
           (dict(zip(("BACKWARD_BLOCK_ENTRIES", "BACKWARD_WARPS"), c)) for c in gates_grid), _gates_steps)


def _current(module: Any, keys: list[str]) -> dict[str, int]:
    if keys[0] in getattr(module, "TILES", {}):
        return dict(vars(module.TILES[keys[0]]))
    return {k: getattr(module, k) for k in keys}


def _apply(module: Any, keys: list[str], shape: dict[str, int]) -> None:
    if keys[0] in getattr(module, "TILES", {}):
        module.TILES[keys[0]] = replace(module.TILES[keys[0]], **shape)
    else:
        for k, v in shape.items():
            setattr(module, k, v)


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 2048])
    parser.add_argument("--budget-s", type=float, default=90.0, help="seconds per launch before its sweep stops")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mhc_tune.py needs a CUDA GPU")
    results: dict[str, Any] = {"tokens": args.tokens, "widths": args.widths, "device": torch.cuda.get_device_name(),
                               "launches": {}}
    for name, module, keys, shapes, builder in _launches():
        steps = builder(args.widths, args.tokens)
        current = _current(module, keys)
        rows, t0 = [], time.monotonic()
        for shape in itertools.chain([current], (s for s in shapes if s != current)):
            if time.monotonic() - t0 > args.budget_s:
                break
            _apply(module, keys, shape)
            try:
                ms = [triton.testing.do_bench(step, warmup=5, rep=20) for step in steps]
            except Exception as exc:  # noqa: BLE001 - a shape the compiler or the GPU refuses is skipped
                rows.append({"shape": shape, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            rows.append({"shape": shape, "ms": ms, "total_ms": sum(ms)})
        _apply(module, keys, current)
        timed = [r for r in rows if "total_ms" in r]
        best = min(timed, key=lambda r: r["total_ms"])
        results["launches"][name] = {"current": rows[0], "best": best, "tried": len(rows),
                                     "speedup": rows[0].get("total_ms", float("nan")) / best["total_ms"], "rows": rows}
        print(f"{name}: current {rows[0].get('total_ms', float('nan')):.3f} ms {current} -> best "
              f"{best['total_ms']:.3f} ms {best['shape']} ({len(rows)} tried)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
