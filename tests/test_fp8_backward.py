"""``precision.fp8_backward=fp8``: the FP8 dgrad and wgrad GEMMs of the FP8 linears.

* the emulate backend's dgrad / wgrad equal a hand-written quantize-dequantize reference (Python
  floats, frexp rounding) followed by the same FP32 GEMM, bit for bit;
* their error against the exact FP32 gradient is within the bound derived from e4m3's 2^-4
  relative step (derivation at :func:`_product_bound`), elementwise;
* gradient-accumulation fusion into ``main_grad`` and the FP8 weight cache give the same bits;
* the config key (profiles, errors) and the precision map's ``backward`` column;
* a tiny ``train.py precision=fp8`` run with the FP8 backward trains;
* GPU (marked): the ``torch`` backend's dgrad / wgrad against emulate.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kpool_layers.precision import fp8, weight_cache
from kpool_layers.precision.policy import Fp8Backward, PrecisionPolicy, fp8_dgrad, fp8_wgrad, quantized_matmul
from recipes.config.rules import validate
from recipes.config.schema import ConfigError, register_configs
from recipes.launch.distributed import register_resolvers
from recipes.observe.precision_map import precision_map, profile_policy
from tests.train_runner import metrics, run_train

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()
register_configs()

U = 2.0**-4
"""e4m3's relative step: 4 significant bits, round to nearest: |e4m3(v) - v| <= 2^-4 |v| for
normal v (|v| >= 2^-6)."""
SUB = 2.0**-10
"""Half the e4m3 subnormal spacing (2^-9): |e4m3(v) - v| <= 2^-10 for |v| < 2^-6."""


# ----------------------------------------------------------------------------------------------
# Hand-written reference: Python floats, ue8m0 scales by frexp, e4m3 rounding by frexp/ldexp.
# ----------------------------------------------------------------------------------------------


def _e4m3(v: float) -> float:
    """Round to e4m3 (4 significant bits, normals down to 2^-6, subnormal step 2^-9), half to even."""
    if v == 0.0:
        return 0.0
    _, e = math.frexp(v)
    ulp = max(e - 1, -6) - 3
    return math.ldexp(round(math.ldexp(v, -ulp)), ulp)


def _scale(amax: float) -> float:
    """ue8m0: the smallest power of two s with max(amax, 1e-4) / s <= 448."""
    m, e = math.frexp(max(amax, 1e-4) / 448.0)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def _qdq_rows(a: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """1x128 tiles along each row -> (quantize-dequantized values, the tile scale of each element)."""
    out, scales = [], []
    for row in a:
        q, s_row = [], []
        for j in range(0, len(row), 128):
            tile = row[j:j + 128]
            s = _scale(max(abs(v) for v in tile))
            q += [_e4m3(v / s) * s for v in tile]
            s_row += [s] * len(tile)
        out.append(q)
        scales.append(s_row)
    return out, scales


def _qdq_blocks(w: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """128x128 blocks -> (quantize-dequantized values, each element's block scale)."""
    n, k = len(w), len(w[0])
    out = [[0.0] * k for _ in range(n)]
    scales = [[0.0] * k for _ in range(n)]
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            rows, cols = range(i, min(i + 128, n)), range(j, min(j + 128, k))
            s = _scale(max(abs(w[r][c]) for r in rows for c in cols))
            for r in rows:
                for c in cols:
                    out[r][c], scales[r][c] = _e4m3(w[r][c] / s) * s, s
    return out, scales


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _operands(m: int = 130, k: int = 260, n: int = 136, seed: int = 0):
    """x [M, K], w [N, K], dy [M, N]: partial 128-tiles in every dim, a spread of magnitudes (the
    rows scaled by 2^-12 .. 2^4, so ue8m0 scales and subnormals both occur)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 5, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-12, 5, (m, 1), generator=g).float())
    return x, w, dy


def _grads(x, w, dy, fp8_backward: bool, accumulate: bool = False):
    x = x.clone().requires_grad_()
    w = torch.nn.Parameter(w.clone())
    if accumulate:
        w.main_grad = torch.zeros_like(w)
    quantized_matmul(x, w, "blockwise", "emulate", fp8_backward=fp8_backward,
                     accumulate_wgrad=accumulate).backward(dy)
    return x.grad, (w.main_grad if accumulate else w.grad)


def test_emulate_dgrad_wgrad_equal_a_hand_written_reference_bit_for_bit():
    x, w, dy = _operands()
    dx, dw = _grads(x, w, dy, fp8_backward=True)
    dy_q, _ = _qdq_rows(dy.tolist())  # dy: 1x128 tiles along N
    w_q, _ = _qdq_blocks(w.tolist())  # w: the forward's 128x128 blocks
    dyt_q, _ = _qdq_rows(dy.t().tolist())  # dy^T: 1x128 tiles along the tokens
    xt_q, _ = _qdq_rows(x.t().tolist())  # x^T: 1x128 tiles along the tokens
    assert torch.equal(dx, _t(dy_q) @ _t(w_q))
    assert torch.equal(dw, _t(dyt_q) @ _t(xt_q).t())
    # The library's own pieces give the same bits (fp8_dgrad / fp8_wgrad on emulate).
    gq, gs = fp8.quantize(dy, "blockwise", "activation")
    wq, ws = fp8.quantize(w, "blockwise", "weight")
    assert torch.equal(fp8_dgrad(gq, gs, wq, ws, "emulate"), dx)
    assert torch.equal(fp8_wgrad(*fp8.quantize(dy.t(), "blockwise", "activation"),
                                 *fp8.quantize(x.t(), "blockwise", "activation"), "emulate"), dw)


def _product_bound(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|Q(a) @ Q(b) - a @ b|`` (a [M, R], b [R, N], ``sa`` / ``sb`` each
    element's dequantization scale), in float64.

    Derivation: with a ue8m0 scale s a tile's values satisfy |v| / s <= 448 (no clamping), and e4m3
    rounding of v / s errs by at most 2^-4 |v / s| (normal) or 2^-10 (subnormal, half the 2^-9
    step); times s: |Q(v) - v| <= e(v) = 2^-4 |v| + 2^-10 s. Then per term
    |Q(a)Q(b) - ab| <= |a| e(b) + e(a) |b| + e(a) e(b) = (|a| + e(a))(|b| + e(b)) - |a||b|, summed
    over the reduction dim R; the FP32 GEMM adds at most gamma_R * sum |Q(a)||Q(b)| with
    gamma_R = R 2^-24 / (1 - R 2^-24) (any summation order), and |Q(v)| <= |v| + e(v)."""
    a, b = a.double(), b.double()
    ea, eb = U * a.abs() + SUB * sa.double(), U * b.abs() + SUB * sb.double()
    upper = (a.abs() + ea) @ (b.abs() + eb)
    r = a.shape[1]
    gamma = r * 2.0**-24 / (1 - r * 2.0**-24)
    return upper - a.abs() @ b.abs() + gamma * upper


def test_fp8_gradients_within_the_e4m3_bound_of_the_exact_gradient():
    """dx and dw against the exact FP32 gradients of the unquantized linear, dx = dy @ w and
    dw = dy^T @ x, elementwise within :func:`_product_bound`; the bound is tight enough to mean
    something: the relative Frobenius error is below 2 * (2u + u^2) = 0.26 and the FP8 backward
    errs more than the BF16 one (which rounds dy not at all, only the forward's operands)."""
    x, w, dy = _operands()
    dx, dw = _grads(x, w, dy, fp8_backward=True)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    dx_exact, dw_exact = dy64 @ w64, dy64.t() @ x64
    _, s_dy = _qdq_rows(dy.tolist())
    _, s_w = _qdq_blocks(w.tolist())
    _, s_dyt = _qdq_rows(dy.t().tolist())
    _, s_xt = _qdq_rows(x.t().tolist())
    assert ((dx.double() - dx_exact).abs() <= _product_bound(dy, _t(s_dy), w, _t(s_w))).all()
    assert ((dw.double() - dw_exact).abs() <= _product_bound(dy.t(), _t(s_dyt), x, _t(s_xt).t())).all()
    rel = [float((got.double() - ref).norm() / ref.norm()) for got, ref in ((dx, dx_exact), (dw, dw_exact))]
    assert max(rel) < 2 * (2 * U + U * U), rel
    dx_st, dw_st = _grads(x, w, dy, fp8_backward=False)
    rel_st = [float((got.double() - ref).norm() / ref.norm()) for got, ref in ((dx_st, dx_exact), (dw_st, dw_exact))]
    assert rel_st[0] < rel[0] and rel_st[1] < rel[1], (rel_st, rel)


def test_main_grad_accumulation_and_the_weight_cache_give_the_same_bits():
    """``accumulate_wgrad``: main_grad (zero) += the FP8 wgrad, the same bits as ``w.grad`` (FP32
    model: the product is not rounded); inside a step scope that keeps derived operands, two
    micro-batches give the gradients of two uncached ones."""
    x, w, dy = _operands(m=64, k=256, n=128)
    _, dw = _grads(x, w, dy, fp8_backward=True)
    _, main = _grads(x, w, dy, fp8_backward=True, accumulate=True)
    assert torch.equal(main, dw)
    p = torch.nn.Parameter(w.clone())
    expected = []
    for seed in (1, 2):
        xs = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        expected.append(torch.autograd.grad(quantized_matmul(xs, p, "blockwise", "emulate", fp8_backward=True),
                                            (xs, p), dy))
    with weight_cache.step_scope(keep_dequantized=True):
        for seed, (ex_dx, ex_dw) in zip((1, 2), expected):
            xs = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)).requires_grad_()
            got = torch.autograd.grad(quantized_matmul(xs, p, "blockwise", "emulate", fp8_backward=True), (xs, p), dy)
            assert torch.equal(got[0], ex_dx) and torch.equal(got[1], ex_dw)
        (kept,) = weight_cache._scope.weights.values()
        assert set(kept.derived) == {torch.float32}  # emulate's dgrad operand: the FP32 dequantized weight


def test_an_empty_micro_batch_through_the_fp8_backward():
    """No tokens: the forward quantizes ``x^T [K, 0]`` for the wgrad; the product is empty, the input
    gradient empty and the weight gradient zero (the empty sum), on the emulate backend."""
    x = torch.randn(0, 256, requires_grad=True)
    w = torch.randn(128, 256, requires_grad=True)
    q, scale = fp8.quantize(x.detach().t(), "blockwise", "activation")
    assert q.shape == (256, 0) and q.dtype == torch.float8_e4m3fn and scale.shape == (256, 0)
    assert fp8.dequantize(q, scale, "blockwise", "activation").shape == (256, 0)
    y = quantized_matmul(x, w, "blockwise", "emulate", fp8_backward=True)
    y.sum().backward()
    assert y.shape == (0, 128) and x.grad.shape == (0, 256) and torch.equal(w.grad, torch.zeros_like(w))


def test_fp8_backward_needs_blockwise():
    with pytest.raises(ValueError, match="precision.fp8_backward"):
        quantized_matmul(torch.zeros(2, 16), torch.zeros(4, 16), "rowwise", "emulate", fp8_backward=True)
    with pytest.raises(ValueError, match="precision.fp8_backward=fp8 with precision.recipe=tensorwise"):
        PrecisionPolicy(fp8=True, recipe="tensorwise", fp8_backward="fp8")


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["model=glm5_tiny", "data.seq_length=64", *overrides])


def test_profiles_and_config_errors():
    assert profile_policy("fp8").fp8_backward is Fp8Backward.fp8
    assert profile_policy("serving_match").fp8_backward is Fp8Backward.bf16
    assert profile_policy("bf16").fp8_backward is Fp8Backward.bf16
    with pytest.raises(Exception) as err:  # Hydra's composition error, caused by the schema's enum
        _compose(["precision=fp8", "precision.fp8_backward=int8"])
    text = str(err.value) + str(err.value.__cause__)
    assert "precision.fp8_backward" in text and "expected one of [bf16, fp8]" in text, text
    for overrides, fragment in (
        (["precision=fp8", "precision.recipe=rowwise"], "['bf16'] with precision.recipe=rowwise"),
        (["precision=bf16", "precision.fp8_backward=fp8"], "with precision.fp8=false"),
    ):
        with pytest.raises(ConfigError) as err:
            validate(_compose(overrides), 1)
        assert err.value.key == "precision.fp8_backward" and fragment in str(err.value), str(err.value)
    validate(_compose(["precision=fp8", "precision.recipe=rowwise", "precision.fp8_backward=bf16"]), 1)


@pytest.mark.parametrize("profile,grouped", [("fp8", False), ("fp8", True), ("serving_match", False)])
def test_precision_map_shows_the_backward(single_rank_parallel_state, profile, grouped):
    from recipes.config.megatron import to_transformer_config
    from recipes.config.typed import to_config
    from recipes.train.model import build_gpt_model

    composed = _compose([f"precision={profile}", "precision.backend=emulate", f"model.moe_grouped_gemm={grouped}"])
    validate(composed, 1)
    cfg = to_config(composed)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, to_transformer_config(cfg)).to(torch.bfloat16)
    rows = precision_map(model)
    for row in rows:
        if not row["quantized"]:
            assert row["backward"] == row["dtype"], row
        elif profile == "fp8" and not row["role"].startswith("moe.expert_"):
            assert row["backward"] == "fp8", row
        else:  # serving_match's backward, and the routed experts' under fp8: BF16 straight-through
            assert row["backward"] == "bfloat16", row
    assert any(r["quantized"] for r in rows)
    assert grouped == any(r["module"].endswith("experts.weight1") for r in rows)


def test_tiny_fp8_training_with_the_fp8_backward(tmp_path: Path) -> None:
    """``train.py model=glm5_tiny precision=fp8`` (emulate, FP8 dgrad / wgrad) trains: finite
    losses, the last below the first, and the precision map says ``backward: fp8``."""
    out = run_train(tmp_path, "fp8bwd", [
        "model=glm5_tiny", "precision=fp8", "precision.backend=emulate", "precision.drift.interval=0",
        "data.seq_length=64", "train.steps=6", "train.lr_warmup_steps=1", "logging.mode=disabled",
    ])
    assert "precision fp8: backend emulate" in out.stdout
    import json

    rows = json.loads((tmp_path / "fp8bwd" / "precision_map.json").read_text())
    assert any(r["backward"] == "fp8" for r in rows)
    losses = [r["loss"] for r in metrics(tmp_path / "fp8bwd") if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------------------------
# GPU: the torch backend (F.scaled_mm) against emulate.
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 768), (130, 260, 136), (4096, 576, 2048), (64, 2048, 32), (0, 256, 128)])
def test_torch_dgrad_wgrad_match_emulate_on_gpu(m, k, n):
    """``F.scaled_mm`` BlockWise1x128 x BlockWise128x128 (dgrad) and BlockWise1x128 x
    BlockWise1x128 (wgrad) against the emulate GEMMs of the same e4m3 operands. Tolerance: the
    products of dequantized operands are exact (4 + 4 significant bits, power-of-two scales), so
    the two differ by the accumulation only, plus the BF16 rounding of scaled_mm's output (2^-9
    relative). Emulate's FP32 sum errs by at most gamma_R sum |a||b| (gamma_R ~ R 2^-24, R the
    reduction length), the kernel's FP32 sum of the scaled 128-blocks likewise; inside a block
    Hopper's FP8 tensor cores accumulate with about 14 bits (DeepSeek-V3 report 3.3.2), at most
    2^-12 of the block's sum |a||b| per K=32 wgmma step (one bit of margin), four steps per block:
    |torch - emulate| <= 2^-8 |emulate| + (2^-10 + 2 R 2^-24) (|A| @ |B|)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("F.scaled_mm runs the blockwise (1x128 / 128x128) scalings on sm_90 only")
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    gq, gs = fp8.quantize(dy, "blockwise", "activation")
    wq, ws = fp8.quantize(w, "blockwise", "weight")
    gtq, gts = fp8.quantize(dy.t(), "blockwise", "activation")
    xtq, xts = fp8.quantize(x.t(), "blockwise", "activation")
    cases = (
        (fp8_dgrad(gq, gs, wq, ws, "torch"), fp8_dgrad(gq, gs, wq, ws, "emulate"),
         fp8.dequantize(gq, gs, "blockwise", "activation"), fp8.dequantize(wq, ws, "blockwise", "weight")),
        (fp8_wgrad(gtq, gts, xtq, xts, "torch"), fp8_wgrad(gtq, gts, xtq, xts, "emulate"),
         fp8.dequantize(gtq, gts, "blockwise", "activation"), fp8.dequantize(xtq, xts, "blockwise", "activation").t()),
    )
    for got, ref, a, b in cases:
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        r = a.shape[1]
        tol = 2.0**-8 * ref.abs() + (2.0**-10 + 2 * r * 2.0**-24) * (a.abs() @ b.abs())
        assert ((got.float() - ref).abs() <= tol).all()
    # Through the autograd function: both backends' gradients, same tolerance scale.
    xg, wg = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
    quantized_matmul(xg, wg, "blockwise", "torch", fp8_backward=True).backward(dy)
    xe, we = x.float().requires_grad_(), torch.nn.Parameter(w.float())
    quantized_matmul(xe, we, "blockwise", "emulate", fp8_backward=True).backward(dy.float())
    for got, ref in ((xg.grad, xe.grad), (wg.grad, we.grad)):
        scale = ref.abs().max() if ref.numel() else 0.0
        assert ((got.float() - ref).abs() <= 2.0**-7 * ref.abs() + 2.0**-7 * scale).all()
