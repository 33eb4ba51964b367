"""The fused Triton FP8 quantization (``kpool_layers.kernels.fp8_quant_triton``) against the
reference ``kpool_layers.precision.fp8.quantize``: same e4m3 bytes and FP32 scales for every recipe,
operand and scale format, on ragged shapes and edge values.

On the CPU the kernel runs under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must
be set before triton is imported). The interpreter's FP8 conversion rounds half away from zero
and flushes e4m3 subnormals, unlike the GPU's round-to-nearest-even ``cvt``, so there the kernel
writes its pre-rounding FP32 values (``clamp(x / s, -448, 448)``) and torch rounds them: the scale
computation, tiling, division and clamping are compared bit for bit, the final rounding
instruction only on a GPU (``gpu`` tests, which also compare ``quantized_matmul`` end to end)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from kpool_layers.precision import fp8
from kpool_layers.precision import fp8_format

ROOT = Path(__file__).resolve().parents[1]


def cases(device: str) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, operand): ragged tiles, bf16, 3-D activations and edge values: an all-zero
    row (the 1e-4 amax floor), a row whose amax is 448 * 2**k (a power-of-two ratio), values that
    land on e4m3 rounding ties and in the e4m3 subnormal range after scaling."""
    g = torch.Generator().manual_seed(0)
    act = torch.randn(6, 200, generator=g) * torch.logspace(-3, 2, 6)[:, None]
    act[0] = 0.0
    act[1, :3] = torch.tensor([448.0 * 4, 1.0625 * 4, -1.1875 * 4])  # s = 4: ties at 1.0625, 1.1875
    act[2, 128:131] = torch.tensor([448.0, 2.0**-8, 3 * 2.0**-10])  # subnormals in the 2nd tile
    weight = torch.randn(130, 200, generator=g) * 0.02
    weight[129, 199] = 3.0  # a partial 128x128 block whose amax is a lone element
    tokens = torch.randn(300, 136, generator=g) * torch.logspace(-2, 1, 136)  # the wgrad's x^T
    out = [("act", act, "activation"), ("act_bf16", act.to(torch.bfloat16), "activation"),
           ("act_3d", torch.randn(2, 3, 128, generator=g), "activation"),
           ("act_transposed", tokens.t(), "activation"),
           ("act_transposed_bf16", tokens.to(torch.bfloat16).t(), "activation"),
           ("weight", weight, "weight"), ("weight_bf16", weight.to(torch.bfloat16), "weight"),
           ("weight_transposed", weight.t(), "weight")]
    return [(n, t.to(device), o) for n, t, o in out]  # .to keeps a transpose's strides


def compare(device: str) -> None:
    """Assert fused == reference for every case x recipe x scale format on ``device``."""
    from kpool_layers.kernels import fp8_quant_triton as fused

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    for name, x, operand in cases(device):
        for recipe in fp8_format.RECIPES:
            for scale_format in fp8_format.SCALE_FORMATS:
                ref_q, ref_s = fp8.quantize(x, recipe, operand, scale_format)
                if interpreted:
                    q, s = fused.quantize(x, recipe, operand, scale_format, out_dtype=torch.float32)
                    q = q.to(torch.float8_e4m3fn)
                else:
                    q, s = fused.quantize(x, recipe, operand, scale_format)
                where = f"{name} {recipe} {scale_format}"
                assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape, where
                assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), where
                assert s.dtype == torch.float32 and torch.equal(s, ref_s), where
    for shape, operand in (((0, 200), "activation"), ((2, 0, 128), "activation"), ((0, 200), "weight")):
        x = torch.zeros(shape, device=device)  # no rows: no kernel runs, the shapes still hold
        for recipe in fp8_format.RECIPES:
            ref_q, ref_s = fp8.quantize(x, recipe, operand)
            q, s = fused.quantize(x, recipe, operand)
            where = f"empty {shape} {operand} {recipe}"
            assert (q.dtype, q.shape, s.dtype, s.shape) == (ref_q.dtype, ref_q.shape, ref_s.dtype, ref_s.shape), where
    print("fused == reference")


def test_a_transposed_operand_is_read_in_place(monkeypatch):
    """``quantize(g.t())`` (the FP8 wgrad's operands) hands the kernel ``g``'s own storage with the
    transpose's strides, not a contiguous copy; a 3-D view that no 2-D view can express is reshaped
    (copied) first. The kernel itself is replaced by a recorder: no Triton launch."""
    from kpool_layers.kernels import fp8_quant_triton as fused

    launches = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda x2, *args, **meta: launches.append((x2.data_ptr(), args[8:10]))

    monkeypatch.setattr(fused, "_quantize_kernel", Recorder())
    g = torch.randn(300, 256)
    fused.quantize(g.t(), "blockwise", "activation")
    assert launches == [(g.data_ptr(), (1, 256))]
    launches.clear()
    x = torch.randn(4, 6, 128).permute(1, 0, 2)  # [6, 4, 128]: rows 4 * 6 not one stride apart
    fused.quantize(x, "blockwise", "activation")
    assert launches[0][0] != x.data_ptr() and launches[0][1] == (128, 1)


@pytest.mark.parametrize("unit_stride", ["stride_xk", "stride_xm"])
def test_both_layouts_compile_to_vector_loads_for_hopper(unit_stride: str) -> None:
    """The ROW-mode kernel (blockwise activations) compiles to an sm_90 cubin on the CPU for a
    row-major operand (``stride_xk`` = 1, which Triton's launcher specializes) and for a transpose
    (``stride_xm`` = 1), with the divisibility-by-16 facts the launcher passes for such shapes: both
    read bf16 in 16-byte vector loads (``ld.global.v4.b32``; the transpose's tile is laid out along
    its unit-stride rows, then converted through shared memory for the row-major store), none
    element by element."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpool_layers.kernels import fp8_quant_triton as fused

    names = ["x_ptr", "q_ptr", "s_ptr", "amax_ptr", "M", "K", "GROUP", "n_groups", "n_amax",
             "stride_xm", "stride_xk", "stride_q"]
    constants = {"MODE": fused.ROW, "BLOCK_M": 32, "CHUNK": 128, "UE8M0": True, "LIBDEVICE": True, unit_stride: 1}
    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "amax_ptr": "*fp32",
                 **{n: "i32" for n in names[4:]}, **{c: "constexpr" for c in constants}}
    divisible = ("x_ptr", "q_ptr", "s_ptr", "amax_ptr", "M", "K", "GROUP", "stride_xm", "stride_xk", "stride_q")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n != unit_stride}
    compiled = triton.compile(ASTSource(fn=fused._quantize_kernel, signature=signature, constexprs=constants,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    loads = re.findall(r"ld\.global[.\w]*", compiled.asm["ptx"])
    assert compiled.asm["cubin"] and loads and set(loads) == {"ld.global.v4.b32"}, loads


def test_fused_quantize_matches_reference_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.test_fp8_quant_triton import compare; compare('cpu')"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0 and "fused == reference" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
def test_fused_quantize_matches_reference_on_gpu():
    compare("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
def test_fused_quantization_kernel_count_and_matmul(recipe, monkeypatch):
    """One kernel per operand (two for tensorwise), and the torch backend's FP8 GEMM equals the
    one fed by the reference quantization bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    from kpool_layers.precision import policy as precision
    from kpool_layers.kernels import fp8_quant_triton as fused

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    fused.quantize(x, recipe, "activation")  # compile outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused.quantize(x, recipe, "activation")
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == (2 if recipe == "tensorwise" else 1), [e.name for e in kernels]
    if recipe == "blockwise":  # the FP8 wgrad's transposed operand: read in place, one kernel
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fused.quantize(x.t(), recipe, "activation")
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, [e.name for e in kernels]
    got = precision.quantized_matmul(x, w, recipe, "torch")
    monkeypatch.setattr(precision, "quantizer", lambda backend, t: fp8.quantize)
    assert torch.equal(got, precision.quantized_matmul(x, w, recipe, "torch"))


def test_torch_backend_uses_the_fused_kernel_only_on_cuda():
    from kpool_layers.precision.policy import quantizer

    assert quantizer("torch", torch.zeros(1)) is fp8.quantize
    assert quantizer("emulate", torch.zeros(1)) is fp8.quantize
