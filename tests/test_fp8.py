"""FP8 numerics: hand-worked values, an independent pure-Python implementation, edge cases."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from kpool_layers.precision import fp8
from kpool_layers.precision import fp8_format

# ----------------------------------------------------------------------------------------------
# Independent reference: Python floats, frexp/ldexp rounding, explicit Hadamard matrix.
# ----------------------------------------------------------------------------------------------


def _round_float(x: float, mantissa_bits: int, min_normal_exp: int) -> float:
    """Round x to a binary format with ``mantissa_bits`` significant bits (implicit bit included)
    and normal numbers down to 2**min_normal_exp, round-half-to-even, no overflow handling."""
    if x == 0.0:
        return 0.0
    _, e = math.frexp(x)  # |x| in [2**(e-1), 2**e)
    ulp_exp = max(e - 1, min_normal_exp) - (mantissa_bits - 1)
    return math.ldexp(round(math.ldexp(x, -ulp_exp)), ulp_exp)  # round() is half-to-even


def _bf16(x: float) -> float:
    return _round_float(x, 8, -126)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _e4m3(x: float) -> float:
    return max(-448.0, min(448.0, _round_float(max(-448.0, min(448.0, x)), 4, -6)))


def _ue8m0_scale(amax: float) -> float:
    m, e = math.frexp(max(amax, 1e-4) / 448.0)  # ratio = m * 2**e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def _hadamard(n: int) -> list[list[int]]:
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return h


def _ref_serving_quant(vec: list[float]) -> list[float]:
    """bf16 -> (x @ H) * fp32(128**-0.5) in exact arithmetic then fp32 -> bf16 -> e4m3/ue8m0."""
    h = _hadamard(128)
    v = [_bf16(a) for a in vec]
    scale = _f32(128**-0.5)
    rot = [_bf16(_f32(sum(v[i] * h[i][j] for i in range(128)) * scale)) for j in range(128)]
    s = _ue8m0_scale(max(abs(a) for a in rot))
    return [_e4m3(a / s) * s for a in rot]


# ----------------------------------------------------------------------------------------------
# Hand-worked examples
# ----------------------------------------------------------------------------------------------


def test_scales_by_hand():
    # amax 3: 3/448 = 0.0067 = 2**-7.22 -> ue8m0 2**-7; amax 448 -> 1 exactly; amax 0 -> clamp 1e-4:
    # 1e-4/448 = 2.23e-7 = 2**-22.1 -> 2**-22.
    amax = torch.tensor([3.0, 448.0, 0.0])
    assert fp8.compute_scale(amax, "ue8m0").tolist() == [2.0**-7, 1.0, 2.0**-22]
    torch.testing.assert_close(
        fp8.compute_scale(amax, "amax"), torch.tensor([3 / 448, 1.0, 1e-4 / 448]), rtol=1e-6, atol=0
    )
    with pytest.raises(ValueError, match="scale_format"):
        fp8.compute_scale(amax, "e8m0")


def test_blockwise_activation_by_hand():
    # One partial 1x128 tile [1, -3, 0.1, 0]: amax 3 -> scale 2**-7 = 1/128.
    # x / s = [128, -384, 12.8, 0]; e4m3 in [8, 16) has step 1 -> 12.8 rounds to 13.
    # Dequantized: [1, -3, 13/128 = 0.1015625, 0].
    x = torch.tensor([[1.0, -3.0, 0.1, 0.0]])
    q, s = fp8.quantize(x, "blockwise", "activation")
    assert q.dtype == torch.float8_e4m3fn and s.tolist() == [[2.0**-7]]
    assert q.float().tolist() == [[128.0, -384.0, 13.0, 0.0]]
    assert fp8.emulate(x, "blockwise", "activation").tolist() == [[1.0, -3.0, 0.1015625, 0.0]]


def test_blockwise_weight_block_scales_by_hand():
    # w [2, 130]: 128x128 blocks -> column blocks [0, 128) and [128, 130).
    # Block 0 amax 1.0 -> 1/448 = 2**-8.8 -> 2**-8; block 1 amax 0.5 -> 2**-9.8 -> 2**-9.
    w = torch.zeros(2, 130)
    w[1, 5] = -1.0
    w[0, 129] = 0.5
    q, s = fp8.quantize(w, "blockwise", "weight")
    assert s.tolist() == [[2.0**-8, 2.0**-9]]
    assert q.float()[1, 5] == -256.0 and q.float()[0, 129] == 256.0
    torch.testing.assert_close(fp8.dequantize(q, s, "blockwise", "weight"), w, rtol=0, atol=0)


def test_serving_index_quant_by_hand():
    # e0 @ H_128 = all ones; * 128**-0.5 = 0.0883883; bf16 keeps 8 significant bits:
    # 0.0883883 = 1.41421 * 2**-4, 1.41421 * 128 = 181.02 -> 181/128 -> 0.08837890625.
    # amax/448 = 1.973e-4 = 2**-12.31 -> scale 2**-12; 0.08837890625 * 4096 = 362.0, and e4m3 in
    # [256, 512) has step 32 -> 352 (|362-352| = 10 < 22). 352 * 2**-12 = 0.0859375.
    e0 = torch.zeros(128)
    e0[0] = 1.0
    assert fp8.serving_index_quant(e0).tolist() == [0.0859375] * 128
    # amax scale: x / s = 448 -> dequantizes to the BF16 value itself.
    torch.testing.assert_close(
        fp8.serving_index_quant(e0, "amax"), torch.full((128,), 0.08837890625), rtol=1e-6, atol=0
    )


def test_serving_index_scores_by_hand():
    # q' . k' = 128 * 0.0859375**2 = 0.9453125 for q = k = e0; weights 0.5 + 0.25 -> 0.708984375.
    # k = -e0 gives -0.9453125 per head: ReLU -> 0, without ReLU -> -0.708984375.
    e0 = torch.zeros(128)
    e0[0] = 1.0
    q = torch.stack([e0, e0]).unsqueeze(0)  # [1, 2, 128]
    k = torch.stack([e0, -e0])  # [2, 128]
    w = torch.tensor([[0.5, 0.25]])
    assert fp8.serving_index_scores(q, k, w, relu=True).tolist() == [[0.708984375, 0.0]]
    assert fp8.serving_index_scores(q, k, w, relu=False).tolist() == [[0.708984375, -0.708984375]]


# ----------------------------------------------------------------------------------------------
# Against the independent implementation
# ----------------------------------------------------------------------------------------------


def test_serving_index_quant_matches_reference():
    # Multiples of 1/8 in [-4, 4]: exact in BF16, and Hadamard sums are exact in FP32 and in
    # Python floats, so both sides see the same FP32 product and must agree bit for bit.
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-32, 33, (3, 128), generator=g).float() / 8
    got = fp8.serving_index_quant(x)
    for row in range(3):
        assert got[row].tolist() == _ref_serving_quant(x[row].tolist())


def test_serving_index_quant_ue8m0_is_exact_in_bf16():
    """ue8m0 dequantized values (e4m3 times a power of two) come back in BF16 without rounding."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 5
    got = fp8.serving_index_quant(x, "ue8m0")
    v = fp8.hadamard_transform(x.to(torch.bfloat16).float(), 128**-0.5).to(torch.bfloat16).float()
    scale = fp8.compute_scale(v.abs().amax(dim=-1, keepdim=True), "ue8m0")
    assert got.dtype == torch.bfloat16 and fp8.serving_index_quant(x, "amax").dtype == torch.float32
    assert torch.equal(got.float(), fp8.cast_e4m3(v, scale).float() * scale)


def test_serving_index_quant_random_close_to_reference():
    # Gaussian data: FP32 butterfly vs exact sums may flip a rare BF16 rounding; allow <= 1 %.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, generator=g) * 3
    got = fp8.serving_index_quant(x).float()
    ref = torch.tensor([_ref_serving_quant(r) for r in x.tolist()])
    assert (got != ref).float().mean() <= 0.01
    torch.testing.assert_close(got, ref, rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
@pytest.mark.parametrize("operand", fp8_format.OPERANDS)
def test_quantize_matches_reference(recipe, operand):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(130, 260, generator=g) * torch.logspace(-3, 2, 260)
    tr, tc = {"blockwise": (1 if operand == "activation" else 128, 128), "rowwise": (1, 260)}.get(
        recipe, (130, 260)
    )
    vals = x.tolist()
    ref = [[0.0] * 260 for _ in range(130)]
    for r0 in range(0, 130, tr):
        for c0 in range(0, 260, tc):
            cells = [(r, c) for r in range(r0, min(r0 + tr, 130)) for c in range(c0, min(c0 + tc, 260))]
            s = _ue8m0_scale(max(abs(vals[r][c]) for r, c in cells))
            for r, c in cells:
                ref[r][c] = _e4m3(vals[r][c] / s) * s
    assert fp8.emulate(x, recipe, operand).tolist() == ref


# ----------------------------------------------------------------------------------------------
# Edge cases
# ----------------------------------------------------------------------------------------------


def test_all_zero_vectors():
    z = torch.zeros(2, 128)
    for fmt in fp8_format.SCALE_FORMATS:
        q, s = fp8.quantize_vectors(z, fmt)
        assert torch.isfinite(s).all() and (s > 0).all()
        assert fp8.serving_index_quant(z, fmt).eq(0).all()
        assert fp8.emulate(z, "blockwise", "activation", fmt).eq(0).all()


def test_amax_below_eps():
    # amax 5e-5 < 1e-4 -> scale 2**-22; 5e-5 * 2**22 = 209.7 -> e4m3 step 16 in [128, 256) -> 208;
    # dequantized 208 * 2**-22 = 4.9591064453125e-05.
    x = torch.zeros(1, 128)
    x[0, 0] = 5e-5
    q, s = fp8.quantize(x, "blockwise", "activation")
    assert s.item() == 2.0**-22 and q.float()[0, 0].item() == 208.0
    assert fp8.emulate(x, "blockwise", "activation")[0, 0].item() == 4.9591064453125e-05


def test_values_at_and_beyond_448():
    # amax 448 -> ue8m0 scale 1: +-448 survive exactly, 1 stays 1.
    x = torch.tensor([[448.0, -448.0, 1.0]])
    assert fp8.emulate(x, "tensorwise", "activation").tolist() == x.tolist()
    # amax scale: 3 / (3 / 448) may land above 448 in FP32; the clamp keeps it finite at +-448.
    q, s = fp8.quantize(torch.tensor([[3.0, -3.0]]), "rowwise", "activation", "amax")
    assert q.float().tolist() == [[448.0, -448.0]]
    # cast_e4m3 clamps out-of-range input (no NaN whatever the torch conversion does).
    assert fp8.cast_e4m3(torch.tensor([1e6, -1e6, float("inf")]), torch.tensor(1.0)).float().tolist() == [
        448.0, -448.0, 448.0,
    ]


def test_shape_errors():
    with pytest.raises(ValueError, match="128"):
        fp8.serving_index_quant(torch.zeros(4, 96))
    with pytest.raises(ValueError, match="weight"):
        fp8.quantize(torch.zeros(2, 3, 4), "blockwise", "weight")
    with pytest.raises(ValueError, match="recipe"):
        fp8.quantize(torch.zeros(2, 4), "mxfp8", "activation")
    with pytest.raises(ValueError, match="q \\[sq, h, d\\]"):
        fp8.serving_index_scores(torch.zeros(2, 128), torch.zeros(3, 128), torch.zeros(2, 1))
