"""Benchmark KDA (Kimi delta attention) at GLM-5.3-Flash's shape: the delta-rule kernel alone and
the whole layer, forward + backward, side by side in one run.

Per sequence length (batch 1; GLM-5.3-Flash: hidden 4096, 64 KDA heads of 128, conv 4 taps, gate
lower bound -5; bf16 on GPU):

    kernel_fla    flash-linear-attention's ``chunk_kda`` called directly, as fla's own benchmarks
                  call it (q, k, v, beta bf16; g the fp32 log decay; q/k L2 norm in the kernel)
    kernel_torch  the chunked PyTorch reference (``kpool_layers.linear_attention.delta_rule``), where
                  it fits in ``--torch-max`` tokens
    layer_fla     our ``KimiDeltaAttention`` (projections, conv, gates, the delta rule through
                  ``model.linear_attention_kernels=fla``, gated norm, output projection)
    layer_fla_torch_ops  the same layer with fla's delta rule but the PyTorch conv, gate and gated
                  norm (``fla_ops_speedup``: its time over ``layer_fla``'s)

Each entry is the median of ``--repeats`` forward + backward passes after one warm-up (the first
call autotunes fla's kernels), with the extra peak GPU memory. The delta rule's FLOPs are those of
:class:`recipes.observe.metrics.FlopModel`: per token and head ``6 D^2 + 10 C D`` forward (chunk
C = 64), three times that forward + backward; the layer adds its projections' ``2 x 3 x`` weight
count per token. ``layer_over_kernel`` is how much of the layer's time the kernel is not.

    python scripts/bench/kda.py --seq 4096 16384 65536 --out runs/kda.json     # H200
    python scripts/bench/kda.py --small --out /tmp/kda.json                     # tiny, CPU (torch)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

import torch

from timing import bench_device, measure

GLM53 = dict(hidden=4096, heads=64, head_dim=128, taps=4, lower_bound=-5.0)
SMALL = dict(hidden=32, heads=2, head_dim=8, taps=4, lower_bound=-5.0)
CHUNK = 64


def _config(shape: dict[str, Any], backend: str, dtype: torch.dtype, cuda: bool) -> Any:
    from kpool_layers.config import GLMTransformerConfig

    return GLMTransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        linear_num_key_heads=shape["heads"], linear_num_value_heads=shape["heads"],
        linear_key_head_dim=shape["head_dim"], linear_value_head_dim=shape["head_dim"],
        linear_conv_kernel_dim=shape["taps"], linear_gate_lower_bound=shape["lower_bound"],
        linear_attention_kernels=backend, add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not cuda, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
        qk_pos_emb_head_dim=0, v_head_dim=8)


def kernel_step(kernel: Callable[..., torch.Tensor], s: int, shape: dict[str, Any], dtype: torch.dtype,
                device: torch.device) -> Callable[[], None]:
    """One forward + backward of ``kernel`` (a :data:`~kpool_layers.linear_attention.backends.DeltaRule`)
    on random inputs of ``s`` tokens."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    h, d = shape["heads"], shape["head_dim"]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device)

    q, k, v = (rand(1, s, h, d).to(dtype).requires_grad_() for _ in range(3))
    # log decay in (lower_bound, 0), as the layer's gate gives it
    g = (shape["lower_bound"] * torch.sigmoid(rand(1, s, h, d))).requires_grad_()
    beta = torch.sigmoid(rand(1, s, h)).to(dtype).requires_grad_()
    grad = rand(1, s, h, d).to(dtype)

    def step() -> None:
        out = kernel(q, k, v, g, beta, d ** -0.5, None)
        out.backward(grad)
        for t in (q, k, v, g, beta):
            t.grad = None
    return step


def layer_step(backend: str, s: int, shape: dict[str, Any], dtype: torch.dtype,
               device: torch.device, kernels: Any = None) -> tuple[Callable[[], None], int]:
    """One forward + backward of our KDA layer on ``s`` tokens, and its weight count; ``kernels``
    (a ``KDAKernels``) replaces the backend's."""
    from megatron.core.transformer.spec_utils import build_module

    from kpool_layers.linear_attention.kda import kda_spec

    config = _config(shape, backend, dtype, device.type == "cuda")
    layer = build_module(kda_spec(config), config=config, layer_number=1).to(device=device, dtype=dtype)
    if kernels is not None:
        layer.kernels = kernels
    x = torch.randn(s, 1, shape["hidden"], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x.requires_grad_()
    grad = torch.randn_like(x)
    weights = sum(p.numel() for n, p in layer.named_parameters() if n.startswith("linear_"))

    def step() -> None:
        out, _ = layer(x, None)
        out.backward(grad)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return step, weights


def delta_rule_flops(s: int, shape: dict[str, Any]) -> float:
    """Forward + backward FLOPs of the chunked delta rule on ``s`` tokens (FlopModel's count)."""
    d = shape["head_dim"]
    return 3 * s * shape["heads"] * (6 * d * d + 10 * CHUNK * d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-max", type=int, default=16384, help="longest sequence for kernel_torch")
    parser.add_argument("--small", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    from kpool_layers.linear_attention.fla_kernels import FLA_KERNELS, chunk_kda_fla
    from kpool_layers.linear_attention.layer_ops import TORCH_KERNELS
    from kpool_layers.linear_attention.delta_rule import chunk_kda_torch

    cuda, device, dtype = bench_device()
    shape = SMALL if args.small else GLM53
    backends = ["fla", "torch"] if cuda else ["torch"]
    rows = []
    for s in args.seq:
        row: dict[str, Any] = {"seq": s, "delta_rule_gflop": delta_rule_flops(s, shape) / 1e9}
        kernels = {"fla": chunk_kda_fla, "torch": chunk_kda_torch}
        for name in backends:
            if name == "torch" and s > args.torch_max:
                continue
            row[f"kernel_{name}"] = measure(kernel_step(kernels[name], s, shape, dtype, device), args.repeats, cuda)
        step, weights = layer_step(backends[0], s, shape, dtype, device)
        row[f"layer_{backends[0]}"] = measure(step, args.repeats, cuda)
        if cuda:  # fla's delta rule with the torch conv, gate and gated norm, side by side
            mixed = dataclasses.replace(FLA_KERNELS, conv=TORCH_KERNELS.conv, decay=TORCH_KERNELS.decay,
                                        gated_norm=TORCH_KERNELS.gated_norm)
            row["layer_fla_torch_ops"] = measure(layer_step("fla", s, shape, dtype, device, mixed)[0],
                                                 args.repeats, cuda)
            if row["layer_fla"].get("ms") and row["layer_fla_torch_ops"].get("ms"):
                row["fla_ops_speedup"] = row["layer_fla_torch_ops"]["ms"] / row["layer_fla"]["ms"]
        row["layer_projection_gflop"] = 6 * s * weights / 1e9
        kernel = row[f"kernel_{backends[0]}"]
        layer = row[f"layer_{backends[0]}"]
        if kernel.get("ms") and layer.get("ms"):
            row["kernel_tflops"] = row["delta_rule_gflop"] / kernel["ms"]
            row["layer_tflops"] = (row["delta_rule_gflop"] + row["layer_projection_gflop"]) / layer["ms"]
            row["layer_over_kernel"] = layer["ms"] / kernel["ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
               "shape": shape, "chunk": CHUNK, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
