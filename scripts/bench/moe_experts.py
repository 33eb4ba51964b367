"""Benchmark routed experts (megatron ``SequentialMLP`` vs ``kpool_layers.moe.experts``, bf16
and FP8) and FP8 operand quantization / dequantization (reference ``kpool_layers.precision.fp8`` vs the fused
Triton kernels).

Experts, glm5_proxy's expert shape: 16 experts, hidden 2048, SwiGLU ffn 1024, 32,768 routed tokens
(the dispatcher's output ``x [T, H]`` sorted by expert, ``tokens_per_expert`` on the host as
megatron's allgather dispatcher gives it), bf16 activations; forward + backward (grads of ``x``, the
router probabilities and every weight). Two routings: ``balanced`` (2,048 tokens each) and
``skewed`` (geometric counts, the last expert empty). Part ``experts``: bf16 ``SequentialMLP`` vs
``GroupedExperts``. Part ``experts_fp8``, the fp8 profile's expert numerics (blockwise, ue8m0,
``torch`` backend): ``SequentialMLP`` with FP8 role linears (per expert: two fused quantizations
and one ``F.scaled_mm`` per projection) vs FP8 ``GroupedExperts`` (one quantization per operand
and one FP8 grouped GEMM per projection), with bf16 ``GroupedExperts`` beside them.
``max_rel_diff`` compares each path's output with the first path's of its case
(max |difference| / max |first|).

Dispatch (part ``dispatch``): a micro-batch's token permutation into expert-major rows and the
combine back, forward + backward (the gradient of the tokens), at glm5_proxy's MoE shape (4,096
tokens, top-4 of 16, hidden 2048) and GLM-5's (top-8 of 16 here, hidden 6144), bf16: megatron's
``permute`` / ``unpermute`` (``index_select``, ``scatter_add`` and ``index_add`` in bf16 with
atomics) vs ``kpool_layers.moe.permute`` (``expert_order``, ``permute_rows``, ``combine_rows``:
FP32 sums in a fixed order, one Triton kernel each way); ``max_rel_diff`` of the token gradient
against megatron's, ``bitwise_rerun`` whether a rerun of each path gives the same bits.

Quantization (part ``fp8_quant``): one ``[8192, 2048]`` bf16 operand per recipe (blockwise 1x128
activation and 128x128 weight, rowwise, tensorwise), ue8m0 scales; ``bytes_equal`` checks the fused
kernel against the reference. Cases ``dequantize ...``: the FP8 backward's dequantization of that
operand back to bf16 (reference ``kpool_layers.precision.fp8.dequantize`` vs the fused
``kpool_layers.kernels.fp8_dequant_triton``), bits compared. Times are ``triton.testing.do_bench``
medians (ms). Needs CUDA (torch >= 2.10 with ``grouped_mm``, triton >= 3.6). Prints a table and
writes JSON to ``--out``.

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

from kpool_layers.precision import fp8  # noqa: E402
from kpool_layers.precision import fp8_format  # noqa: E402
from kpool_layers.moe.experts import GroupedExperts  # noqa: E402
from kpool_layers.precision.policy import PrecisionPolicy, Role  # noqa: E402
from timing import routings  # noqa: E402 - sibling module (run as a script)

EXPERTS, HIDDEN, FFN, TOKENS, TOPK = 16, 2048, 1024, 32768, 4
QUANT_SHAPE = (8192, 2048)


def do_bench(fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn`` (triton's ``do_bench``: warm-up, L2 flush between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))


def build_experts(policy: PrecisionPolicy | None = None) -> tuple[torch.nn.Module, GroupedExperts]:
    """megatron's ``SequentialMLP`` and our ``GroupedExperts`` (bf16, CUDA) with the same weights.
    With ``policy`` the expert GEMMs follow it (``config.precision``): ``SequentialMLP``'s linears
    are the role-tagged ``moe.expert_fc1/fc2`` linears ``kpool_layers.spec`` builds."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear, role_builder

    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=16, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=TOPK, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, bf16=True, params_dtype=torch.bfloat16,
    )
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if policy is not None:
        cfg.precision = policy
        linears = MLPSubmodules(linear_fc1=role_builder(RoleColumnParallelLinear, Role.MOE_EXPERT_FC1),
                                linear_fc2=role_builder(RoleRowParallelLinear, Role.MOE_EXPERT_FC2))
    pgs = get_default_pg_collection()
    sequential = SequentialMLP(EXPERTS, cfg, linears, pg_collection=pgs)
    grouped = GroupedExperts(EXPERTS, cfg, pg_collection=pgs)
    grouped.load_state_dict(sequential.state_dict())
    return sequential, grouped


def bench_modules(part: str, modules: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    """Forward + backward of each module (same weights) on both routings; ``max_rel_diff`` of each
    output against the first module's."""
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(TOKENS, device="cuda", requires_grad=True)
    grad = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    for routing, counts in routings(EXPERTS, TOKENS).items():
        first = None
        for name, module in modules.items():
            def step(module: torch.nn.Module = module) -> None:
                module(x, counts, probs)[0].backward(grad)

            params = list(module.parameters())
            ms = do_bench(step, grad_to_none=[x, probs, *params])
            with torch.no_grad():
                out = module(x, counts, probs)[0].float()
            first = out if first is None else first
            diff = float((out - first).abs().max() / first.abs().max())
            rows.append({"part": part, "case": routing, "path": name, "ms": ms, "max_rel_diff": diff})
    return rows


def bench_experts() -> list[dict[str, Any]]:
    sequential, grouped = build_experts()
    return bench_modules("experts", {"sequential": sequential, "grouped": grouped})


def bench_experts_fp8() -> list[dict[str, Any]]:
    """The fp8 profile's routed experts: ``SequentialMLP`` with FP8 role linears vs FP8
    ``GroupedExperts``, and bf16 ``GroupedExperts`` with the same weights."""
    sequential, grouped = build_experts(PrecisionPolicy(name="fp8", fp8=True, backend="torch"))
    _, grouped_bf16 = build_experts()
    grouped_bf16.load_state_dict(grouped.state_dict())
    return bench_modules("experts_fp8", {"sequential fp8": sequential, "grouped fp8": grouped,
                                         "grouped bf16": grouped_bf16})


def bench_quantization() -> list[dict[str, Any]]:
    """Quantization (``bf16 -> e4m3 + scales``) and the backward's dequantization (``e4m3 + scales
    -> bf16``) of one operand per recipe: eager reference vs fused kernel, bytes compared."""
    from kpool_layers.kernels import fp8_dequant_triton, fp8_quant_triton

    torch.manual_seed(0)
    x = torch.randn(*QUANT_SHAPE, device="cuda", dtype=torch.bfloat16)
    rows = []
    for recipe in fp8_format.RECIPES:
        for operand in ("activation", "weight") if recipe == "blockwise" else ("activation",):
            ref_q, ref_s = fp8.quantize(x, recipe, operand)
            q, s = fp8_quant_triton.quantize(x, recipe, operand)
            equal = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            case = f"{recipe} {operand}"
            for name, fn in (("unfused", fp8.quantize), ("fused", fp8_quant_triton.quantize)):
                ms = do_bench(lambda fn=fn: fn(x, recipe, operand))
                rows.append({"part": "fp8_quant", "case": case, "path": name, "ms": ms, "bytes_equal": equal})
            ref_x = fp8.dequantize(q, s, recipe, operand, torch.bfloat16)
            got_x = fp8_dequant_triton.dequantize(q, s, recipe, operand, torch.bfloat16)
            equal = torch.equal(got_x.view(torch.int16), ref_x.view(torch.int16))
            for name, fn in (("unfused", fp8.dequantize), ("fused", fp8_dequant_triton.dequantize)):
                ms = do_bench(lambda fn=fn: fn(q, s, recipe, operand, torch.bfloat16))
                rows.append({"part": "fp8_quant", "case": f"dequantize {case}", "path": name, "ms": ms,
                             "bytes_equal": equal})
    return rows


DISPATCH_SHAPES = {"glm5_proxy": (4096, 16, 4, 2048), "glm5": (4096, 16, 8, 6144)}
"""Part ``dispatch``: name -> (tokens, experts, top-k, hidden)."""


def bench_dispatch() -> list[dict[str, Any]]:
    """Permutation + combine, forward + backward: megatron's ``permute`` / ``unpermute`` against
    ``kpool_layers.moe.permute`` (module docstring)."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from kpool_layers.moe.permute import combine_rows, expert_order, permute_rows

    def megatron_path(x: torch.Tensor, routing_map: torch.Tensor, topk: int) -> torch.Tensor:
        rows, _, row_tokens, _, _ = permute(x, routing_map, num_out_tokens=x.shape[0] * topk)
        return unpermute(rows * 1.5, row_tokens, x.shape)

    def our_path(x: torch.Tensor, routing_map: torch.Tensor, topk: int) -> torch.Tensor:
        order = expert_order(routing_map, topk)
        return combine_rows(permute_rows(x, order) * 1.5, order)

    out = []
    for case, (tokens, experts, topk, hidden) in DISPATCH_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        chosen = torch.rand(tokens, experts, device="cuda", generator=g).topk(topk, dim=1).indices
        routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter_(1, chosen, True)
        x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
        grads = {}
        for name, path in (("megatron", megatron_path), ("fixed order", our_path)):
            def step(path: Callable[..., torch.Tensor] = path) -> torch.Tensor:
                x.grad = None
                path(x, routing_map, topk).backward(grad)
                return x.grad
            first, second = step().clone(), step().clone()
            grads[name] = first
            ms = do_bench(step, grad_to_none=[x])
            ref = grads["megatron"].float()
            diff = float((first.float() - ref).abs().max() / ref.abs().max())
            out.append({"part": "dispatch", "case": f"{case} {tokens}x{topk} h{hidden}", "path": name, "ms": ms,
                        "max_rel_diff": diff, "bitwise_rerun": bool(torch.equal(first, second))})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table with the speed-up of every later path of each case over its first."""
    lines = ["| part | case | path | ms | speed-up | check |", "|---|---|---|---|---|---|"]
    first: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["part"], r["case"])
        speedup = f"{first[key] / r['ms']:.2f}x" if key in first else ""
        first.setdefault(key, r["ms"])
        check = (f"rel diff {r['max_rel_diff']:.1e}" if "max_rel_diff" in r
                 else f"bytes equal: {r['bytes_equal']}")
        if "bitwise_rerun" in r:
            check += f", bitwise rerun: {r['bitwise_rerun']}"
        lines.append(f"| {r['part']} | {r['case']} | {r['path']} | {r['ms']:.3f} | {speedup} | {check} |")
    return "\n".join(lines)


PARTS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "experts": bench_experts, "experts_fp8": bench_experts_fp8, "dispatch": bench_dispatch,
    "fp8_quant": bench_quantization}
"""The parts by name, in the order they run."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                        help="which parts to run (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_experts.py needs a CUDA GPU (grouped_mm, Triton)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import init_single_rank

    init_single_rank()
    rows = [row for part in args.parts for row in PARTS[part]()]
    print(table(rows))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "shape": {
                  "experts": EXPERTS, "hidden": HIDDEN, "ffn": FFN, "tokens": TOKENS,
                  "quant_operand": list(QUANT_SHAPE), "dispatch": DISPATCH_SHAPES}, "parts": args.parts,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
