"""Benchmark one FP8 linear of the fp8 profile against the same linear in bf16, at the shapes of
glm5_proxy's quantized linears, side by side in one run, and break the FP8 one into its kernels.

For every linear ``y [M, N] = x [M, K] @ w [N, K].T`` (``M`` = one micro-batch's tokens,
``data.seq_length``; the (K, N) pairs from the composed model config, see :func:`linear_shapes`),
median milliseconds (``triton.testing.do_bench``) of:

* ``bf16``: forward + backward of ``x @ w.T`` in bf16 (three cuBLAS GEMMs: y, dx, dw);
* ``fp8``: forward + backward of :func:`kpool_layers.precision.policy.quantized_matmul` (blockwise,
  ue8m0, ``torch`` backend), what the fp8 profile's linears run: the forward is an FP8 GEMM, the
  backward two bf16 GEMMs on the dequantized operands (``precision.fp8_backward=bf16``);
* ``fp8_bwd``: the same with ``fp8_backward=True``, the fp8 profile's linears: FP8 dgrad and wgrad
  GEMMs too (``dy`` quantized twice, ``x^T`` once more in the forward);
  both replayed as a CUDA graph, as the training step with ``train.cuda_graph_impl=full_iteration``
  runs them (eagerly the host's launches take longer than these GPU times at this size);
* its parts: ``quant_x`` / ``quant_w`` (fused quantization), ``scaled_mm`` (the forward FP8 GEMM
  with its operand padding), ``dequant_x`` / ``dequant_w`` and ``mm_dx`` / ``mm_dw`` (backward);
* ``fp8_gemm_bound``: the three GEMMs all as blockwise FP8 ``F.scaled_mm`` on pre-quantized
  operands, no quantization counted: what an FP8 backward (dgrad and wgrad GEMMs in FP8, as
  Transformer Engine's Float8BlockScaling does) could take at best. ``wgrad_fp8`` says whether
  torch's blockwise ``scaled_mm`` accepts the wgrad GEMM's 1x128 x 1x128 scaling here (if not,
  the bf16 wgrad GEMM is counted). fprop and dgrad pad N / K to multiples of 128 as the fp8
  profile's GEMM does.

Needs CUDA. Prints a table and writes JSON to ``--out``.

    python scripts/bench/fp8_linear.py experiment=glm5_proxy_h200 --out runs/fp8_linear.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kpool_layers.precision import fp8_format  # noqa: E402
from kpool_layers.precision.policy import _scaled_mm, dequantizer, quantized_matmul, quantizer  # noqa: E402
from timing import out_and_config  # noqa: E402 - sibling module (run as a script)


def do_bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (triton's ``do_bench``: warm-up, L2 flush between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def linear_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """(K, N) of the quantized linears of one layer of ``model`` (the composed ``model`` group):
    MLA down/up/out projections, indexer projections, shared expert, dense MLP."""
    heads, qk = model.num_attention_heads, model.qk_head_dim + model.qk_pos_emb_head_dim
    shared = model.moe_shared_expert_intermediate_size
    return {
        "mla.q_down": (model.hidden_size, model.q_lora_rank),
        "mla.q_up": (model.q_lora_rank, heads * qk),
        "mla.kv_down": (model.hidden_size, model.kv_lora_rank + model.qk_pos_emb_head_dim),
        "mla.out": (heads * model.v_head_dim, model.hidden_size),
        "indexer.q": (model.q_lora_rank, model.dsa_indexer_n_heads * model.dsa_indexer_head_dim),
        "indexer.k": (model.hidden_size, model.dsa_indexer_head_dim),
        "shared_expert.fc1": (model.hidden_size, 2 * shared),
        "shared_expert.fc2": (shared, model.hidden_size),
        "dense_mlp.fc1": (model.hidden_size, 2 * model.ffn_hidden_size),
        "dense_mlp.fc2": (model.ffn_hidden_size, model.hidden_size),
    }


def wgrad_gemm(gtq: torch.Tensor, gts: torch.Tensor, xtq: torch.Tensor, xts: torch.Tensor) -> torch.Tensor:
    """``dw [N, K] = g.T @ x`` from ``g.T [N, M]`` and ``x.T [K, M]``, both e4m3 in 1x128 tiles along
    ``M`` (scales ``[N, M/128]`` / ``[K, M/128]``, passed column-major)."""
    return F.scaled_mm(gtq, xtq.t(), gts.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                       xts.t().contiguous().t(), F.ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)


def case(m: int, k: int, n: int) -> dict[str, Any]:
    """The figures of one linear shape (module docstring)."""
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5).requires_grad_()
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    out: dict[str, Any] = {"M": m, "K": k, "N": n}

    def fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        """Forward + backward of ``fn`` captured as a CUDA graph; its replay."""
        def run() -> None:
            x.grad = w.grad = None
            fn().backward(g)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS workspaces
            run()
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return graph.replay

    out["bf16"] = do_bench(fwd_bwd(lambda: x @ w.t()))
    out["fp8"] = do_bench(fwd_bwd(lambda: quantized_matmul(x, w, "blockwise", "torch")))
    out["fp8_bwd"] = do_bench(fwd_bwd(lambda: quantized_matmul(x, w, "blockwise", "torch", fp8_backward=True)))
    quantize, dequantize = quantizer("torch", x), dequantizer("torch", x)
    xd, wd = x.detach(), w.detach()
    xq, xs = quantize(xd, "blockwise", "activation")
    wq, ws = quantize(wd, "blockwise", "weight")
    out["quant_x"] = do_bench(lambda: quantize(xd, "blockwise", "activation"))
    out["quant_w"] = do_bench(lambda: quantize(wd, "blockwise", "weight"))
    out["scaled_mm"] = do_bench(lambda: _scaled_mm(xq, xs, wq, ws, "blockwise"))
    out["dequant_x"] = do_bench(lambda: dequantize(xq, xs, "blockwise", "activation", torch.bfloat16))
    out["dequant_w"] = do_bench(lambda: dequantize(wq, ws, "blockwise", "weight", torch.bfloat16))
    out["mm_dx"] = do_bench(lambda: g @ wd)
    out["mm_dw"] = do_bench(lambda: g.t() @ xd)
    if m % fp8_format.BLOCK:
        out["fp8_gemm_bound"] = None  # the wgrad GEMM's reduction (tokens) must tile by 128
        return out
    gq, gs = quantize(g, "blockwise", "activation")  # dgrad: g in 1x128 tiles along N
    wtq, wts = quantize(wd.t().contiguous(), "blockwise", "weight")  # w.T [K, N], the same 128x128 blocks
    gtq, gts = quantize(g.t().contiguous(), "blockwise", "activation")  # wgrad: g.T, tiles along M
    xtq, xts = quantize(xd.t().contiguous(), "blockwise", "activation")  # x.T, tiles along M
    fprop = out["scaled_mm"]
    dgrad = do_bench(lambda: _scaled_mm(gq, gs, wtq, wts, "blockwise"))
    try:
        wgrad = do_bench(lambda: wgrad_gemm(gtq, gts, xtq, xts))
        out["wgrad_fp8"] = True
    except (RuntimeError, ValueError) as err:
        out["wgrad_fp8"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        wgrad = out["mm_dw"]
    out["fp8_gemm_bound"] = fprop + dgrad + wgrad
    out["fp8_gemm_parts"] = {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}
    return out


def main() -> None:
    out_path, overrides, cfg = out_and_config(__doc__)
    m = cfg.train.micro_batch_size * cfg.data.seq_length
    results = {name: case(m, k, n) for name, (k, n) in linear_shapes(cfg.model).items()}
    cols = ["bf16", "fp8", "fp8_bwd", "quant_x", "quant_w", "scaled_mm", "dequant_x", "dequant_w", "mm_dx", "mm_dw",
            "fp8_gemm_bound"]
    print(f"{'linear':20s} {'M,K,N':>17s} " + " ".join(f"{c:>9s}" for c in cols) + "  fp8/bf16 fp8_bwd/bf16")
    for name, r in results.items():
        vals = " ".join(f"{r[c]:9.4f}" if r[c] is not None else f"{'-':>9s}" for c in cols)
        print(f"{name:20s} {r['M']:>5d},{r['K']:>5d},{r['N']:>5d} {vals}  {r['fp8'] / r['bf16']:.2f}"
              f" {r['fp8_bwd'] / r['bf16']:.2f}"
              + ("" if r.get("wgrad_fp8", True) is True else f"  wgrad: {r['wgrad_fp8']}"))
    total = {c: sum(r[c] or 0.0 for r in results.values()) for c in cols}
    print("sum of one layer's linears: " + " ".join(f"{c}={v:.3f}" for c, v in total.items()))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps({"overrides": overrides, "linears": results, "sums": total}, indent=1))


if __name__ == "__main__":
    main()
