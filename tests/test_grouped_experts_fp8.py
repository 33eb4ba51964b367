"""FP8 grouped experts: ``GroupedExperts`` under an FP8 policy against megatron's ``SequentialMLP``
with FP8 role linears, the fp8 profile's build and precision map, and the FP8 grouped GEMM kernel
(``kpool_layers.kernels.fp8_grouped_gemm_triton``) against the dequantized reference.

* CPU: the grouped module loops over the experts with the per-expert role GEMM, so output and
  every gradient are bit-equal to ``SequentialMLP``'s (FP32 and BF16 models, skewed routing,
  empty experts), and so are a whole glm5_tiny model's logits and gradients.
* Kernel on the CPU: Triton's interpreter runs FP8 ``tl.dot`` (e4m3 operands, FP32 result;
  triton 3.8) correctly, but converts FP32 to BF16 by truncation, so the interpreted kernel
  stores its FP32 accumulator (``out_dtype=torch.float32``) and the BF16 store is checked on a GPU.
  Its FP32 -> e4m3 conversion is not the GPU's either, so the interpreted fused path (autograd
  function, straight-through backward) is fed the reference quantization.
* Bounds (``gpu`` tests and the interpreted kernel): products of e4m3 values, and their ue8m0
  (power-of-two) scalings, are exact in FP32, so the kernel and the float64 GEMM of the dequantized
  operands differ only by accumulation and the output rounding: a 128-long block dot accumulated
  with unit roundoff ``u_block`` errs by at most ``gamma_128(u_block) sum|a b|`` over the block and
  the FP32 sum of ``ceil(K / 128)`` scaled partials adds ``gamma_{K/128}(2**-24) sum|a b|``
  (Higham 3.1, ``gamma_n(u) = n u / (1 - n u)``); the store rounds once more (``u_out``: 0 for FP32,
  ``2**-9`` for BF16 round-to-nearest). ``u_block = 2**-24`` on the CPU; on Hopper the FP8 tensor
  cores accumulate with about 14 significant bits (DeepSeek-V3 report, 3.3.2: the reason for
  promoting every 128-wide K block into FP32, as the kernel does), so ``u_block = 2**-13``.
  Two GEMMs within that bound of the reference differ by at most twice it (the per-expert
  ``torch`` backend's ``F.scaled_mm``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from kpool_layers.precision import fp8
from kpool_layers.moe import grouped_gemm
from kpool_layers.moe.experts import GroupedExperts
from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear, role_builder
from kpool_layers.precision.policy import LinearNumerics, PrecisionPolicy, Role
from tests.test_grouped_experts import config, gemm_tol, tiny_logits_and_grads

ROOT = Path(__file__).resolve().parents[1]
U32 = 2.0**-24
TOKENS_PER_EXPERT = [37, 0, 5, 90, 1, 0]  # skewed, two experts without tokens


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def build_fp8_pair(policy: PrecisionPolicy, **overrides) -> tuple[SequentialMLP, GroupedExperts]:
    """``SequentialMLP`` with the spec's FP8 role linears and ``GroupedExperts``, same weights."""
    cfg = config(num_moe_experts=len(TOKENS_PER_EXPERT), **overrides)
    cfg.precision = policy
    pgs = get_default_pg_collection()
    torch.manual_seed(0)
    submodules = MLPSubmodules(linear_fc1=role_builder(RoleColumnParallelLinear, Role.MOE_EXPERT_FC1),
                               linear_fc2=role_builder(RoleRowParallelLinear, Role.MOE_EXPERT_FC2))
    seq = SequentialMLP(cfg.num_moe_experts, cfg, submodules, pg_collection=pgs)
    grouped = GroupedExperts(cfg.num_moe_experts, cfg, pg_collection=pgs)
    grouped.load_state_dict(seq.state_dict())
    return seq, grouped


def run_both(seq: SequentialMLP, grouped: GroupedExperts, device: str, dtype: torch.dtype) -> dict[str, tuple]:
    """Output and the gradients of the tokens, probabilities, fc1 and fc2 weights of each module."""
    counts = torch.tensor(TOKENS_PER_EXPERT)
    torch.manual_seed(1)
    x = (torch.randn(int(counts.sum()), seq.config.hidden_size) * torch.logspace(-1, 1, seq.config.hidden_size))
    x, probs = x.to(device, dtype), torch.rand(x.shape[0], device=device)
    g = torch.randn_like(x)
    outs = {}
    for name, module in (("seq", seq), ("grouped", grouped)):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = module(xi, counts, pi)
        y.backward(g)
        if name == "seq":
            gw1 = torch.stack([e.linear_fc1.weight.grad for e in module.local_experts])
            gw2 = torch.stack([e.linear_fc2.weight.grad for e in module.local_experts])
        else:
            gw1, gw2 = module.weight1.grad, module.weight2.grad
        outs[name] = (y.detach(), xi.grad, pi.grad, gw1, gw2)
    return outs


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_fp8_equals_sequential_fp8_bit_for_bit(single_rank_parallel_state, dtype, recipe):
    """Hidden 192 and fc1 width 320: partial 1x128 tiles and 128x128 blocks, ragged groups."""
    model_dtype = "fp32" if dtype == torch.float32 else "bf16"
    shape = dict(hidden_size=192, moe_ffn_hidden_size=160, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    seq, grouped = build_fp8_pair(PrecisionPolicy(fp8=True, recipe=recipe, backend="emulate", dtype=model_dtype), **shape)
    assert all(n.quantized for n in grouped.numerics.values())
    outs = run_both(seq, grouped, "cpu", dtype)
    for name, ref, got in zip(("y", "dx", "dprobs", "dw1", "dw2"), outs["seq"], outs["grouped"], strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref), name
    for e in (1, 5):  # experts without tokens: zero weight gradients
        assert not outs["grouped"][3][e].any() and not outs["grouped"][4][e].any()
    unquantized = run_both(*build_fp8_pair(PrecisionPolicy(dtype=model_dtype), **shape), "cpu", dtype)
    assert not torch.equal(unquantized["grouped"][0], outs["grouped"][0])  # FP8 is no no-op


def test_fp8_profiles_build_grouped_experts_and_map_their_roles(single_rank_parallel_state):
    """The fp8 profiles pick grouped experts on GPUs (auto) and validate with them; a glm5_tiny FP8
    model built with them maps ``moe.expert_fc1/fc2`` as FP8 and computes what the
    ``SequentialMLP`` build computes (logits and every gradient bit-equal on the CPU)."""
    from recipes.config.megatron import grouped_experts, to_transformer_config
    from recipes.train.model import build_gpt_model
    from recipes.observe.precision_map import precision_map, profile_policy
    from recipes.config.rules import validate
    from tests.test_precision_profiles import _compose

    for profile in ("fp8", "serving_match"):
        assert grouped_experts(None, profile_policy(profile), on_gpu=True)
    models = {}
    for grouped in (False, True):
        cfg = _compose(["model=glm5_tiny", "data.seq_length=32", "precision=fp8", "precision.backend=emulate",
                        f"model.moe_grouped_gemm={str(grouped).lower()}"])
        validate(cfg, 1)
        tcfg = to_transformer_config(cfg)
        torch.manual_seed(0)
        models[grouped] = build_gpt_model(cfg, tcfg).to(tcfg.params_dtype)
    assert any(isinstance(m, GroupedExperts) for m in models[True].modules())
    models[True].load_state_dict(models[False].state_dict())
    rows = [r for r in precision_map(models[True]) if r["role"] in ("moe.expert_fc1", "moe.expert_fc2")]
    assert len(rows) == 2 * 3  # three MoE layers
    for row in rows:
        assert row["quantized"] and row["backend"] == "emulate" and row["dtype"] == "bfloat16", row
        weight = "weight1" if row["role"] == "moe.expert_fc1" else "weight2"
        assert row["module"].endswith(f".mlp.experts.{weight}"), row
    logits, grads = tiny_logits_and_grads(models)
    assert torch.equal(logits[True], logits[False])
    for name, got, ref in grads:
        assert (ref is None and got is None) or torch.equal(got, ref), name


def kernel_case(device: str, recipe: str) -> tuple[torch.Tensor, ...]:
    """Quantized operands of 5 experts (groups of 130, 0, 7, 256 and 1 rows; K = 320, a partial
    K block; N = 256 blockwise, 200 rowwise) and the float64 reference with ``sum |a b|``."""
    counts = torch.tensor([130, 0, 7, 256, 1])
    e, k, n = len(counts), 320, 256 if recipe == "blockwise" else 200
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), k, generator=g) * torch.logspace(-2, 1, k)
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-1, -3, n)[:, None]
    xq, xs = fp8.quantize(x.to(device), recipe, "activation")
    wq, ws = fp8.quantize(w.reshape(e * n, k).to(device), recipe, "weight")
    xd = fp8.dequantize(xq, xs, recipe, "activation").double().cpu()
    wd = fp8.dequantize(wq, ws, recipe, "weight").double().cpu().view(e, n, k)
    groups = torch.split(torch.arange(x.shape[0]), counts.tolist())
    ref = torch.cat([xd[rows] @ wd[i].t() for i, rows in enumerate(groups)])
    absprod = torch.cat([xd[rows].abs() @ wd[i].abs().t() for i, rows in enumerate(groups)])
    return xq, xs, wq.view(e, n, k), ws.view(e, -1, ws.shape[-1]), counts, ref, absprod


def kernel_bound(ref: torch.Tensor, absprod: torch.Tensor, k: int, u_block: float, u_out: float) -> torch.Tensor:
    """Elementwise bound of |kernel - reference| (module docstring)."""
    acc = (gamma(128, u_block) + gamma(-(-k // 128), U32)) * 1.01 * absprod
    return acc + u_out * (ref.abs() + acc)


def check_kernel(device: str, out_dtype: torch.dtype, u_block: float, u_out: float) -> None:
    """The kernel (counts on the host and on ``device``) within :func:`kernel_bound` of the
    reference, both recipes; rows of the empty expert do not exist, so every row is checked. Other
    tile configurations (row tiles of 64 and 256 rows: other expert schedules) give the same bits
    on a GPU, where each output's 128-wide block dots run in the same order for any tile. Under the
    interpreter ``tl.dot`` is a CPU matmul of the whole tile, whose summation order may change with
    the tile's shape and the CPU (it does on an AMD EPYC without AVX-512): there the
    other tiles are held to the same bound."""
    from kpool_layers.kernels.fp8_grouped_gemm_triton import Tiles
    from kpool_layers.kernels.fp8_grouped_gemm_triton import grouped_gemm as kernel

    for recipe in ("blockwise", "rowwise"):
        xq, xs, wq, ws, counts, ref, absprod = kernel_case(device, recipe)
        bound = kernel_bound(ref, absprod, xq.shape[1], u_block, u_out)
        for where in (counts, counts.to(device)):
            out = kernel(xq, xs, wq, ws, where, out_dtype)
            assert out.dtype == out_dtype and out.shape == ref.shape, recipe
            err = (out.double().cpu() - ref).abs()
            assert (err <= bound).all(), (recipe, float((err - bound).max()))
        for tiles in (Tiles(64, 256, 4, 3), Tiles(256, 128, 8, 3)):
            other = kernel(xq, xs, wq, ws, counts, out_dtype, tiles=tiles)
            if device == "cpu":
                assert ((other.double() - ref).abs() <= bound).all(), (recipe, tiles)
            else:
                assert torch.equal(other, out), (recipe, tiles)
    print("kernel within bounds")


def test_fp8_grouped_gemm_kernel_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = ("import torch; from tests.test_grouped_experts_fp8 import check_kernel, U32; "
            "check_kernel('cpu', torch.float32, U32, 0.0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernel within bounds" in done.stdout, done.stderr[-3000:]


def check_fused_path_interpreted() -> None:
    """``expert_linear``'s fused FP8 path (the autograd function: quantization, kernel, straight-
    through backward) against the per-expert loop on the CPU, FP32 model. The interpreter's FP8
    conversion is not the GPU's, so the fused quantization is replaced by the reference (same
    bytes on a GPU: ``tests/test_fp8_quant_triton.py``); gradients (FP32 GEMMs of the same
    dequantized operands, per expert) are bit-equal, the output is the kernel's BF16 store, which
    the interpreter truncates (``u_out = 2**-7``)."""
    from kpool_layers.kernels import fp8_quant_triton

    fp8_quant_triton.quantize = fp8.quantize  # this subprocess only
    counts = torch.tensor(TOKENS_PER_EXPERT)
    for recipe in ("blockwise", "rowwise"):
        numerics = LinearNumerics(PrecisionPolicy(fp8=True, recipe=recipe, backend="emulate", dtype="fp32"),
                                  Role.MOE_EXPERT_FC1)
        torch.manual_seed(0)
        x = torch.randn(int(counts.sum()), 192).requires_grad_()
        w = (torch.randn(len(counts), 256, 192) * 0.05).requires_grad_()
        g = torch.randn(x.shape[0], 256)
        results = {}
        for fused in (True, False):
            grouped_gemm.fused_fp8 = lambda *args, fused=fused: fused
            x.grad = w.grad = None
            y = grouped_gemm.expert_linear(x, w, counts, numerics, kernel=False)
            y.backward(g)
            results[fused] = (y.detach(), x.grad, w.grad)
        (y_f, dx_f, dw_f), (y_l, dx_l, dw_l) = results[True], results[False]
        assert torch.equal(dx_f, dx_l) and torch.equal(dw_f, dw_l), recipe
        xd = fp8.emulate(x.detach(), recipe, "activation").double()
        wd = torch.stack([fp8.emulate(w_e, recipe, "weight") for w_e in w.detach()]).double()
        groups = torch.split(torch.arange(x.shape[0]), counts.tolist())
        absprod = torch.cat([xd[rows].abs() @ wd[i].abs().t() for i, rows in enumerate(groups)])
        ref = torch.cat([xd[rows] @ wd[i].t() for i, rows in enumerate(groups)])
        bound = kernel_bound(ref, absprod, x.shape[1], U32, 2.0**-7) + kernel_bound(ref, absprod, x.shape[1], U32, 0.0)
        assert ((y_f.double() - y_l.double()).abs() <= bound).all(), recipe
    print("fused path matches")


def test_fused_fp8_path_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = "from tests.test_grouped_experts_fp8 import check_fused_path_interpreted; check_fused_path_interpreted()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "fused path matches" in done.stdout, done.stderr[-3000:]


def test_kernel_refuses_mismatched_scales():
    from kpool_layers.kernels.fp8_grouped_gemm_triton import grouped_gemm as kernel

    xq, xs, wq, ws, counts, _, _ = kernel_case("cpu", "blockwise")
    with pytest.raises(ValueError, match=r"expected \[E, N / 128, ceil\(K / 128\)\]"):
        kernel(xq, xs, wq, ws[:, :1], counts)


@pytest.mark.gpu
def test_fp8_grouped_gemm_kernel_on_gpu_against_reference_and_scaled_mm():
    from kpool_layers.kernels.fp8_grouped_gemm_triton import grouped_gemm as kernel
    from kpool_layers.precision.policy import _scaled_mm

    check_kernel("cuda", torch.bfloat16, 2.0**-13, 2.0**-9)
    # Per-expert ``_scaled_mm`` at this case's K = 320 only for blockwise (operands padded to 128):
    # cuBLASLt refuses rowwise scaling there (CUBLAS_STATUS_NOT_SUPPORTED on the H200, measured);
    # rowwise is compared with the per-expert GEMMs at K = 384 in the test below.
    for recipe in ("blockwise",):
        xq, xs, wq, ws, counts, ref, absprod = kernel_case("cuda", recipe)
        out = kernel(xq, xs, wq, ws, counts).double().cpu()
        starts = [0, *torch.cumsum(counts, 0).tolist()]
        per_expert = torch.cat([
            _scaled_mm(xq[a:b], xs[a:b], wq[i], ws[i], recipe).double().cpu()
            for i, (a, b) in enumerate(zip(starts[:-1], starts[1:]))])
        bound = kernel_bound(ref, absprod, xq.shape[1], 2.0**-13, 2.0**-9)
        assert ((out - per_expert).abs() <= 2 * bound).all(), recipe


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_expert_linear_fused_fp8_matches_the_per_expert_fp8_gemms(monkeypatch, recipe):
    """``expert_linear`` on CUDA (fused quantization + grouped FP8 GEMM, ``grouped_mm`` backward)
    against the per-expert ``torch`` backend GEMMs (``quantized_matmul``, ``SequentialMLP``'s): the
    output within twice the kernel bound, input and weight gradients (same dequantized operands,
    BF16 GEMMs with FP32 accumulation) within twice :func:`tests.test_grouped_experts.gemm_tol`."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    numerics = LinearNumerics(PrecisionPolicy(fp8=True, recipe=recipe, backend="torch"), Role.MOE_EXPERT_FC1)
    counts = torch.tensor(TOKENS_PER_EXPERT)
    torch.manual_seed(0)
    x = torch.randn(int(counts.sum()), 384, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(len(counts), 256, 384, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(x.shape[0], 256, device="cuda").to(torch.bfloat16)
    assert grouped_gemm.fused_fp8(numerics, x, w)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(grouped_gemm, "fused_fp8", lambda *args, fused=fused: fused)
        x.grad = w.grad = None
        y = grouped_gemm.expert_linear(x, w, counts, numerics, kernel=True)
        y.backward(g)
        results[fused] = (y.detach().double().cpu(), x.grad.double().cpu(), w.grad.double().cpu())
    xq, xs = fp8.quantize(x.detach(), recipe, "activation")
    xd = fp8.dequantize(xq, xs, recipe, "activation").double().cpu()
    wd = torch.stack([fp8.emulate(w_e, recipe, "weight") for w_e in w.detach()]).double().cpu()
    starts = [0, *torch.cumsum(counts, 0).tolist()]
    groups = list(zip(starts[:-1], starts[1:]))
    absprod = torch.cat([xd[a:b].abs() @ wd[i].abs().t() for i, (a, b) in enumerate(groups)])
    ref = torch.cat([xd[a:b] @ wd[i].t() for i, (a, b) in enumerate(groups)])
    gc = g.double().cpu()
    tol_dx = torch.cat([gemm_tol(gc[a:b], wd[i], 2.0**-8) for i, (a, b) in enumerate(groups)]).double()
    tol_dw = torch.stack([gemm_tol(gc[a:b].t(), xd[a:b], 2.0**-8) for a, b in groups]).double()
    (y_f, dx_f, dw_f), (y_l, dx_l, dw_l) = results[True], results[False]
    assert ((y_f - y_l).abs() <= 2 * kernel_bound(ref, absprod, x.shape[1], 2.0**-13, 2.0**-9)).all()
    assert ((dx_f - dx_l).abs() <= 2 * tol_dx).all()
    assert ((dw_f - dw_l).abs() <= 2 * tol_dw).all()
    assert not dw_f[1].any() and not dw_f[5].any()


@pytest.mark.gpu
def test_grouped_fp8_on_gpu_matches_sequential_fp8(single_rank_parallel_state, monkeypatch):
    """GroupedExperts (fused FP8 path) against SequentialMLP's FP8 role linears (``torch``
    backend), BF16, output and every gradient. Not a worst-case bound: each GEMM agrees within
    the bounds above, but a one-ulp BF16 difference of the fc1 output can round an fc2 input to the
    neighbouring e4m3 value (one e4m3 step, 2**-3 of that element) in the rare elements next to an
    e4m3 rounding boundary; 2**-5 of the largest magnitude leaves room for a few such flips per
    row while a wrong expert, scale or tile (errors of order 1) fails."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    policy = PrecisionPolicy(fp8=True, backend="torch")
    seq, grouped = build_fp8_pair(policy, hidden_size=256, moe_ffn_hidden_size=128, params_dtype=torch.bfloat16,
                                  bf16=True, use_cpu_initialization=False)
    assert grouped_gemm.fused_fp8(grouped.numerics["weight1"], torch.empty(0, device="cuda"), grouped.weight1)
    outs = run_both(seq, grouped, "cuda", torch.bfloat16)
    for name, ref, got in zip(("y", "dx", "dprobs", "dw1", "dw2"), outs["seq"], outs["grouped"], strict=True):
        assert float((got.float() - ref.float()).abs().max()) <= 2.0**-5 * float(ref.float().abs().max()), name
    assert not outs["grouped"][3][1].any() and not outs["grouped"][4][5].any()
