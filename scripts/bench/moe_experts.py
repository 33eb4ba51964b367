"""Benchmark routed experts (megatron ``SequentialMLP`` vs ``kpool_layers.grouped_experts``) and
FP8 operand quantization (reference ``kpool_layers.fp8.quantize`` vs the fused Triton kernel).

Experts, glm5_proxy's expert shape: 16 experts, hidden 2048, SwiGLU ffn 1024, 32,768 routed tokens
(the dispatcher's output ``x [T, H]`` sorted by expert, ``tokens_per_expert`` on the host as
megatron's allgather dispatcher gives it), bf16; forward + backward (grads of ``x``, the router
probabilities and every weight). Two routings: ``balanced`` (2,048 tokens each) and ``skewed``
(geometric counts, the last expert empty). ``max_rel_diff`` compares the two outputs.

Quantization: one ``[8192, 2048]`` bf16 operand per recipe (blockwise 1x128 activation and 128x128
weight, rowwise, tensorwise), ue8m0 scales; ``bytes_equal`` checks the fused kernel against the
reference. Times are ``triton.testing.do_bench`` medians (ms). Needs CUDA (torch >= 2.10 with
``grouped_mm``, triton >= 3.6). Prints a table and writes JSON to ``--out``.

    python scripts/bench/moe_experts.py --out runs/bench_moe_experts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kpool_layers import fp8  # noqa: E402
from kpool_layers.grouped_experts import GroupedExperts  # noqa: E402

EXPERTS, HIDDEN, FFN, TOKENS, TOPK = 16, 2048, 1024, 32768, 4
QUANT_SHAPE = (8192, 2048)


def do_bench(fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn`` (triton's ``do_bench``: warm-up, L2 flush between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))


def routings() -> dict[str, torch.Tensor]:
    """Tokens per expert (int64, host) summing to ``TOKENS``."""
    balanced = torch.full((EXPERTS,), TOKENS // EXPERTS, dtype=torch.long)
    weights = 0.8 ** torch.arange(EXPERTS - 1, dtype=torch.float64)
    skewed = torch.floor(weights / weights.sum() * TOKENS).long()
    skewed[0] += TOKENS - int(skewed.sum())
    return {"balanced": balanced, "skewed": torch.cat([skewed, torch.zeros(1, dtype=torch.long)])}


def build_experts() -> tuple[torch.nn.Module, GroupedExperts]:
    """megatron's ``SequentialMLP`` and our ``GroupedExperts`` (bf16, CUDA) with the same weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=16, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, bf16=True, params_dtype=torch.bfloat16,
    )
    pgs = get_default_pg_collection()
    sequential = SequentialMLP(EXPERTS, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear), pg_collection=pgs)
    grouped = GroupedExperts(EXPERTS, cfg, pg_collection=pgs)
    grouped.load_state_dict(sequential.state_dict())
    return sequential, grouped


def bench_experts() -> list[dict[str, Any]]:
    sequential, grouped = build_experts()
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(TOKENS, device="cuda", requires_grad=True)
    grad = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    for routing, counts in routings().items():
        outputs = {}
        for name, module in (("sequential", sequential), ("grouped", grouped)):
            def step(module: torch.nn.Module = module) -> None:
                module(x, counts, probs)[0].backward(grad)

            params = list(module.parameters())
            ms = do_bench(step, grad_to_none=[x, probs, *params])
            with torch.no_grad():
                outputs[name] = module(x, counts, probs)[0].float()
            rows.append({"part": "experts", "case": routing, "path": name, "ms": ms})
        diff = float((outputs["grouped"] - outputs["sequential"]).abs().max() / outputs["sequential"].abs().max())
        for row in rows[-2:]:
            row["max_rel_diff"] = diff
    return rows


def bench_quantization() -> list[dict[str, Any]]:
    from kpool_layers.kernels import fp8_quant_triton

    torch.manual_seed(0)
    x = torch.randn(*QUANT_SHAPE, device="cuda", dtype=torch.bfloat16)
    rows = []
    for recipe in fp8.RECIPES:
        for operand in ("activation", "weight") if recipe == "blockwise" else ("activation",):
            ref_q, ref_s = fp8.quantize(x, recipe, operand)
            q, s = fp8_quant_triton.quantize(x, recipe, operand)
            equal = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            case = f"{recipe} {operand}"
            for name, fn in (("unfused", fp8.quantize), ("fused", fp8_quant_triton.quantize)):
                ms = do_bench(lambda fn=fn: fn(x, recipe, operand))
                rows.append({"part": "fp8_quant", "case": case, "path": name, "ms": ms, "bytes_equal": equal})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table with the speed-up of the second path of each case over the first."""
    lines = ["| part | case | path | ms | speed-up | check |", "|---|---|---|---|---|---|"]
    first: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["part"], r["case"])
        speedup = f"{first[key] / r['ms']:.2f}x" if key in first else ""
        first.setdefault(key, r["ms"])
        check = (f"rel diff {r['max_rel_diff']:.1e}" if "max_rel_diff" in r
                 else f"bytes equal: {r['bytes_equal']}")
        lines.append(f"| {r['part']} | {r['case']} | {r['path']} | {r['ms']:.3f} | {speedup} | {check} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--port", type=int, default=29517, help="MASTER_PORT of the one-rank group")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_experts.py needs a CUDA GPU (grouped_mm, Triton)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import init_single_rank

    init_single_rank(args.port)
    rows = bench_experts() + bench_quantization()
    print(table(rows))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "shape": {
                  "experts": EXPERTS, "hidden": HIDDEN, "ffn": FFN, "tokens": TOKENS,
                  "quant_operand": list(QUANT_SHAPE)}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
