"""Which blockwise scaling combinations ``torch.nn.functional.scaled_mm`` runs on this GPU, and how
fast, against a bf16 matmul of the same shape: the combinations an FP8 backward would need
(forward and dgrad: 1x128 activations x 128x128 weights; wgrad: 1x128 x 1x128, both operands
quantized along the token dimension), today's profiles run only the first one (their backward is
bf16, docs/precision.md).

For each ``M x K x N`` (glm5_proxy's 4096 x 2048 x 2048 and GLM-5's 4096 x 6144 x 6144 by default)
it tries each combination with several scale layouts and reports the first that runs
(``triton.testing.do_bench`` median, ms and TFLOP/s) or the error. The operands are random e4m3
values with unit scales: only the speed is measured. Needs CUDA (sm_90).

    python scripts/bench/fp8_scaled_mm_recipes.py [--shapes 4096x2048x2048 4096x6144x6144]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F


def _c4(n: int) -> int:
    return -(-n // 4) * 4


def scale_layouts(rows: int, k: int, recipe: "F.ScalingType") -> dict[str, torch.Tensor]:
    """Candidate unit-scale tensors for an operand of ``rows`` rows (M, or N of the column-major B)
    and contraction ``k``."""
    if recipe == F.ScalingType.BlockWise1x128:
        return {"[rows, k/128] column-major": torch.ones(k // 128, rows, device="cuda").t(),
                "[rows, k/128] row-major": torch.ones(rows, k // 128, device="cuda"),
                "[k/128, rows] row-major": torch.ones(k // 128, rows, device="cuda")}
    return {"[ceil4(k/128), rows/128] column-major": torch.ones(rows // 128, _c4(k // 128), device="cuda").t(),
            "[rows/128, ceil4(k/128)] row-major": torch.ones(rows // 128, _c4(k // 128), device="cuda"),
            "[rows/128, k/128] row-major": torch.ones(rows // 128, k // 128, device="cuda")}


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["4096x2048x2048", "4096x6144x6144"])
    args = parser.parse_args()
    kinds = F.ScalingType
    combos = [(kinds.BlockWise1x128, kinds.BlockWise128x128), (kinds.BlockWise128x128, kinds.BlockWise1x128),
              (kinds.BlockWise1x128, kinds.BlockWise1x128)]
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major [K, N]
        a16, b16 = a.bfloat16(), b.bfloat16()
        flops = 2 * m * n * k
        ms = triton.testing.do_bench(lambda: a16 @ b16, return_mode="median")
        print(f"M {m} K {k} N {n}: bf16 {ms:.4f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        for recipe_a, recipe_b in combos:
            errors = []
            for (name_a, sa), (name_b, sb) in itertools.product(scale_layouts(m, k, recipe_a).items(),
                                                                scale_layouts(n, k, recipe_b).items()):
                def gemm() -> torch.Tensor:
                    return F.scaled_mm(a, b, sa, recipe_a, sb, recipe_b, output_dtype=torch.bfloat16)
                try:
                    gemm()
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - an unsupported layout: try the next
                    errors.append(str(error).splitlines()[0][:160])
                    continue
                ms = triton.testing.do_bench(gemm, return_mode="median")
                print(f"   {recipe_a.name} x {recipe_b.name} (A {name_a}, B {name_b}): {ms:.4f} ms "
                      f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
                break
            else:
                print(f"   {recipe_a.name} x {recipe_b.name}: not run: {errors[0]}", flush=True)


if __name__ == "__main__":
    main()
