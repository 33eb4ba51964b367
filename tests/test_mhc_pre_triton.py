"""The mHC block-input kernels (``kpool_layers.kernels.mhc_pre_triton``) against the torch ops
(``kpool_layers.hyper_connections.mhc.torch_norm_project`` / ``torch_pre_sum``) and an exact float64
reference.

Both compute the normalised projection ``z = rsqrt(mean(x^2) + eps) (x @ fn^T)`` and the block input
``sum_n pre_n s_n`` and their gradients in FP32, in different orders, rounding to the streams' (or
``fn``'s) dtype at the same places, so neither is compared bit for bit with the other: each is held
to the error bound of that arithmetic against the exact result of the same operands. With ``u`` the
unit roundoff of the result's dtype (``2^-8`` BF16, ``2^-24`` FP32) and ``gamma_k = k 2^-24 /
(1 - k 2^-24)`` for FP32 sums of ``k`` terms, a result errs by at most ``(u + gamma_k + 2^-20) *
1.02 * sum |terms|``, with ``k`` counting every FP32 sum on its path:

* ``z``: the ``K``-term sum of squares (relative error ``gamma_K``, half of it through the square
  root) and the ``K``-term dot product: ``k = 2 K``; terms ``r |x_k| |fn_wk|``;
* ``d x = r (dz @ fn) - x r^2 (dz . z) / K``: the ``W``-term products, ``z``'s own ``2 K`` and
  ``r``'s: ``k = 3 K + W``; terms ``r |dz| |fn| + |x| r^2 (|dz| . |z|) / K``;
* ``d fn = sum_t r_t dz_t x_t``: ``k = T + K``; terms ``r |dz| |x|``;
* block input and ``d streams``: ``k = N + 1`` and 1; ``d pre`` (FP32): ``k = h + 1``.

The ``2^-20`` covers FP32's own product roundings and the ``1.02`` second-order terms. On the CPU
the kernels run under Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before
triton is imported); the kernels round to BF16 on the bits, so the interpreter rounds as a GPU does."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

CASES = [(1, (13,), 200), (2, (5, 3), 128), (3, (9,), 130), (4, (21,), 96), (4, (2, 2), 1), (8, (9,), 130)]
"""(N streams, leading dims, h): ragged token and channel counts against the kernels' blocks."""
EPS = 1e-5


def _bound(u: float, k: int, magnitude: torch.Tensor) -> torch.Tensor:
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    return (u + gamma + 2.0**-20) * 1.02 * magnitude


def _unit(dtype: torch.dtype) -> float:
    return 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24


def _operands(n: int, lead: tuple[int, ...], h: int, dtype: torch.dtype, device: str,
              seed: int) -> dict[str, torch.Tensor]:
    """Streams of spread magnitudes, ``fn`` as transformers initialises it (N(0, 0.02)), an FP32
    upstream gradient of ``z``, ``pre`` in (0, 1) and an upstream gradient of the block input."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 1, h) if h else torch.ones(0)
    w = (2 + n) * n
    ops = {"streams": (torch.randn(*lead, n, h, generator=g) * scale).to(dtype),
           "fn": (0.02 * torch.randn(w, n * h, generator=g)).to(dtype),
           "dz": torch.randn(*lead, w, generator=g),
           "pre": torch.sigmoid(torch.randn(*lead, n, generator=g)) + 1e-6,
           "g": torch.randn(*lead, h, generator=g).to(dtype)}
    return {k: v.to(device) for k, v in ops.items()}


def _grads(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _exact_norm_project(streams: torch.Tensor, fn: torch.Tensor, dz: torch.Tensor) -> tuple[list, list, list]:
    """Float64 ``z``, ``d streams``, ``d fn``, their magnitudes and FP32 sum counts ``k``."""
    n, h = streams.shape[-2:]
    k = n * h
    x = streams.double().reshape(-1, k)
    f = fn.double()
    dzd = dz.double().reshape(-1, f.shape[0])
    t = x.shape[0]
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) if k else torch.ones(t, 1, dtype=torch.float64)
    z = r * (x @ f.T)
    dx = r * (dzd @ f) - x * r.square() * (dzd * z).sum(-1, keepdim=True) / max(k, 1)
    dfn = (dzd * r).T @ x
    mag_z = r * (x.abs() @ f.abs().T)
    mag_dx = r * (dzd.abs() @ f.abs()) + x.abs() * r.square() * (dzd.abs() * mag_z).sum(-1, keepdim=True) / max(k, 1)
    mag_dfn = (dzd.abs() * r).T @ x.abs()
    return ([z.view(dz.shape), dx.view(streams.shape), dfn], [mag_z.view(dz.shape), mag_dx.view(streams.shape), mag_dfn],
            [2 * k, 3 * k + f.shape[0], t + k])


def _exact_pre_sum(pre: torch.Tensor, streams: torch.Tensor, g: torch.Tensor) -> tuple[list, list, list]:
    """Float64 block input, ``d pre``, ``d streams``, their magnitudes and FP32 sum counts ``k``."""
    p, s, gd = pre.double(), streams.double(), g.double()
    out = (p[..., None] * s).sum(-2)
    d_pre = (s * gd[..., None, :]).sum(-1)
    d_s = p[..., None] * gd[..., None, :]
    mags = [(p.abs()[..., None] * s.abs()).sum(-2), (s.abs() * gd.abs()[..., None, :]).sum(-1), d_s.abs()]
    n, h = streams.shape[-2:]
    return [out, d_pre, d_s], mags, [n + 1, h + 1, 1]


def _check(who: str, got: list[torch.Tensor], exact: list, mags: list, ks: list, units: list, where: str) -> None:
    for name, x, ref, mag, k, u in zip(("out", "d a", "d b"), got, exact, mags, ks, units):
        assert x.shape == ref.shape, f"{who} {name} {where}: {x.shape} != {ref.shape}"
        err = (x.double() - ref).abs()
        bound = _bound(u, k, mag)
        assert bool((err <= bound).all()), f"{who} {name} {where}: {float((err - bound).max())} over"


def small_chunks() -> None:
    """Set the norm-projection tiles so that every case sums in several chunks: one tile per chunk
    forward (``K``) and in ``d fn`` (tokens), the smallest tiles ``tl.dot`` takes."""
    from dataclasses import replace

    from kpool_layers.kernels import mhc_pre_triton as pre_kernels

    for key in pre_kernels.TILES:
        pre_kernels.TILES[key] = replace(pre_kernels.TILES[key], block_t=16, block_k=16, chunk=16)


def compare(device: str, reruns: bool = False) -> None:
    """Assert kernels and torch ops within their bounds of the exact results in every case."""
    from kpool_layers.hyper_connections.mhc import torch_norm_project, torch_pre_sum
    from kpool_layers.kernels import mhc_pre_triton as pre_kernels

    count = 0
    for dtype in (torch.float32, torch.bfloat16):
        u = _unit(dtype)
        for i, (n, lead, h) in enumerate(CASES):
            ops = _operands(n, lead, h, dtype, device, seed=i)
            where = f"N={n} lead={lead} h={h} {dtype}"
            exact, mags, ks = _exact_norm_project(ops["streams"], ops["fn"], ops["dz"])
            kernel = _grads(lambda s, f: pre_kernels.norm_project(s, f, EPS), [ops["streams"], ops["fn"]], ops["dz"])
            torch_ops = _grads(lambda s, f: torch_norm_project(s, f, EPS), [ops["streams"], ops["fn"]], ops["dz"])
            assert kernel[0].dtype == torch.float32 and kernel[1].dtype == dtype and kernel[2].dtype == dtype, where
            for who, got in (("kernel", kernel), ("torch", torch_ops)):
                _check(f"norm_project {who}", got, exact, mags, ks, [2.0**-24, u, u], where)
            exact, mags, ks = _exact_pre_sum(ops["pre"], ops["streams"], ops["g"])
            kernel2 = _grads(pre_kernels.pre_sum, [ops["pre"], ops["streams"]], ops["g"])
            torch2 = _grads(torch_pre_sum, [ops["pre"], ops["streams"]], ops["g"])
            assert kernel2[0].dtype == dtype and kernel2[1].dtype == torch.float32, where
            for who, got in (("kernel", kernel2), ("torch", torch2)):
                _check(f"pre_sum {who}", got, exact, mags, ks, [u, 2.0**-24, u], where)
            if reruns:
                again = _grads(lambda s, f: pre_kernels.norm_project(s, f, EPS), [ops["streams"], ops["fn"]], ops["dz"])
                again2 = _grads(pre_kernels.pre_sum, [ops["pre"], ops["streams"]], ops["g"])
                assert all(torch.equal(a, b) for a, b in zip(kernel + kernel2, again + again2)), f"rerun {where}"
            count += 1
    for lead, h in (((0,), 64), ((3,), 0)):  # no tokens, no channels
        ops = _operands(4, lead, h, torch.bfloat16, device, seed=0)
        got = _grads(pre_kernels.pre_sum, [ops["pre"], ops["streams"]], ops["g"])
        want = _grads(torch_pre_sum, [ops["pre"], ops["streams"]], ops["g"])
        assert all(a.shape == b.shape and torch.equal(a.float(), b.float()) for a, b in zip(got, want)), lead
        if h:
            got = _grads(lambda s, f: pre_kernels.norm_project(s, f, EPS), [ops["streams"], ops["fn"]], ops["dz"])
            assert got[0].shape == (*lead, 24) and not bool(got[2].any()), lead  # no tokens: d fn is 0
    print(f"kernels within their bounds in {count} cases")


def refusals(device: str) -> None:
    """What the kernels do not take is refused by name, before any launch."""
    from kpool_layers.kernels import mhc_pre_triton as pre_kernels

    ops = _operands(4, (3,), 64, torch.bfloat16, device, seed=0)
    s, fn, pre = ops["streams"], ops["fn"], ops["pre"]
    assert pre_kernels.supports_norm_project(s, fn) and pre_kernels.supports_pre_sum(pre, s)
    nine = _operands(9, (3,), 8, torch.bfloat16, device, seed=0)
    for what, args in {"fp16 streams": (s.half(), fn), "fn of another width": (s, fn[:-1]),
                       "9 streams": (nine["streams"], nine["fn"])}.items():
        assert not pre_kernels.supports_norm_project(*args), what
        with pytest.raises(ValueError, match="mhc_pre_triton.norm_project needs BF16 or FP32 streams"):
            pre_kernels.norm_project(*args, EPS)
    for what, args in {"bf16 pre": (pre.bfloat16(), s), "pre of 3 streams": (pre[..., :3], s),
                       "fp16 streams": (pre, s.half())}.items():
        assert not pre_kernels.supports_pre_sum(*args), what
        with pytest.raises(ValueError, match="mhc_pre_triton.pre_sum needs BF16 or FP32 streams"):
            pre_kernels.pre_sum(*args)


def test_kernels_match_the_exact_result_interpreted() -> None:
    out = run_interpreted("from tests.test_mhc_pre_triton import compare, refusals; compare('cpu'); refusals('cpu')")
    assert f"kernels within their bounds in {2 * len(CASES)} cases" in out, out


def test_split_sums_match_the_exact_result_interpreted() -> None:
    """The norm projection's sums in chunks of 16 columns and 16 tokens, added by the finishing
    kernels: within the same bounds (a sum's error bound does not depend on its order)."""
    out = run_interpreted("from tests.test_mhc_pre_triton import compare, small_chunks; small_chunks(); "
                          "compare('cpu')")
    assert f"kernels within their bounds in {2 * len(CASES)} cases" in out, out


def test_cpu_tensors_are_refused_without_the_interpreter() -> None:
    """Outside the interpreter the kernels take CUDA tensors only."""
    from kpool_layers.kernels import mhc_pre_triton as pre_kernels

    ops = _operands(4, (3,), 64, torch.float32, "cpu", seed=0)
    assert not pre_kernels.supports_norm_project(ops["streams"], ops["fn"])
    assert not pre_kernels.supports_pre_sum(ops["pre"], ops["streams"])


def test_hyper_connection_takes_the_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HyperConnection.forward`` computes ``z`` through the ``mhc_norm_proj`` route and the block
    input through ``mhc_pre_sum``: a kernel where its route resolved to ``triton`` and it takes the
    tensors, else the torch ops (on this CPU both routes resolve to ``torch``)."""
    from types import SimpleNamespace

    from kpool_layers.hyper_connections import mhc
    from kpool_layers.kernel_routes import Resolution
    from tests.test_hyper_connections import our_config

    assert mhc.NORM_PROJECT.resolve().backend == "torch" and mhc.PRE_SUM.resolve().backend == "torch"
    hc = mhc.HyperConnection(our_config(4))
    x = torch.randn(2, 5, 4, 16)
    calls: list[str] = []
    stub = SimpleNamespace(
        supports_norm_project=lambda s, f: True, supports_pre_sum=lambda p, s: True,
        norm_project=lambda s, f, eps: calls.append("z") or mhc.torch_norm_project(s, f, eps),
        pre_sum=lambda p, s: calls.append("sum") or torch.zeros(s.shape[:-2] + s.shape[-1:]))
    monkeypatch.setattr(mhc.NORM_PROJECT, "_default", Resolution("mhc_norm_proj", "triton", stub, {}, False, None))
    monkeypatch.setattr(mhc.PRE_SUM, "_default", Resolution("mhc_pre_sum", "triton", stub, {}, False, None))
    _, _, block_input = hc(x)
    assert calls == ["z", "sum"] and not bool(block_input.any())
    stub.supports_norm_project = stub.supports_pre_sum = lambda *args: False
    _, _, block_input = hc(x)
    assert calls == ["z", "sum"] and bool(block_input.any())  # declined: the torch ops


@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(n: int, dtype: str) -> None:
    """All seven kernels compile to an sm_90 cubin on the CPU (Triton's compiler and ptxas need no
    GPU), so what the interpreter lets pass but the compiler refuses fails here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kpool_layers.kernels import mhc_pre_triton as pre

    wp, bf16 = pre._wp((2 + n) * n), dtype == "bf16"
    fwd, bwd_x, bwd_fn = (pre.TILES[k] for k in ("proj_forward", "proj_backward_x", "proj_backward_fn"))
    blocks_h = {"BLOCK_T": pre.BLOCK_T, "BLOCK_H": pre.BLOCK_H}
    ints = {"T": "i32", "K": "i32", "W": "i32"}
    warps = {pre._norm_proj_forward: fwd.warps, pre._norm_proj_backward_x: bwd_x.warps,
             pre._norm_proj_backward_fn: bwd_fn.warps}
    cases = [(pre._norm_proj_forward, {"x_ptr": dtype, "fn_ptr": dtype, "z_ptr": "fp32", "rstd_ptr": "fp32",
                                       "part_ptr": "fp32", "sq_ptr": "fp32"},
              {**ints, "CHUNK": "i32", "eps": "fp32"},
              {"ONE": one, "WP": wp, "BLOCK_T": fwd.block_t, "BLOCK_K": fwd.block_k}) for one in (True, False)]
    cases += [(pre._norm_proj_backward_fn, {"x_ptr": dtype, "rstd_ptr": "fp32", "dz_ptr": "fp32", "dfn_ptr": dtype,
                                            "part_ptr": "fp32"}, {**ints, "CHUNK": "i32"},
               {"ONE": one, "BF16": bf16, "WP": wp, "BLOCK_T": bwd_fn.block_t, "BLOCK_K": bwd_fn.block_k})
              for one in (True, False)]
    for kernel, pointers, scalars, constants in (*cases,  # constants in each kernel's parameter order
            (pre._norm_proj_finish, {"part_ptr": "fp32", "sq_ptr": "fp32", "z_ptr": "fp32", "rstd_ptr": "fp32"},
             {**ints, "S": "i32", "eps": "fp32"}, {"WP": wp, "BLOCK_T": pre.BLOCK_T}),
            (pre._norm_proj_backward_x, {"x_ptr": dtype, "fn_ptr": dtype, "z_ptr": "fp32", "rstd_ptr": "fp32",
                                         "dz_ptr": "fp32", "dx_ptr": dtype}, ints,
             {"BF16": bf16, "WP": wp, "BLOCK_T": bwd_x.block_t, "BLOCK_K": bwd_x.block_k}),
            (pre._sum_parts, {"part_ptr": "fp32", "out_ptr": dtype}, {"S": "i32", "M": "i32"},
             {"BF16": bf16, "BLOCK": pre.FINISH_BLOCK}),
            (pre._pre_sum_forward, {"pre_ptr": "fp32", "s_ptr": dtype, "out_ptr": dtype}, {"T": "i32", "H": "i32"},
             {"N": n, "BF16": bf16, **blocks_h}),
            (pre._pre_sum_backward, {"pre_ptr": "fp32", "s_ptr": dtype, "g_ptr": dtype, "d_pre_ptr": "fp32",
                                     "d_s_ptr": dtype}, {"T": "i32", "H": "i32"},
             {"N": n, "NP": triton.next_power_of_2(n), "BF16": bf16, **blocks_h})):
        signature = {**{p: f"*{t}" for p, t in pointers.items()}, **scalars, **{c: "constexpr" for c in constants}}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps.get(kernel, 4)})
        assert compiled.asm["cubin"], kernel


@pytest.mark.gpu
def test_kernels_match_the_exact_result_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    compare("cuda", reruns=True)
    refusals("cuda")
    small_chunks()
    compare("cuda", reruns=True)
