"""The fused Triton FP8 dequantization (``kpool_layers.kernels.fp8_dequant_triton``) against the
reference ``kpool_layers.precision.fp8.dequantize``: same bits for every recipe, operand and scale format,
on ragged shapes (M, K not multiples of 128), and the FP8 backward paths that use it.

The operands are the reference quantization's bytes and scales (:func:`kpool_layers.precision.fp8.quantize`;
the fused quantizer's FP32 -> e4m3 conversion is not the GPU's under Triton's interpreter). On the
CPU the kernel runs under the interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set
before triton is imported) with ``out_dtype=torch.float32``: the interpreter truncates FP32 ->
BF16, so the BF16/FP16 rounding is compared on a GPU (``gpu`` tests, which also compare the
gradients of ``quantized_matmul`` and of the FP8 grouped experts with the eager dequantization)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kpool_layers.precision import fp8, policy as precision
from kpool_layers.precision import fp8_format

ROOT = Path(__file__).resolve().parents[1]


def cases(device: str) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, operand): partial 128-tiles in both dimensions, several 128-row weight
    blocks, a 3-D activation, an all-zero row and values down to e4m3 subnormals after scaling."""
    g = torch.Generator().manual_seed(0)
    act = torch.randn(37, 200, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    act[0] = 0.0
    act[1, 128:131] = torch.tensor([448.0, 2.0**-8, 3 * 2.0**-10])
    weight = torch.randn(300, 130, generator=g) * torch.logspace(-4, 0, 130)
    out = [("act", act, "activation"), ("act_3d", torch.randn(2, 3, 256, generator=g), "activation"),
           ("act_one_row", torch.randn(1, 77, generator=g), "activation"),
           ("weight", weight, "weight"), ("weight_small", torch.randn(5, 40, generator=g), "weight")]
    return [(n, t.to(device), o) for n, t, o in out]


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (signed zeros differ)."""
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def compare(device: str, out_dtypes: tuple[torch.dtype, ...]) -> None:
    """Assert fused == reference bit for bit for every case x recipe x scale format x dtype."""
    from kpool_layers.kernels import fp8_dequant_triton as fused

    for name, x, operand in cases(device):
        for recipe in fp8_format.RECIPES:
            for scale_format in fp8_format.SCALE_FORMATS:
                q, s = fp8.quantize(x, recipe, operand, scale_format)
                for out_dtype in out_dtypes:
                    ref = fp8.dequantize(q, s, recipe, operand).to(out_dtype)
                    got = fused.dequantize(q, s, recipe, operand, out_dtype)
                    where = f"{name} {recipe} {scale_format} {out_dtype}"
                    assert got.dtype == out_dtype and got.shape == x.shape, where
                    assert torch.equal(bits(got), bits(ref)), where
                    assert torch.equal(bits(fp8.dequantize(q, s, recipe, operand, out_dtype)), bits(ref)), where
    print("fused == reference")


def test_fused_dequantize_matches_reference_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = "import torch; from tests.test_fp8_dequant_triton import compare; compare('cpu', (torch.float32,))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "fused == reference" in done.stdout, done.stderr[-3000:]


def test_fused_dequantize_refuses_mismatched_scales():
    from kpool_layers.kernels.fp8_dequant_triton import dequantize

    q, s = fp8.quantize(torch.randn(130, 200), "blockwise", "weight")
    with pytest.raises(ValueError, match=r"scale must be FP32 \[2, 2\]"):
        dequantize(q, s[:, :1], "blockwise", "weight")
    with pytest.raises(ValueError, match="out_dtype"):
        dequantize(q, s, "blockwise", "weight", torch.float64)


def test_torch_backend_dequantizes_with_the_fused_kernel_only_on_cuda():
    assert precision.dequantizer("torch", torch.zeros(1)) is fp8.dequantize
    assert precision.dequantizer("emulate", torch.zeros(1)) is fp8.dequantize


@pytest.mark.gpu
def test_fused_dequantize_matches_reference_on_gpu():
    compare("cuda", (torch.bfloat16, torch.float16, torch.float32))


@pytest.mark.gpu
def test_fused_dequantize_is_one_kernel():
    from torch.profiler import ProfilerActivity, profile

    from kpool_layers.kernels import fp8_dequant_triton as fused

    q, s = fp8.quantize(torch.randn(256, 512, device="cuda"), "blockwise", "activation")
    fused.dequantize(q, s, "blockwise", "activation", torch.bfloat16)  # compile outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused.dequantize(q, s, "blockwise", "activation", torch.bfloat16)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]


def matmul_grads(x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
    """Output and input / weight gradients of ``quantized_matmul`` on the ``torch`` backend."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = precision.quantized_matmul(x, w, recipe, "torch")
    y.backward(gy)
    return y.detach(), x.grad, w.grad


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_quantized_matmul_gradients_equal_the_eager_dequantization(monkeypatch, recipe, dtype):
    """``_QuantizedMatmul``'s backward with the fused dequantization gives the gradients of the
    eager ``fp8.dequantize(...).to(dtype)`` bit for bit (3-D input, K and N not multiples of 128)."""
    if not precision._cuda_fp8_available():
        pytest.skip("needs an FP8-capable GPU (sm_89+)")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 70, 320, device="cuda", generator=g).to(dtype)
    w = (torch.randn(200, 320, device="cuda", generator=g) * 0.05).to(dtype)
    gy = torch.randn(3, 70, 200, device="cuda", generator=g).to(dtype)
    fused = matmul_grads(x, w, gy, recipe)
    monkeypatch.setattr(precision, "dequantizer", lambda backend, q: fp8.dequantize)
    eager = matmul_grads(x, w, gy, recipe)
    for name, a, b in zip(("y", "dx", "dw"), fused, eager, strict=True):
        assert a.dtype == dtype and torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_grouped_fp8_gradients_equal_the_eager_dequantization(monkeypatch, recipe):
    """The FP8 grouped experts' backward with the fused dequantization gives the gradients of the
    eager one bit for bit (skewed routing, experts without tokens)."""
    from kpool_layers.moe import grouped_gemm
    from kpool_layers.kernels import fp8_dequant_triton
    from kpool_layers.precision.policy import LinearNumerics, PrecisionPolicy, Role

    numerics = LinearNumerics(PrecisionPolicy(fp8=True, recipe=recipe, backend="torch"), Role.MOE_EXPERT_FC1)
    counts = torch.tensor([37, 0, 5, 90, 1, 0])
    torch.manual_seed(0)
    x = torch.randn(int(counts.sum()), 384, device="cuda").to(torch.bfloat16)
    w = (torch.randn(len(counts), 256, 384, device="cuda") * 0.05).to(torch.bfloat16)
    gy = torch.randn(x.shape[0], 256, device="cuda").to(torch.bfloat16)
    assert grouped_gemm.fused_fp8(numerics, x, w)
    results = []
    for _ in ("fused", "eager"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        grouped_gemm.expert_linear(xi, wi, counts, numerics, kernel=True).backward(gy)
        results.append((xi.grad, wi.grad))
        monkeypatch.setattr(fp8_dequant_triton, "dequantize", fp8.dequantize)
    for name, a, b in zip(("dx", "dw"), *results, strict=True):
        assert torch.equal(a, b), name
