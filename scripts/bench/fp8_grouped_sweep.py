"""Sweep the FP8 grouped GEMM's tile configurations at a model's expert shapes, beside bf16
``grouped_mm`` on the same shapes, in one run.

The shapes come from the composed config: ``T = micro_batch_size * seq_length * moe_router_topk``
routed rows over ``num_moe_experts`` experts, ``fc1`` (``K = hidden``, ``N = 2 * moe_ffn_hidden_size``,
SwiGLU) and ``fc2`` (``K = moe_ffn_hidden_size``, ``N = hidden``); routing balanced, or skewed
(geometric counts, the last expert empty; only the current tiles and the three fastest balanced
ones). Each configuration of
:class:`kpool_layers.kernels.fp8_grouped_gemm_triton.Tiles` is timed (``triton.testing.do_bench``
median ms) on pre-quantized operands and its output compared bit for bit with the current
:data:`~kpool_layers.kernels.fp8_grouped_gemm_triton.TILES` (the K order is fixed, so every
configuration must give the same bits); ``bf16`` times ``torch.nn.functional.grouped_mm`` on the
unquantized operands. Needs CUDA. Prints a table, writes JSON to ``--out``.

    python scripts/bench/fp8_grouped_sweep.py experiment=glm5_proxy_h200 --out runs/fp8_grouped_sweep.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kpool_layers.moe.grouped_gemm import grouped_linear  # noqa: E402
from kpool_layers.kernels import fp8_grouped_gemm_triton as fgg  # noqa: E402
from kpool_layers.kernels import fp8_quant_triton  # noqa: E402
from timing import out_and_config, routings  # noqa: E402 - sibling module (run as a script)

CONFIGS = [fgg.Tiles(bm, bn, warps, stages)
           for bm, bn in ((128, 128), (128, 256), (64, 128), (64, 256), (256, 128))
           for warps in (4, 8) for stages in (3, 4)
           if (bm + bn) * 128 * stages <= 200 * 1024 and not (warps == 4 and bm * bn > 128 * 128)]
"""Candidate tiles: shared memory within Hopper's 227 KiB; 4 warps only for tiles up to 128x128."""


def sweep(rows: int, experts: int, k: int, n: int, skewed: bool, configs: list[fgg.Tiles]) -> dict[str, Any]:
    """``configs`` at one shape (module docstring)."""
    import triton.testing

    dev = torch.device("cuda")
    counts = routings(experts, rows)["skewed" if skewed else "balanced"]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    xq, xs = fp8_quant_triton.quantize(x, "blockwise", "activation")
    wq, ws = fp8_quant_triton.quantize(w.reshape(experts * n, k), "blockwise", "weight")
    wq, ws = wq.view(experts, n, k), ws.view(experts, -1, ws.shape[-1])
    ref = fgg.grouped_gemm(xq, xs, wq, ws, counts)
    out: dict[str, Any] = {"T": rows, "E": experts, "K": k, "N": n, "skewed": skewed, "current": str(fgg.TILES),
                           "bf16_ms": float(triton.testing.do_bench(lambda: grouped_linear(x, w, counts, True),
                                                                    return_mode="median")),
                           "configs": []}
    for tiles in configs:
        try:
            y = fgg.grouped_gemm(xq, xs, wq, ws, counts, tiles=tiles)
            ms = float(triton.testing.do_bench(lambda: fgg.grouped_gemm(xq, xs, wq, ws, counts, tiles=tiles),
                                               return_mode="median"))
            out["configs"].append({"tiles": dataclasses.asdict(tiles), "ms": ms, "bits_equal": bool(torch.equal(y, ref))})
        except Exception as err:  # noqa: BLE001 - a configuration the compiler refuses is reported, not fatal
            out["configs"].append({"tiles": dataclasses.asdict(tiles), "error": f"{type(err).__name__}: {err}"[:200]})
    return out


def main() -> None:
    out_path, overrides, cfg = out_and_config(__doc__)
    m = cfg.model
    rows = cfg.train.micro_batch_size * cfg.data.seq_length * m.moe_router_topk
    shapes = {"fc1": (m.hidden_size, 2 * m.moe_ffn_hidden_size), "fc2": (m.moe_ffn_hidden_size, m.hidden_size)}
    results = []
    for name, (k, n) in shapes.items():
        configs = CONFIGS
        for skewed in (False, True):  # skewed: the current tiles and the three fastest balanced ones
            r = sweep(rows, m.num_moe_experts, k, n, skewed, configs)
            configs = [fgg.TILES] + [fgg.Tiles(**c["tiles"]) for c in sorted(
                (c for c in r["configs"] if "ms" in c), key=lambda c: c["ms"])[:3] if fgg.Tiles(**c["tiles"]) != fgg.TILES]
            r["name"] = name
            results.append(r)
            flops = 2 * rows * k * n
            print(f"{name} T={rows} K={k} N={n} {'skewed' if skewed else 'balanced'}: bf16 grouped_mm "
                  f"{r['bf16_ms']:.4f} ms ({flops / r['bf16_ms'] / 1e9:.0f} TFLOP/s)")
            for c in sorted(r["configs"], key=lambda c: c.get("ms", float("inf"))):
                t = c["tiles"]
                label = f"  {t['block_m']:>3d}x{t['block_n']:<3d} w{t['num_warps']} s{t['num_stages']}"
                print(label + (f" {c['ms']:.4f} ms ({flops / c['ms'] / 1e9:.0f} TFLOP/s) bits_equal={c['bits_equal']}"
                               if "ms" in c else f" {c['error']}"))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps({"overrides": overrides, "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
