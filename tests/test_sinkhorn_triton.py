"""The mHC mixing-matrix kernel (``kpool_layers.kernels.sinkhorn_triton``) against the torch ops
(``kpool_layers.hyper_connections.mhc.torch_mixing_matrix``, transformers' order of operations),
forward and gradient, and what it saves in launches.

Tolerance: both are FP32 computations of the same function that sum rows and columns in another
order (Triton's tree reductions, torch's own) and run ``exp`` from another library, so neither is
exact; against a float64 evaluation of the torch ops, the kernel's largest error must stay within
twice the torch FP32 ops' own largest error (the flash-attention rule: a fused kernel is as
accurate as the reference it replaces) plus ``N`` roundings of the largest value: a sum of ``N``
terms in another order differs by up to ``N - 1`` roundings, the division adds one, and the
largest error over a case's matrices (32 interpreted, 4096 on the GPU) is a sampled statistic.

On the CPU the kernel runs under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be
set before triton is imported); GPU cases are marked ``gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kpool_layers.hyper_connections.mhc import torch_mixing_matrix
from tests.interpreter import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
U32 = torch.finfo(torch.float32).eps / 2


def cases(device: str, matrices: int) -> list[tuple[str, torch.Tensor, torch.Tensor, int, float]]:
    """(name, logits FP32, upstream gradient, iters, eps): N = 1, 2, 3, 4 and 8 (3 pads to 4),
    GLM-5.3's 20 iterations and 1 and 2, logits from flat (std 0.1) to peaked softmax rows (std 8),
    leading dims and a non-contiguous input."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (1, 2, 3, 4, 8):
        for iters, eps, std in ((20, 1e-6, 1.0), (1, 1e-6, 8.0), (2, 1e-3, 0.1), (20, 1e-6, 8.0)):
            logits = torch.randn(matrices, n, n, generator=g) * std
            out.append((f"n={n} iters={iters} eps={eps} std={std}", logits, torch.randn(matrices, n, n, generator=g),
                        iters, eps))
    lead = torch.randn(2, 4, matrices // 8, 4, 4, generator=g)
    out.append(("leading dims", lead, torch.randn(lead.shape, generator=g), 20, 1e-6))
    transposed = torch.randn(matrices, 4, 4, generator=g).transpose(-1, -2)
    out.append(("non-contiguous", transposed, torch.randn(transposed.shape, generator=g), 20, 1e-6))
    return [(name, x.to(device), gy.to(device), iters, eps) for name, x, gy, iters, eps in out]


def forward_and_gradient(fn, logits: torch.Tensor, grad: torch.Tensor, iters: int,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(logits, iters, eps)`` and the gradient of ``(fn(...) * grad).sum()`` w.r.t. ``logits``."""
    x = logits.detach().clone().requires_grad_()
    y = fn(x, iters, eps)
    y.backward(grad)
    return y.detach(), x.grad


def errors(logits: torch.Tensor, grad: torch.Tensor, iters: int, eps: float, kernel) -> dict[str, tuple[float, float, float]]:
    """Per output (``forward``, ``gradient``): the kernel's and the torch FP32 ops' largest
    absolute error against float64, and the largest float64 value."""
    exact = forward_and_gradient(torch_mixing_matrix, logits.double(), grad.double(), iters, eps)
    ops = forward_and_gradient(torch_mixing_matrix, logits, grad, iters, eps)
    fused = forward_and_gradient(kernel, logits, grad, iters, eps)
    out = {}
    for i, what in enumerate(("forward", "gradient")):
        ref = exact[i]
        out[what] = (float((fused[i].double() - ref).abs().max()), float((ops[i].double() - ref).abs().max()),
                     float(ref.abs().max()))
    return out


def compare(device: str, matrices: int, reruns: bool) -> None:
    """Assert the kernel within the module docstring's bound, forward and gradient, every case of
    ``matrices`` matrices; with ``reruns`` a second run gives the same bits."""
    from kpool_layers.kernels.sinkhorn_triton import mixing_matrix

    worst = 0.0
    all_cases = cases(device, matrices)
    for name, logits, grad, iters, eps in all_cases:
        n = logits.shape[-1]
        for what, (fused, ops, largest) in errors(logits, grad, iters, eps, mixing_matrix).items():
            bound = 2 * ops + n * U32 * largest
            assert fused <= bound, f"{what} {name}: kernel error {fused:.3e} > bound {bound:.3e} (torch ops {ops:.3e})"
            worst = max(worst, fused / bound) if bound else worst
            print(f"{what} {name}: kernel {fused:.2e} torch {ops:.2e} bound {bound:.2e}")
        if reruns:
            first = forward_and_gradient(mixing_matrix, logits, grad, iters, eps)
            again = forward_and_gradient(mixing_matrix, logits, grad, iters, eps)
            assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{name}: reruns differ"
    print(f"kernel within its bound in {len(all_cases)} cases (largest error / bound {worst:.2f})")


def refusals(device: str) -> None:
    """What the kernel does not take is a ValueError naming what it needs."""
    from kpool_layers.kernels.sinkhorn_triton import mixing_matrix, supports

    for bad in (torch.zeros(3, 4, 4, dtype=torch.float64), torch.zeros(3, 9, 9), torch.zeros(3, 4, 2)):
        bad = bad.to(device)
        assert not supports(bad)
        with pytest.raises(ValueError, match=r"sinkhorn_triton needs FP32 \[\.\.\., N, N\] logits with 1 <= N <= 8"):
            mixing_matrix(bad, 20, 1e-6)
    with pytest.raises(ValueError, match="iters=0 is not allowed; allowed: >= 1"):
        mixing_matrix(torch.zeros(3, 4, 4, device=device), 0, 1e-6)


class _LaunchFree(torch.autograd.Function):
    """A stand-in for the kernel that runs no aten op (its launch is one kernel, counted apart)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return torch.empty_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        return torch.empty_like(grad), None, None


def own_launches(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> dict[str, int]:
    """Own aten ops of one HyperConnection forward + backward (hc_mult 4, 20 iterations): every
    counted op is a GPU kernel (tests.op_counts). ``kernel``: the ``mhc_mixing`` route resolved to
    the Triton kernel (a launch-free stand-in here), else to the torch ops."""
    from types import SimpleNamespace

    from kpool_layers.hyper_connections import mhc
    from kpool_layers.kernel_routes import Resolution
    from tests.op_counts import OwnOps
    from tests.test_hyper_connections import our_config

    if kernel:
        stub = SimpleNamespace(supports=lambda logits: True, mixing_matrix=_LaunchFree.apply)
        monkeypatch.setattr(mhc.MIXING_MATRIX, "_default", Resolution("mhc_mixing", "triton", stub, {}, False, None))
    else:
        monkeypatch.setattr(mhc.MIXING_MATRIX, "_default", mhc.MIXING_MATRIX.resolve())
        assert mhc.MIXING_MATRIX.default().backend == "torch"
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
OWN_FWD = 18
"""HyperConnection's forward besides the mixing matrix: the stream norm (pow, mean, add, rsqrt,
mul), the projection (mm), pre (mul, add, sigmoid, add), post (mul, add, sigmoid, mul), the mixing
logits (mul, add), the block input (mul, sum); FP32 inputs and parameters need no copies."""
OWN_BWD = 35
"""Its backward besides the mixing matrix (the gradients of those 18 ops and of the splits: stack,
two cat)."""


def test_kernel_leaves_eighteen_launches_of_the_446(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel one mHC block launches 18 + 1 kernels forward and 35 + 1 backward, against
    137 and 309 with the torch ops (per block and micro batch; GLM-5.3 has two blocks per layer)."""
    torch_ops = own_launches(monkeypatch, kernel=False)
    assert torch_ops == {"fwd": OWN_FWD + SINKHORN_FWD, "bwd": OWN_BWD + SINKHORN_BWD}
    assert own_launches(monkeypatch, kernel=True) == {"fwd": OWN_FWD, "bwd": OWN_BWD}


def test_kernel_matches_torch_ops_interpreted() -> None:
    """The interpreter cases and the launch counts in a subprocess (``TRITON_INTERPRET=1``)."""
    out = run_interpreted("import tests.test_sinkhorn_triton as t\nt.compare('cpu', 32, reruns=False); t.refusals('cpu')\n",
                          timeout=1200)
    assert "kernel within its bound in 22 cases" in out, out


@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_kernels_compile_for_hopper(n: int) -> None:
    """Both kernels compile to an sm_90 cubin on the CPU (Triton's compiler and ptxas need no GPU):
    typing errors of the compiled language that the interpreter lets pass (a name bound to two
    shapes in the branches of a runtime ``if``) fail here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpool_layers.kernels import sinkhorn_triton

    np_ = triton.next_power_of_2(n)
    sk = sinkhorn_triton
    for kernel, pointers, entries, warps in (
            (sk._forward_kernel, ["logits_ptr", "out_ptr"], sk.BLOCK_ENTRIES, sk.WARPS),
            (sk._backward_kernel, ["logits_ptr", "grad_ptr", "out_ptr"], sk.BACKWARD_BLOCK_ENTRIES, sk.BACKWARD_WARPS)):
        constants = {"ITERS": 20, "N": n, "NP": np_, "BLOCK": max(1, entries // np_**2), "LIBDEVICE": True}
        signature = {**{p: "*fp32" for p in pointers}, "M": "i32", "eps": "fp32", **{c: "constexpr" for c in constants}}
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
    assert row["tokens"] == 8 and all(row[f"{what}_torch"]["ms"] > 0 for what in ("mixing", "mix", "proj", "presum", "block"))
