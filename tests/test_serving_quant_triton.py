"""The fused serving index quantization (``kpool_layers.kernels.serving_quant_triton``) against the
torch reference ``kpool_layers.precision.fp8.serving_index_quant``: the same values, dtype and shape for both
scale formats, every power-of-two ``d`` up to 128 and fp32 / bf16 / fp16 inputs.

On the CPU the kernel runs under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be
set before triton is imported; :func:`compare` prints its findings as JSON there); there the
reference is ``serving_index_quant`` on the same CPU tensors (which is its torch code: the routing
to the kernel is for CUDA tensors only). The kernel does its e4m3 rounding in FP32 arithmetic, not
with the interpreter's float8 conversion (which rounds half away from zero and flushes
subnormals), so the comparison covers every step, the final rounding included.

The rows cover each rounding on purpose, which :func:`coverage` counts on the reference's own
intermediate values: fp32 inputs at bf16 ties (step 1), rotations landing on bf16 ties (step 2),
e4m3 ties in the normal and subnormal ranges where round-to-nearest-even goes down (half away from
zero would not) and up, e4m3 subnormals, values clamped at 448 (``amax`` scales), all-zero rows
(the 1e-4 amax floor), ue8m0 scales over many exponents, and rows with an inf or NaN (all NaN).
For ``d`` in {4, 16, 64} the rotation's scale ``d**-0.5`` is a power of two, so rows built as
``H t / sqrt(d)`` rotate back to ``t`` exactly: these place ties under ``amax`` scales (with ``amax =
448 * 2**k`` the scale is ``2**k`` and every ``v / s`` is exact).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kpool_layers.precision import fp8
from kpool_layers.precision import fp8_format
from kpool_layers.kernels import hadamard_triton
from kpool_layers.precision.hadamard import hadamard_butterfly

ROOT = Path(__file__).resolve().parents[1]
DS = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _exact_rows(d: int) -> torch.Tensor:
    """For ``d`` in {4, 16, 64} (``sqrt(d)`` a power of two): rows whose rotation ``v`` is known
    exactly, with ``amax`` 448 times a power of two ``p`` (so the scale is ``p`` in both formats) and
    ``v / p = T`` an e4m3 tie in some entries:

    * ``x = H t / sqrt(d)`` for ``t = (448, T) * 2**k``: ``v = t``, ``T`` in [256, 448];
    * ``x = (a, a, 4T, 0, ..) * 2**k`` with ``a = 896``: ``v`` repeats ``(2a + 4T, 4T, 2a - 4T, -4T) *
      2**k / sqrt(d)``, whose ``(2a +- 4T) ...`` round to ``2a * 2**k / sqrt(d) = 448 p`` in bf16 for
      ``T < 1``: ``T`` among the small normals or the subnormals (``(j + 1/2) * 2**-9``, the last one
      rounding up to ``2**-6``)."""
    rows = []
    big_ties = [272.0, 304.0, 336.0, 368.0, 400.0, 432.0]
    small_ties = [(1 + (2 * j + 1) / 16) * 2.0**e for e in (-1, -6) for j in range(8)]
    small_ties += [(j + 0.5) * 2.0**-9 for j in range(8)]
    for k in (-9, -1, 0, 4):
        for tie in big_ties:
            t = torch.zeros(d, dtype=torch.float64)
            t[0], t[1] = 448.0, tie
            rows.append(hadamard_butterfly(t, d**-0.5) * 2.0**k)
        for tie in small_ties:
            x = torch.zeros(d, dtype=torch.float64)
            x[0] = x[1] = 896.0
            x[2] = 4 * tie
            rows.append(x * 2.0**k)
    return torch.stack(rows).float()


def rows(d: int, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The named row sets ``[rows, d]`` (``dtype``) for one ``d``."""
    n = max(2 * (4096 // d) + 37, 600)  # ROWS = 4096 // d rows per program: several, the last partial
    lo, hi = (-14, 12) if dtype == torch.float16 else (-60, 60)
    out = {}
    x = torch.randn(n, d, generator=g)
    x *= torch.exp2(torch.randint(lo, hi, (n, 1), generator=g).float())  # ue8m0 scales over many exponents
    out["random"] = x
    x = torch.randn(n // 4, d, generator=g).bfloat16().float()  # fp32 inputs on bf16 ties (step 1)
    ulp = torch.exp2(torch.floor(torch.log2(x.abs())) - 7)
    out["bf16 ties"] = x + torch.where(torch.rand(x.shape, generator=g) < 0.5, -0.5, 0.5) * ulp
    out["zeros"] = torch.tensor([[0.0] * d, [-0.0] * d])
    out["tiny and huge"] = torch.randn(8, d, generator=g) * torch.tensor(
        [2.0**-24, 2.0**-20, 2.0**-16, 2.0**8, 2.0**10, 2.0**60, 2.0**100, 2.0**115])[:, None]
    if d >= 4:  # (1, 1, c): rotations with entries ~ c * d**-0.5 in e4m3's subnormal range after scaling
        c = 2.0**-15 * (1 + torch.arange(256) / 128)
        x = torch.zeros(256, d)
        x[:, 0] = x[:, 1] = 1.0
        x[:, 2] = c
        out["subnormal sweep"] = x * torch.exp2(torch.arange(256) % 9 - 4.0)[:, None]
    if d in (4, 16, 64):
        out["exact ties"] = _exact_rows(d)
    bad = torch.randn(3, d, generator=g)
    bad[0, 0], bad[1, -1], bad[2, 0] = float("inf"), float("nan"), 3e38  # 3e38: overflow in the rotation
    out["nonfinite"] = bad
    return {name: t.to(dtype) for name, t in out.items()}


def cases(d: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """(name, x): every row set with leading dims (``[3, rows / 3, d]``, or ``[1, rows, d]`` where 3
    does not divide the rows), and 50 random rows as a non-contiguous (column-major) ``[50, d]``."""
    g = torch.Generator().manual_seed(d * 10 + DTYPES.index(dtype))
    sets = rows(d, dtype, g)
    out = []
    for name, x in sets.items():
        out.append((name, x.reshape(3, -1, d) if x.shape[0] % 3 == 0 else x[None]))
    out.append(("transposed", sets["random"][:50].t().contiguous().t()))
    return out


def same(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Same dtype, shape, NaN positions and values elsewhere."""
    return (got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got.isnan(), ref.isnan())
            and torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0)))


def coverage(x: torch.Tensor, scale_format: str) -> collections.Counter[str]:
    """What ``x``'s rows exercise in the reference's steps (finite rows)."""
    d = x.shape[-1]
    x = x.reshape(-1, d)
    x = x[x.float().abs().amax(dim=-1) < 1e30]  # rotations of larger rows overflow
    low16 = lambda t: t.float().view(torch.int32) & 0xFFFF  # noqa: E731
    w = hadamard_butterfly(x.to(torch.bfloat16).float(), d**-0.5)
    v = w.to(torch.bfloat16).float()
    s = fp8.compute_scale(v.abs().amax(dim=-1, keepdim=True), scale_format)
    y = (v / s).double()
    a = y.abs()
    step = torch.where(a >= 2.0**-6, torch.exp2(torch.floor(torch.log2(a)) - 3), 2.0**-9)
    k = a / step
    tie = (k - k.floor() == 0.5) & (a <= 448)
    down = tie & (k.floor() % 2 == 0)  # nearest even is below: half away from zero would differ
    normal = a >= 2.0**-6
    return collections.Counter({
        "bf16 tie in x": int(((low16(x) == 0x8000) & (x.dtype != torch.bfloat16)).sum()),
        "bf16 tie after the rotation": int((low16(w) == 0x8000).sum()),
        "e4m3 tie down, normal": int((down & normal).sum()),
        "e4m3 tie up, normal": int((tie & ~down & normal).sum()),
        "e4m3 tie down, subnormal": int((down & ~normal).sum()),
        "e4m3 tie up, subnormal": int((tie & ~down & ~normal).sum()),
        "e4m3 subnormal": int(((a > 0) & ~normal).sum()),
        "clamped at 448": int((a > 448).sum()),
        "all-zero rows": int((v.abs().amax(dim=-1) == 0).sum()),
        "scale exponents": len(set(torch.log2(s).floor().flatten().tolist())),
    })


def count_ops(fn, *args) -> list[str]:
    """The aten ops (those that launch a kernel on a GPU: :data:`tests.op_counts.NO_KERNEL` excluded)
    that ``fn(*args)`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.op_counts import NO_KERNEL

    class Count(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN204
            if func._overloadpacket.__name__ not in NO_KERNEL:
                self.ops.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn(*args)
    return counter.ops


def compare() -> dict:
    """Under the interpreter: per ``d``, dtype and format, the cases where kernel != reference, and
    the aten ops of the kernel's call at ``[64, 128]`` bf16."""
    from kpool_layers.kernels.serving_quant_triton import serving_index_quant_triton

    mismatches = {}
    for d in DS:
        for dtype in DTYPES:
            for name, x in cases(d, dtype):
                for scale_format in fp8_format.SCALE_FORMATS:
                    got = serving_index_quant_triton(x, scale_format)
                    ref = fp8.serving_index_quant(x, scale_format)
                    if not same(got, ref):
                        where = f"d={d} {NAMES[dtype]} {scale_format} {name}"
                        mismatches[where] = f"{int((got != ref).sum())} of {ref.numel()} differ"
    ops = count_ops(serving_index_quant_triton, torch.randn(64, 128).to(torch.bfloat16), "ue8m0")
    return {"mismatches": mismatches, "ops": ops}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = "import json; from tests.test_serving_quant_triton import compare; print(json.dumps(compare()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernel_matches_reference_interpreted(interpreted: dict) -> None:
    assert interpreted["mismatches"] == {}


def test_fused_path_is_one_kernel_instead_of_the_reference_ops(interpreted: dict,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Per call at ``[64, 128]`` bf16 the reference runs 18 aten ops besides the rotation (on CPU the
    butterfly's ``3 log2(d) + 1`` = 22 more, 40 in all; on CUDA one Hadamard kernel, 19 launches).
    The fused path runs no aten op but the output allocation, and one Triton kernel launch. Under
    the interpreter the launch itself adds only the interpreter's copies of the kernel's arguments
    to and from its host buffers (``set_`` and ``copy_``), which a GPU launch does not run."""
    from kpool_layers.kernels import serving_quant_triton as sq

    x = torch.randn(64, 128).to(torch.bfloat16)
    assert len(count_ops(fp8.serving_index_quant, x, "ue8m0")) == 40
    assert set(interpreted["ops"]) <= {"set_", "copy_"}, interpreted["ops"]
    launches = []

    class Kernel:  # the launch recorded, not run: the host code's own ops
        def __getitem__(self, grid: tuple[int]):  # noqa: ANN204
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(hadamard_triton, "_INTERPRETED", True)  # supports() takes the CPU tensor
    monkeypatch.setattr(sq, "_serving_quant_kernel", Kernel())
    assert count_ops(sq.serving_index_quant_triton, x, "ue8m0") == []
    assert launches == [(2,)]  # ROWS = 32 rows per program


def test_rows_cover_every_rounding() -> None:
    """The rows reach each case the module docstring lists, for both formats; ``d = 128`` (served)
    on its own too."""
    totals = {fmt: collections.Counter() for fmt in fp8_format.SCALE_FORMATS}
    served = {fmt: collections.Counter() for fmt in fp8_format.SCALE_FORMATS}
    for d in DS:
        for dtype in DTYPES:
            for name, x in cases(d, dtype)[:-1]:  # the last case repeats random rows
                for fmt in fp8_format.SCALE_FORMATS:
                    counts = coverage(x, fmt)
                    totals[fmt] += counts
                    if name == "random" and dtype != torch.float16:  # amax >= 1e-4: 2**-13 .. 2**60
                        assert counts["scale exponents"] >= 60, (d, dtype, fmt, counts)
                    if d == 128 and dtype == torch.bfloat16:
                        served[fmt] += counts
    for fmt, counts in totals.items():
        expected = {"bf16 tie in x", "bf16 tie after the rotation", "e4m3 tie down, normal",
                    "e4m3 tie up, normal", "e4m3 tie down, subnormal", "e4m3 tie up, subnormal",
                    "e4m3 subnormal", "all-zero rows", "scale exponents"}
        if fmt == "amax":
            expected.add("clamped at 448")
        assert {key for key in expected if counts[key] == 0} == set(), (fmt, counts)
    for key in ("e4m3 tie down, normal", "e4m3 tie up, normal", "e4m3 subnormal"):
        assert served["ue8m0"][key] > 0, (key, served["ue8m0"])
    assert served["amax"]["clamped at 448"] > 0 and served["amax"]["e4m3 subnormal"] > 0, served["amax"]
    print({fmt: dict(c) for fmt, c in totals.items()})


def test_supports_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    from kpool_layers.kernels import serving_quant_triton as sq

    if not sq._INTERPRETED:
        with pytest.raises(ValueError, match="CUDA tensor"):
            sq.serving_index_quant_triton(torch.randn(4, 16))
    monkeypatch.setattr(hadamard_triton, "_INTERPRETED", True)  # CPU tensors: only dtype and d count
    assert all(sq.supports(torch.zeros(3, d, dtype=t)) for t in DTYPES for d in DS)
    for x in (torch.zeros(4, 16, dtype=torch.float64), torch.zeros(4, 12), torch.zeros(4, 256),
              torch.zeros(()), torch.zeros(4, 16, dtype=torch.int32)):
        assert not sq.supports(x), (x.dtype, x.shape)
    with pytest.raises(ValueError, match="scale_format"):
        sq.serving_index_quant_triton(torch.zeros(4, 16), "e8m0")


def test_serving_index_quant_routes_only_cuda_inputs_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors (and tensors that need a gradient) run the torch reference, even where the
    kernel could take them (the interpreter flag on: ``supports`` accepts CPU tensors)."""
    from kpool_layers.kernels import serving_quant_triton as sq

    monkeypatch.setattr(hadamard_triton, "_INTERPRETED", True)
    monkeypatch.setattr(sq, "serving_index_quant_triton", lambda *a: pytest.fail("kernel called"))
    x = torch.randn(5, 128)
    assert fp8.serving_index_quant(x).dtype == torch.bfloat16
    assert fp8.serving_index_quant(x.requires_grad_(), "amax").dtype == torch.float32


def _reference_on_gpu(x: torch.Tensor, scale_format: str, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """``serving_index_quant``'s torch code on the CUDA tensor (the kernel's routing off)."""
    from kpool_layers.kernels import serving_quant_triton as sq

    with monkeypatch.context() as patch:
        patch.setattr(sq, "supports", lambda x: False)
        return fp8.serving_index_quant(x, scale_format)


@pytest.mark.gpu
@pytest.mark.parametrize("scale_format", fp8_format.SCALE_FORMATS)
def test_kernel_matches_reference_on_gpu(scale_format: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5-like shapes (index q ``[tokens, b, heads, 128]`` and keys ``[tokens, 128]``, bf16) and the
    interpreter's cases, through the routing of ``serving_index_quant``."""
    g = torch.Generator().manual_seed(3)
    shaped = [("q", torch.randn(4096, 1, 32, 128, generator=g) * 4), ("k", torch.randn(4096, 128, generator=g))]
    inputs = [(name, x.to(torch.bfloat16)) for name, x in shaped]
    inputs += [(f"d={d} {NAMES[t]} {name}", x) for d in DS for t in DTYPES for name, x in cases(d, t)]
    for name, x in inputs:
        x = x.cuda()
        got = fp8.serving_index_quant(x, scale_format)
        assert same(got, _reference_on_gpu(x, scale_format, monkeypatch)), name


@pytest.mark.gpu
def test_serving_index_quant_is_one_kernel_on_gpu() -> None:
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(4096, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    fp8.serving_index_quant(x)  # compile outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fp8.serving_index_quant(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels

