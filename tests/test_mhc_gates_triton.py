"""The mHC gates kernel (``kpool_layers.kernels.mhc_gates_triton``) against the torch ops
(``kpool_layers.hyper_connections.mhc.torch_gates``, transformers' order of operations), forward and
every gradient, and what it saves in launches.

Tolerance, per token outputs (``pre``, ``post``, ``comb``, ``d z``): both are FP32 computations of the
same function that sum rows and columns in another order (Triton's tree reductions, torch's own)
and run ``exp`` from another library, so neither is exact; against a float64 evaluation of the
torch ops, the kernel's largest error must stay within twice the torch FP32 ops' own largest error
(the flash-attention rule: a fused kernel is as accurate as the reference it replaces) plus ``N``
roundings of the largest value: a sum of ``N`` terms in another order differs by up to ``N - 1``
roundings, the division adds one, and the largest error over a case's tokens is a sampled statistic.

The parameter gradients (``d base``, ``d scale``) are sums over tokens of the same ``dy`` whose
products with the scale the kernel returns as ``d z``: they are checked against the float64 sums of
the kernel's own ``dy = d z / scale`` (``* z`` for ``d scale``), within the summation's bound
``(c + 2) u sum |term|``: ``c`` additions on the longest chain (a program's tree over ``BLOCK``
tokens, the programs in order, a group's tree over ``N^2`` columns), one rounding of ``dy * scale``
and one of ``dy * z``. With BF16 parameters they are the FP32 sums rounded once (to nearest even).

On the CPU the kernels run under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be
set before triton is imported); GPU cases are marked ``gpu``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kpool_layers.hyper_connections.mhc import torch_gates
from tests.interpreter import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
U32 = torch.finfo(torch.float32).eps / 2
OUTPUTS = ("pre", "post", "comb", "d z")


def cases(device: str, tokens: int) -> list[tuple[str, int, int, float, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, n, iters, eps, z FP32, base, scale): N = 1, 2, 3, 4 and 8 (3 pads to 4), GLM-5.3's 20
    iterations and 1 and 2, projections from flat (std 0.1) to peaked (std 8), leading dims and a
    non-contiguous ``z``."""
    g = torch.Generator().manual_seed(0)
    out = []

    def params(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn((2 + n) * n, generator=g), 0.5 + torch.rand(3, generator=g)

    for n in (1, 2, 3, 4, 8):
        for iters, eps, std in ((20, 1e-6, 1.0), (1, 1e-6, 8.0), (2, 1e-3, 0.1), (20, 1e-6, 8.0)):
            z = torch.randn(tokens, (2 + n) * n, generator=g) * std
            out.append((f"n={n} iters={iters} eps={eps} std={std}", n, iters, eps, z, *params(n)))
    out.append(("leading dims", 4, 20, 1e-6, torch.randn(2, tokens // 2, 24, generator=g), *params(4)))
    out.append(("non-contiguous", 4, 20, 1e-6, torch.randn(24, tokens, generator=g).t(), *params(4)))
    return [(name, n, iters, eps, z.to(device), b.to(device), s.to(device)) for name, n, iters, eps, z, b, s in out]


def forward_and_gradients(fn, z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                          eps: float, seed: int = 1) -> list[torch.Tensor]:
    """``pre, post, comb`` of ``fn`` and the gradients of ``sum(pre * g1 + post * g2 + comb * g3)``
    (fixed random ``g``) w.r.t. ``z``, ``base`` and ``scale``."""
    leaves = [x.detach().clone().requires_grad_() for x in (z, base, scale)]
    outs = fn(*leaves, n, iters, eps)
    g = torch.Generator().manual_seed(seed)
    sum(((y * torch.randn(y.shape, generator=g).to(y)).sum() for y in outs)).backward()
    return [y.detach() for y in outs] + [x.grad for x in leaves]


def _chain(tokens: int, n: int) -> int:
    """Additions on the longest chain of the kernel's parameter sums (module docstring)."""
    from kpool_layers.kernels import mhc_gates_triton as kern

    block = kern._block(n, kern.BACKWARD_BLOCK_ENTRIES)
    return math.ceil(math.log2(block)) + math.ceil(tokens / block) + math.ceil(math.log2(n * n)) + 1


def parameter_sum_errors(z: torch.Tensor, scale: torch.Tensor, n: int, fused: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """``d base`` and ``d scale`` of the kernel against the float64 sums of its own ``dy``: (error,
    bound) each (module docstring)."""
    w = (2 + n) * n
    zz = z.double().reshape(-1, w)
    group = torch.tensor([0] * n + [1] * n + [2] * (n * n), device=z.device)
    dy = fused[3].double().reshape(-1, w) / scale.double()[group]
    chain = _chain(zz.shape[0], n) + 2
    out = {}
    for what, terms, got in (("d base", dy, fused[4]), ("d scale", dy * zz, fused[5])):
        if what == "d scale":
            exact = torch.stack([terms[:, group == k].sum() for k in range(3)])
            size = torch.stack([terms[:, group == k].abs().sum() for k in range(3)])
        else:
            exact, size = terms.sum(0), terms.abs().sum(0)
        out[what] = (float((got.double() - exact).abs().max()), float((chain * U32 * size).max()))
    return out


def compare(device: str, tokens: int, reruns: bool) -> None:
    """Assert the kernels within the module docstring's bounds, every output and gradient, every
    case of ``tokens`` tokens; BF16 parameters' gradients the FP32 ones rounded; with ``reruns`` a
    second run gives the same bits."""
    from kpool_layers.kernels.mhc_gates_triton import gates

    worst = 0.0
    all_cases = cases(device, tokens)
    for name, n, iters, eps, z, base, scale in all_cases:
        exact = forward_and_gradients(torch_gates, z.double(), base.double(), scale.double(), n, iters, eps)
        ops = forward_and_gradients(torch_gates, z, base, scale, n, iters, eps)
        fused = forward_and_gradients(gates, z, base, scale, n, iters, eps)
        checks = {}
        for what, ref, op, got in zip(OUTPUTS, exact, ops, fused):
            op_err = float((op.double() - ref).abs().max())
            checks[what] = (float((got.double() - ref).abs().max()), 2 * op_err + n * U32 * float(ref.abs().max()))
        checks.update(parameter_sum_errors(z, scale, n, fused))
        for what, (err, bound) in checks.items():
            assert err <= bound, f"{what} {name}: kernel error {err:.3e} > bound {bound:.3e}"
            worst = max(worst, err / bound) if bound else worst
        bf16 = [x.to(torch.bfloat16) for x in (base, scale)]
        rounded = forward_and_gradients(gates, z, *bf16, n, iters, eps)
        same_values = forward_and_gradients(gates, z, *(x.float() for x in bf16), n, iters, eps)
        assert all(torch.equal(a, b) for a, b in zip(rounded[:4], same_values[:4])), name
        assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(rounded[4:], same_values[4:])), name
        if reruns:
            again = forward_and_gradients(gates, z, base, scale, n, iters, eps)
            assert all(torch.equal(a, b) for a, b in zip(fused, again)), f"{name}: reruns differ"
    print(f"kernel within its bound in {len(all_cases)} cases (largest error / bound {worst:.2f})")


def refusals(device: str) -> None:
    """What the kernel does not take is a ValueError naming what it needs."""
    from kpool_layers.kernels.mhc_gates_triton import gates, supports

    base, scale = torch.zeros(24, device=device), torch.ones(3, device=device)
    for z, n in ((torch.zeros(3, 24, dtype=torch.float64), 4), (torch.zeros(3, 90), 9), (torch.zeros(3, 20), 4)):
        z = z.to(device)
        b = torch.zeros(z.shape[-1], device=device)
        assert not supports(z, b, scale, n)
        with pytest.raises(ValueError, match=r"mhc_gates_triton needs FP32 z \[\.\.\., \(2 \+ N\) N\], base"):
            gates(z, b, scale, n, 20, 1e-6)
    with pytest.raises(ValueError, match="iters=0 is not allowed; allowed: >= 1"):
        gates(torch.zeros(3, 24, device=device), base, scale, 4, 0, 1e-6)


class _LaunchFree(torch.autograd.Function):
    """A stand-in for the kernel that runs no aten op (its launches are counted apart)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lead = z.shape[:-1]
        return z.new_empty(*lead, n), z.new_empty(*lead, n), z.new_empty(*lead, n, n)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN205
        lead = grads[0].shape[:-1]
        n = grads[0].shape[-1]
        return grads[0].new_empty(*lead, (2 + n) * n), grads[0].new_empty((2 + n) * n), grads[0].new_empty(3), None, None, None


def own_launches(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> dict[str, int]:
    """Own aten ops of one HyperConnection forward + backward (hc_mult 4, 20 iterations; the stream
    norm, projection and block input on their torch routes): every counted op is a GPU kernel
    (tests.op_counts). ``kernel``: the ``mhc_gates`` route resolved to the Triton kernel (a
    launch-free stand-in here), else to the torch ops."""
    from types import SimpleNamespace

    from kpool_layers.hyper_connections import mhc
    from kpool_layers.kernel_routes import Resolution
    from tests.op_counts import OwnOps
    from tests.test_hyper_connections import our_config

    if kernel:
        stub = SimpleNamespace(supports=lambda *args: True, gates=_LaunchFree.apply)
        monkeypatch.setattr(mhc.GATES, "_default", Resolution("mhc_gates", "triton", stub, {}, False, None))
    else:
        monkeypatch.setattr(mhc.GATES, "_default", mhc.GATES.resolve())
        assert mhc.GATES.default().backend == "torch"
    hc = mhc.HyperConnection(our_config(4))
    x = torch.randn(2, 5, 4, 16, requires_grad=True)
    with OwnOps(hc) as ops:
        post, comb, block_input = hc(x)
        (post.sum() + comb.sum() + block_input.sum()).backward()
    return {"fwd": ops.counts[("", "fwd")], "bwd": ops.counts[("", "bwd")]}


ITERS = 20
SINKHORN_FWD = 2 + (2 * ITERS - 1) * 3
"""The torch ops of the mixing matrix, forward: softmax and its ``+ eps``, then ``2 iters - 1``
normalisations of a sum, an add and a divide (119)."""
SINKHORN_BWD = 1 + (2 * ITERS - 1) * 7
"""Their backward: per normalisation the divide's two gradients (two div, a neg and a mul, a div
by the divisor), the sum's and the add's (a sum, an add of the two paths), 7 ops; the softmax's
backward (274)."""
GATES_FWD = 10
"""The gates' other torch ops, forward: pre (mul, add, sigmoid, add), post (mul, add, sigmoid,
mul), the mixing logits (mul, add); FP32 parameters need no copies."""
GATES_BWD = 18
"""Their backward: the gradients of those 10 ops and of the splits (a stack, two cat)."""
OWN_FWD = 8
"""HyperConnection's forward besides the gates: the stream norm (pow, mean, add, rsqrt, mul), the
projection (mm), the block input (mul, sum)."""
OWN_BWD = 17
"""Its backward besides the gates: the projection's two mm, the block input's (two mul, a sum), the
norm's (pow, mul, mul for rsqrt; div for mean; pow, mul, mul for the square; mul, mul, sum for the
product) and the add of the streams' two gradients."""


def test_kernel_leaves_25_of_the_446_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel one mHC block launches 8 + 1 kernels forward and 17 + 2 backward, against
    137 and 309 with the torch ops (per block and micro batch; GLM-5.3 has two blocks per layer)."""
    torch_ops = own_launches(monkeypatch, kernel=False)
    assert torch_ops == {"fwd": OWN_FWD + GATES_FWD + SINKHORN_FWD, "bwd": OWN_BWD + GATES_BWD + SINKHORN_BWD}
    assert own_launches(monkeypatch, kernel=True) == {"fwd": OWN_FWD, "bwd": OWN_BWD}


def test_kernel_matches_torch_ops_interpreted() -> None:
    """The interpreter cases and the refusals in a subprocess (``TRITON_INTERPRET=1``)."""
    out = run_interpreted("import tests.test_mhc_gates_triton as t\nt.compare('cpu', 32, reruns=False); "
                          "t.refusals('cpu')\n", timeout=1200)
    assert "kernel within its bound in 22 cases" in out, out


@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_kernels_compile_for_hopper(n: int) -> None:
    """The three kernels compile to an sm_90 cubin on the CPU (Triton's compiler and ptxas need no
    GPU): typing errors of the compiled language that the interpreter lets pass (a name bound to
    two shapes in the branches of a runtime ``if``) fail here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpool_layers.kernels import mhc_gates_triton as kern

    np_ = triton.next_power_of_2(n)
    params = {"base_ptr": "*bf16", "scale_ptr": "*bf16"}
    launches = (
        (kern._forward_kernel, {"z_ptr": "*fp32", **params, "pre_ptr": "*fp32", "post_ptr": "*fp32",
                                "comb_ptr": "*fp32", "M": "i32", "eps": "fp32"},
         {"ITERS": 20, "N": n, "NP": np_, "BLOCK": kern._block(n, kern.BLOCK_ENTRIES), "LIBDEVICE": True}, kern.WARPS),
        (kern._backward_kernel, {"z_ptr": "*fp32", **params, "dpre_ptr": "*fp32", "dpost_ptr": "*fp32",
                                 "dcomb_ptr": "*fp32", "dz_ptr": "*fp32", "part_ptr": "*fp32", "M": "i32", "eps": "fp32"},
         {"ITERS": 20, "N": n, "NP": np_, "BLOCK": kern._block(n, kern.BACKWARD_BLOCK_ENTRIES), "LIBDEVICE": True},
         kern.BACKWARD_WARPS),
        (kern._finish_kernel, {"part_ptr": "*fp32", "dbase_ptr": "*bf16", "dscale_ptr": "*bf16", "P": "i32"},
         {"N": n, "WP": triton.next_power_of_2((2 + n) * n), "BASE_BF16": True, "SCALE_BF16": True}, kern.FINISH_WARPS))
    for kernel, pointers, constants, warps in launches:
        signature = {**pointers, **{c: "constexpr" for c in constants}}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], kernel


@pytest.mark.gpu
def test_kernel_matches_torch_ops_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    compare("cuda", 4096, reruns=True)
    refusals("cuda")


def test_benchmark_script_runs_on_cpu(tmp_path: Path) -> None:
    """``scripts/bench/mhc.py --small`` (the torch route on the CPU) writes its rows."""
    import json

    out = tmp_path / "mhc.json"
    # no inherited rendezvous: a group this process still holds may own that MASTER_PORT
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "mhc.py", "--small", "--tokens", "8", "--repeats", "1", "--out", str(out)],
                            cwd=ROOT / "scripts" / "bench", env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 8 and all(row[f"{what}_torch"]["ms"] > 0 for what in ("gates", "mix", "proj", "presum", "block"))
