"""The mHC stream-mixing kernels (``kpool_layers.kernels.mhc_mix_triton``) against the torch ops
(``kpool_layers.hyper_connections.mhc.torch_mix_streams``) and an exact float64 reference.

Both compute ``post (x) block_output + comb^T @ streams`` and its four gradients with roundings to
the streams' dtype at the same places and FP32 sums in different orders, so neither is compared
bit for bit with the other: each is held to the error bound of that arithmetic against the exact
result of the same rounded operands (``p = R(post)``, ``C = R(comb)``, BF16 or FP32
``block_output``/``streams``/upstream gradient, all exact in float64). With ``u`` the unit
roundoff of the dtype (``2^-8`` BF16, ``2^-24`` FP32) and ``gamma_k = k 2^-24 / (1 - k 2^-24)``
for an FP32 sum of ``k`` products (any order), each result, a rounding ``R`` of a sum of ``k``
terms that may each be rounded once more, errs by at most ``(2u + gamma_k + 2^-23) * 1.01 *
sum |terms|`` (the ``2^-23`` for FP32's own product and add roundings where ``R`` is the identity,
the ``1.01`` for second-order terms): ``k = N`` for the output, ``d block_output`` and ``d streams``,
``k = h`` for ``d post`` and ``d comb``.

On the CPU the kernels run under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must
be set before triton is imported); the kernel rounds to BF16 on the bits, so the interpreter rounds
as a GPU does."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

CASES = [(1, (13,), 200), (2, (5, 3), 128), (3, (9,), 130), (4, (13,), 200), (4, (2, 2), 1), (8, (9,), 130)]
"""(N streams, leading dims, h): ragged token and channel counts against the kernels' blocks."""


def _bound(u: float, k: int, magnitude: torch.Tensor) -> torch.Tensor:
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    return (2 * u + gamma + 2.0**-23) * 1.01 * magnitude


def _operands(n: int, lead: tuple[int, ...], h: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """post in (0, 2) as ``2 sigmoid``, comb positive with unit columns, block output and streams
    of spread magnitudes, an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    post = 2 * torch.sigmoid(torch.randn(*lead, n, generator=g))
    comb = torch.rand(*lead, n, n, generator=g) + 0.01
    comb = comb / comb.sum(-2, keepdim=True)
    scale = torch.logspace(-2, 1, h)
    block_output = (torch.randn(*lead, h, generator=g) * scale).to(dtype)
    streams = (torch.randn(*lead, n, h, generator=g) * scale).to(dtype)
    grad = torch.randn(*lead, n, h, generator=g).to(dtype)
    return [x.to(device) for x in (post, comb, block_output, streams, grad)]


def _run(fn, post, comb, block_output, streams, grad) -> list[torch.Tensor]:  # noqa: ANN001
    """``fn``'s output and the gradients of ``(out * grad).sum()`` w.r.t. the four operands."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (post, comb, block_output, streams)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _exact(post, comb, block_output, streams, grad, dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
    """Float64 output and gradients of the rounded operands, and the magnitudes ``sum |terms|`` the
    bounds scale (output, d post, d comb, d block_output, d streams)."""
    p, c = (x.to(dtype).double() for x in (post, comb))
    bo, s, g = (x.double() for x in (block_output, streams, grad))
    pbo = p[..., :, None] * bo[..., None, :]
    out = pbo + torch.einsum("...nm,...nc->...mc", c, s)
    d_post = (g * bo[..., None, :]).sum(-1)
    d_comb = torch.einsum("...mc,...nc->...nm", g, s)
    d_bo = (p[..., :, None] * g).sum(-2)
    d_s = torch.einsum("...nm,...mc->...nc", c, g)
    mags = [pbo.abs() + torch.einsum("...nm,...nc->...mc", c.abs(), s.abs()),
            (g.abs() * bo.abs()[..., None, :]).sum(-1), torch.einsum("...mc,...nc->...nm", g.abs(), s.abs()),
            (p.abs()[..., :, None] * g.abs()).sum(-2), torch.einsum("...nm,...mc->...nc", c.abs(), g.abs())]
    return [out, d_post, d_comb, d_bo, d_s], mags


def compare(device: str, reruns: bool = False) -> None:
    """Assert kernel and torch ops within their bounds of the exact results in every case."""
    from kpool_layers.hyper_connections.mhc import torch_mix_streams
    from kpool_layers.kernels import mhc_mix_triton

    names = ("out", "d post", "d comb", "d block_output", "d streams")
    count = 0
    for dtype, u in ((torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)):
        for i, (n, lead, h) in enumerate(CASES):
            ops = _operands(n, lead, h, dtype, device, seed=i)
            kernel = _run(mhc_mix_triton.mix_streams, *ops)
            torch_ops = _run(torch_mix_streams, *ops)
            exact, mags = _exact(*ops, dtype)
            ks = (n, h, h, n, n)
            for name, got, want, ref, mag, k in zip(names, kernel, torch_ops, exact, mags, ks):
                where = f"{name} N={n} lead={lead} h={h} {dtype}"
                assert got.dtype == want.dtype and got.shape == want.shape, where
                bound = _bound(u, k, mag)
                for who, x in (("kernel", got), ("torch", want)):
                    err = (x.double() - ref).abs()
                    assert bool((err <= bound).all()), f"{who} {where}: {float((err - bound).max())} over"
            if reruns:
                again = _run(mhc_mix_triton.mix_streams, *ops)
                assert all(torch.equal(a, b) for a, b in zip(kernel, again)), f"rerun N={n} {dtype}"
            count += 1
    for lead, h in (((0,), 64), ((3,), 0)):  # no tokens, no channels
        ops = _operands(4, lead, h, torch.bfloat16, device, seed=0)
        got = _run(mhc_mix_triton.mix_streams, *ops)
        want = _run(torch_mix_streams, *ops)
        assert all(a.shape == b.shape and torch.equal(a.float(), b.float()) for a, b in zip(got, want)), lead
    print(f"kernel within its bound in {count} cases")


def refusals(device: str) -> None:
    """What the kernel does not take is refused by name, before any launch."""
    from kpool_layers.kernels import mhc_mix_triton

    post, comb, bo, s, _ = _operands(4, (3,), 64, torch.bfloat16, device, seed=0)
    assert mhc_mix_triton.supports(post, comb, bo, s)
    bad = {"fp16 streams": (post, comb, bo.half(), s.half()), "bf16 post": (post.bfloat16(), comb, bo, s),
           "9 streams": (*_operands(9, (3,), 64, torch.bfloat16, device, seed=0)[:4],),
           "mismatched h": (post, comb, bo[..., :32], s)}
    for what, args in bad.items():
        assert not mhc_mix_triton.supports(*args), what
        with pytest.raises(ValueError, match="mhc_mix_triton needs FP32 post"):
            mhc_mix_triton.mix_streams(*args)


def test_kernels_match_the_exact_result_interpreted() -> None:
    out = run_interpreted("from tests.test_mhc_mix_triton import compare, refusals; compare('cpu'); refusals('cpu')")
    assert f"kernel within its bound in {2 * len(CASES)} cases" in out, out


def test_cpu_tensors_are_refused_without_the_interpreter() -> None:
    """Outside the interpreter the kernel takes CUDA tensors only (this process imports triton
    without ``TRITON_INTERPRET``)."""
    from kpool_layers.kernels import mhc_mix_triton

    post, comb, bo, s, _ = _operands(4, (3,), 64, torch.float32, "cpu", seed=0)
    assert not mhc_mix_triton.supports(post, comb, bo, s)


def test_mix_streams_takes_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mhc.mix_streams`` (what ``HyperConnectedTransformerLayer`` calls after each block) runs the
    ``mhc_stream_mix`` route's kernel where the route resolved to ``triton`` and the kernel takes
    the tensors, else the torch ops; on this CPU the route resolves to ``torch``."""
    from types import SimpleNamespace

    from kpool_layers.hyper_connections import layer, mhc
    from kpool_layers.kernel_routes import Resolution

    assert layer.mix_streams is mhc.mix_streams and mhc.STREAM_MIX.resolve().backend == "torch"
    post, comb, bo, s, _ = _operands(4, (3,), 16, torch.float32, "cpu", seed=0)
    calls = []
    for takes in (True, False):
        stub = SimpleNamespace(supports=lambda *args, takes=takes: takes,
                               mix_streams=lambda *args: calls.append(len(args)) or torch.zeros_like(args[3]))
        monkeypatch.setattr(mhc.STREAM_MIX, "_default", Resolution("mhc_stream_mix", "triton", stub, {}, False, None))
        got = mhc.mix_streams(post, comb, bo, s)
        want = torch.zeros_like(s) if takes else mhc.torch_mix_streams(post, comb, bo, s)
        assert torch.equal(got, want), takes
    assert calls == [4]


@pytest.mark.parametrize("n", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(n: int, dtype: str) -> None:
    """Both kernels compile to an sm_90 cubin on the CPU (Triton's compiler and ptxas need no GPU),
    so what the interpreter lets pass but the compiler refuses fails here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpool_layers.kernels import mhc_mix_triton as mix

    common = {"N": n, "NP": triton.next_power_of_2(n), "BF16": dtype == "bf16"}
    for kernel, pointers, blocks, warps in (
            (mix._forward_kernel, {"post_ptr": "fp32", "comb_ptr": "fp32", "bo_ptr": dtype, "s_ptr": dtype,
                                   "out_ptr": dtype}, (mix.BLOCK_T, mix.BLOCK_H), mix.WARPS),
            (mix._backward_kernel, {"post_ptr": "fp32", "comb_ptr": "fp32", "bo_ptr": dtype, "s_ptr": dtype,
                                    "g_ptr": dtype, "d_post_ptr": "fp32", "d_comb_ptr": "fp32", "d_bo_ptr": dtype,
                                    "d_s_ptr": dtype}, (mix.BACKWARD_BLOCK_T, mix.BACKWARD_BLOCK_H),
             mix.BACKWARD_WARPS)):
        constants = {**common, "BLOCK_T": blocks[0], "BLOCK_H": blocks[1]}
        signature = {**{p: f"*{t}" for p, t in pointers.items()}, "T": "i32", "H": "i32",
                     **{c: "constexpr" for c in constants}}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], kernel


@pytest.mark.gpu
def test_kernels_match_the_exact_result_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    compare("cuda", reruns=True)
    refusals("cuda")
