"""The Triton Hadamard kernel (``kpool_layers.kernels.hadamard_triton``) against the torch butterfly
(``kpool_layers.precision.hadamard.hadamard_butterfly``): the same bits, signed zeros included, forward and
gradient (autograd of the butterfly), for fp32 / bf16 / fp16.

On CPU the kernel runs under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be
set before triton is imported). The interpreter's FP32 arithmetic is numpy's IEEE FP32 and its
FP32 <-> FP16 casts numpy's (round to nearest even), but its FP32 -> BF16 cast truncates: there the
kernel rounds bf16 with integer bit operations (``EMULATE_BF16``), which these cases test; the GPU
cases test the hardware conversions. Values span many binades, down to subnormals of the narrow
dtypes, with exact cancellations (signed zeros) and overflow to infinity.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kpool_layers.precision.hadamard import hadamard_butterfly, hadamard_transform

ROOT = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (``-0.0`` and ``+0.0`` differ); NaNs as one pattern."""
    t = torch.where(t.isnan(), torch.nan, t)
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random normal values over many binades (the narrow dtypes' subnormals and fp16's overflow
    included), a fifth of the last-dim rows small integers (exact cancellations, zeros of both
    signs)."""
    n = shape[-1]
    x = torch.randn(shape, generator=g).reshape(-1, n)
    lo = {torch.float32: -40, torch.bfloat16: -38, torch.float16: -7}[dtype]
    x *= 10.0 ** torch.randint(lo, 4, (x.shape[0], 1), generator=g).float()
    ints = torch.arange(x.shape[0]) % 5 == 0
    x[ints] = torch.randint(-1, 2, (int(ints.sum()), n), generator=g).float()
    x[ints] *= torch.where(torch.rand(int(ints.sum()), n, generator=g) < 0.5, -1.0, 1.0)  # -0.0 too
    return x.reshape(shape).to(dtype)


def cases(device: str, ns: tuple[int, ...] = (2, 16, 128)) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, x, upstream gradient): rows that are no multiple of a program's rows, leading dims,
    non-contiguous inputs (a transposed one and a last-dim stride of 2), for every dtype and n."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in DTYPES:
        for n in ns:
            shapes = {"rows": (37, n), "lead": (3, 5, 7, n)}
            for name, shape in shapes.items():
                out.append((f"{name} {dtype} n={n}", values(shape, dtype, g), values(shape, dtype, g)))
            transposed = values((n, 9), dtype, g).t()  # [9, n], strides (1, 9)
            strided = values((4, 2 * n), dtype, g)[:, ::2]  # [4, n], strides (2n, 2)
            for name, x in (("transposed", transposed), ("strided", strided)):
                out.append((f"{name} {dtype} n={n}", x, values(tuple(x.shape), dtype, g)))
    return [(name, x.to(device), gy.to(device)) for name, x, gy in out]


def forward_and_gradient(fn, x: torch.Tensor, gy: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x, scale)`` and the gradient of ``(fn(x, scale) * gy).sum()`` w.r.t. ``x``."""
    x = x.detach().clone().requires_grad_()
    y = fn(x, scale)
    y.backward(gy)
    return y.detach(), x.grad


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor, where: str) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, where
    differ = int((bits(got) != bits(ref)).sum())
    assert differ == 0, f"{where}: {differ} of {ref.numel()} differ"


def compare(device: str, fn=None, ns: tuple[int, ...] = (2, 16, 128)) -> None:
    """Assert ``fn`` (default: the Triton kernel) == the torch butterfly, bit for bit, forward and
    gradient, for every case and scale in {1, n ** -0.5}."""
    if fn is None:
        from kpool_layers.kernels.hadamard_triton import hadamard_triton as fn
    count = 0
    for name, x, gy in cases(device, ns):
        n = x.shape[-1]
        for scale in (1.0, n**-0.5):
            ref = forward_and_gradient(hadamard_butterfly, x, gy, scale)
            got = forward_and_gradient(fn, x, gy, scale)
            assert_same_bits(got[0], ref[0], f"forward {name} scale={scale}")
            assert_same_bits(got[1], ref[1], f"gradient {name} scale={scale}")
            count += 1
    print(f"kernel == butterfly in {count} cases")


def special_values(device: str) -> None:
    """n = 2 pairs at the edges of the rounding: overflow to +-inf, ties to even, subnormal sums
    and differences, signed-zero sums; with ``-0.0`` upstream gradients."""
    from kpool_layers.kernels.hadamard_triton import hadamard_triton

    for dtype in DTYPES:
        info = torch.finfo(dtype)
        big, tiny, eps = info.max, info.smallest_normal, info.eps
        pairs = torch.tensor([
            [big, big], [big, -big], [-big, -big], [big, big * eps / 4],
            [1.0, eps / 2], [1.0, 3 * eps / 2], [1 + eps, eps / 2], [-1.0, -eps / 2],
            [tiny, -tiny * (1 - 2 * eps)], [tiny * eps, tiny * eps], [tiny * eps, -tiny * eps],
            [0.0, 0.0], [-0.0, -0.0], [-0.0, 0.0], [0.0, -0.0], [float("inf"), 1.0],
        ], dtype=torch.float64).to(dtype).to(device)
        grads = torch.tensor([[-0.0, -0.0], [-0.0, 0.0], [0.0, -0.0], [tiny * eps, -tiny * eps]],
                             dtype=torch.float64).to(dtype).to(device).repeat(4, 1)
        for scale in (1.0, 0.5, 2.0**-0.5, 3.0):
            ref = forward_and_gradient(hadamard_butterfly, pairs, grads, scale)
            got = forward_and_gradient(hadamard_triton, pairs, grads, scale)
            assert_same_bits(got[0], ref[0], f"special values forward {dtype} scale={scale}")
            assert_same_bits(got[1], ref[1], f"special values gradient {dtype} scale={scale}")
    print("special values: kernel == butterfly")


def test_butterfly_gradient_is_the_reversed_stages_with_positive_zeros():
    """What the kernel's backward computes, in torch: autograd of the butterfly is ``g * scale``
    rounded, then the stages in reverse order (``h = n / 2 .. 1``), each pair ``(g0, g1) ->
    (g0 + g1, g0 - g1)`` rounded, and a ``-0.0`` turned into ``+0.0`` (the two halves' gradients
    are added into zeros); the forward order, or keeping ``-0.0``, gives other bits."""
    def reversed_stages(g: torch.Tensor, scale: float, order: str, positive_zero: bool) -> torch.Tensor:
        n, dtype = g.shape[-1], g.dtype
        v = (g.float() * torch.tensor(scale, dtype=torch.float32)).to(dtype).float().reshape(-1, n)
        hs = [n >> (i + 1) for i in range(n.bit_length() - 1)]
        for h in hs if order == "reverse" else hs[::-1]:
            v = v.view(-1, n // (2 * h), 2, h)
            s, d = [(t.to(dtype).float() + 0.0) if positive_zero else t.to(dtype).float()
                    for t in (v[:, :, 0] + v[:, :, 1], v[:, :, 0] - v[:, :, 1])]
            v = torch.stack((s, d), dim=2).reshape(-1, n)
        return v.to(dtype).reshape(g.shape)

    for name, x, gy in cases("cpu", (16, 128)):
        n = x.shape[-1]
        _, grad = forward_and_gradient(hadamard_butterfly, x, gy, n**-0.5)
        assert_same_bits(reversed_stages(gy, n**-0.5, "reverse", True), grad, name)
        if x.dtype == torch.bfloat16 and name.startswith("rows"):
            assert not torch.equal(bits(reversed_stages(gy, n**-0.5, "forward", True)), bits(grad)), name
    x, gy = torch.randn(4, 16), torch.full((4, 16), -0.0)
    _, grad = forward_and_gradient(hadamard_butterfly, x, gy, 1.0)
    assert torch.equal(bits(grad), bits(torch.zeros_like(x)))  # all +0.0
    assert not torch.equal(bits(reversed_stages(gy, 1.0, "reverse", False)), bits(grad))


def test_hadamard_triton_matches_butterfly_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = ("from tests.test_hadamard_triton import compare, special_values; "
            "compare('cpu'); special_values('cpu')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "special values: kernel == butterfly" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_hadamard_triton_refuses_what_it_does_not_run(monkeypatch):
    from kpool_layers.kernels import hadamard_triton

    with pytest.raises(ValueError, match="CUDA tensor"):
        hadamard_triton.hadamard_triton(torch.randn(4, 16), 0.25)
    monkeypatch.setattr(hadamard_triton, "_INTERPRETED", True)  # CPU tensors: only dtype and n count
    assert all(hadamard_triton.supports(torch.zeros(3, n, dtype=d)) for d in DTYPES for n in (2, 128, 1024))
    for x in (torch.zeros(4, 16, dtype=torch.float64), torch.zeros(4, 1), torch.zeros(4, 12),
              torch.zeros(4, 2048), torch.zeros(()), torch.zeros(4, 16, dtype=torch.int32)):
        assert not hadamard_triton.supports(x), (x.dtype, x.shape)


def test_hadamard_transform_runs_the_butterfly_off_cuda(monkeypatch):
    from kpool_layers.kernels import hadamard_triton

    monkeypatch.setattr(hadamard_triton, "hadamard_triton", lambda *a: pytest.fail("kernel called"))
    for dtype in (*DTYPES, torch.float64):
        x = torch.randn(3, 5, 32).to(dtype)
        assert torch.equal(hadamard_transform(x, 0.5), hadamard_butterfly(x, 0.5))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_transform(torch.randn(2, 12))


@pytest.mark.gpu
def test_hadamard_triton_matches_butterfly_on_gpu():
    compare("cuda", hadamard_transform)  # the dispatch takes the kernel on CUDA
    compare("cuda", ns=tuple(2**i for i in range(1, 11)))
    special_values("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_hadamard_triton_at_the_indexer_shape(dtype):
    """[tokens, index heads + the key, 128] as the indexer rotates q and k together."""
    g = torch.Generator().manual_seed(1)
    x, gy = values((4096, 33, 128), dtype, g).cuda(), values((4096, 33, 128), dtype, g).cuda()
    ref = forward_and_gradient(hadamard_butterfly, x, gy, 128**-0.5)
    got = forward_and_gradient(hadamard_transform, x, gy, 128**-0.5)
    assert_same_bits(got[0], ref[0], "forward")
    assert_same_bits(got[1], ref[1], "gradient")


@pytest.mark.gpu
def test_serving_index_quant_is_unchanged_by_the_kernel(monkeypatch):
    """``fp8.serving_index_quant``'s torch code (FP32 Hadamard of BF16-rounded values) gives the bits
    of the butterfly with the kernel. Its fused kernel (``tests/test_serving_quant_triton.py``) is
    turned off here, so that the Hadamard kernel is what runs."""
    from kpool_layers.precision import fp8
    from kpool_layers.kernels import serving_quant_triton

    monkeypatch.setattr(serving_quant_triton, "supports", lambda x: False)
    x = (torch.randn(4096, 33, 128, generator=torch.Generator().manual_seed(2)) * 3).cuda()
    v = x.to(torch.bfloat16).float()
    assert_same_bits(hadamard_transform(v, 128**-0.5), hadamard_butterfly(v, 128**-0.5), "fp32 hadamard")
    for scale_format in ("ue8m0", "amax"):
        got = fp8.serving_index_quant(x, scale_format)
        with monkeypatch.context() as patch:
            patch.setattr(fp8, "hadamard_transform", hadamard_butterfly)
            ref = fp8.serving_index_quant(x, scale_format)
        assert_same_bits(got, ref, scale_format)


@pytest.mark.gpu
def test_hadamard_triton_is_one_kernel_each_way():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(4096, 33, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)
    hadamard_transform(x, 128**-0.5).backward(gy)  # compile outside the profile
    torch.cuda.synchronize()
    for step in ("forward", "backward"):
        y = hadamard_transform(x, 128**-0.5)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if step == "forward":
                hadamard_transform(x, 128**-0.5)
            else:
                torch.autograd.grad(y, x, gy)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, (step, kernels)
