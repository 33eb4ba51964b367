"""mHC (kpool_layers.hyper_connections) against transformers' ``Glm5NextTextHyperConnection`` and
``Glm5NextTextHyperHead`` with copied weights (hc_mult 1..4): outputs and every gradient; Sinkhorn's
doubly-stochastic property with a bound from its contraction rate; the stream mixing against its
formula in float64."""

from __future__ import annotations

import math

import pytest
import torch

from kpool_layers.hyper_connections.mhc import (
    HyperConnection,
    collapse_streams,
    expand_streams,
    mix_streams,
    sinkhorn,
)

HIDDEN = 16
EPS64 = torch.finfo(torch.float64).eps


def hf_config(hc_mult: int, iters: int = 20):  # noqa: ANN201
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
        mlp_layer_types=["dense"], indexer_types=["full"], hc_mult=hc_mult,
        hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-5, num_attention_heads=2,
        num_key_value_heads=2, index_topk=16, index_kpool=4, vocab_size=300, pad_token_id=0)


def our_config(hc_mult: int, iters: int = 20):  # noqa: ANN201
    from kpool_layers.config import GLMTransformerConfig

    return GLMTransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                                layernorm_epsilon=1e-5, use_cpu_initialization=True,
                                params_dtype=torch.float32, hc_mult=hc_mult, hc_sinkhorn_iters=iters,
                                hc_eps=1e-6)


def pair(hc_mult: int, seed: int = 0) -> tuple[torch.nn.Module, HyperConnection]:
    """transformers' module with random parameters (fn N(0, 0.3) so the mixing is far from
    uniform, base N(0, 1), scale N(1, 0.3)) and ours with the same values."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    cfg = hf_config(hc_mult)
    torch.manual_seed(seed)
    hf = Glm5NextTextHyperConnection(cfg)
    with torch.no_grad():
        hf.fn.normal_(0.0, 0.3)
        hf.base.normal_(0.0, 1.0)
        hf.scale.normal_(1.0, 0.3)
    ours = HyperConnection(our_config(cfg.hc_mult, cfg.hc_sinkhorn_iters))
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            getattr(ours, name).copy_(getattr(hf, name))
    return hf, ours


@pytest.mark.parametrize("hc_mult", [1, 2, 3, 4])
def test_matches_transformers_outputs_and_gradients(hc_mult: int) -> None:
    """Same operations in the same order on the same [b, s, N, h] tensor (our module takes any
    leading token dims): bit-identical in fp32, forward and backward."""
    hf, ours = pair(hc_mult, seed=hc_mult)
    x = torch.randn(2, 5, hc_mult, HIDDEN, generator=torch.Generator().manual_seed(9))
    results = []
    for module in (hf, ours):
        xi = x.clone().requires_grad_(True)
        post, comb, block_input = module(xi)
        (post.square().sum() + (comb * torch.arange(comb.numel()).view_as(comb)).sum()
         + block_input.sin().sum()).backward()
        grads = [xi.grad] + [getattr(module, name).grad for name in ("fn", "base", "scale")]
        results.append(((post, comb, block_input), grads))
    (hf_out, hf_grads), (our_out, our_grads) = results
    for what, a, e in zip(("post", "comb", "block input"), our_out, hf_out):
        torch.testing.assert_close(a, e, rtol=0.0, atol=0.0, msg=lambda m, w=what: f"{w}: {m}")
    for what, a, e in zip(("streams", "fn", "base", "scale"), our_grads, hf_grads):
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a, e, rtol=0.0, atol=0.0, msg=lambda m, w=what: f"d{w}: {m}")


@pytest.mark.parametrize("hc_mult", [1, 2, 3, 4])
def test_head_is_transformers_mean(hc_mult: int) -> None:
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperHead

    x = torch.randn(3, 4, hc_mult, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(collapse_streams(x), Glm5NextTextHyperHead()(x), rtol=0.0, atol=0.0)
    streams = expand_streams(x[:, :, 0], hc_mult)
    assert streams.shape == x.shape and streams.is_contiguous()
    assert all(torch.equal(streams[:, :, n], x[:, :, 0]) for n in range(hc_mult))


def test_mix_streams_formula_fp64() -> None:
    """``new_n = post_n F + sum_m comb[m, n] streams_m`` (transformers' decoder layer)."""
    gen = torch.Generator().manual_seed(4)
    n = 3
    post = torch.rand(2, 5, n, generator=gen, dtype=torch.float64)
    comb = torch.rand(2, 5, n, n, generator=gen, dtype=torch.float64)
    out = torch.randn(2, 5, HIDDEN, generator=gen, dtype=torch.float64)
    streams = torch.randn(2, 5, n, HIDDEN, generator=gen, dtype=torch.float64)
    expected = post[..., None] * out[..., None, :] + torch.einsum("bsmn,bsmh->bsnh", comb, streams)
    # a sum of n + 1 products per entry: (n + 1) * eps64 * the largest term sum
    bound = (n + 1) * EPS64 * float((post[..., None].abs() * out[..., None, :].abs()).max()
                                    + n * comb.abs().max() * streams.abs().max())
    torch.testing.assert_close(mix_streams(post, comb, out, streams), expected, rtol=0.0, atol=bound)


@pytest.mark.parametrize("n, iters", [(2, 3), (4, 5), (4, 20)])
def test_sinkhorn_doubly_stochastic_within_its_contraction_bound(n: int, iters: int) -> None:
    """Columns sum to 1 after the last (column) step; the row sums r converge at Birkhoff's rate:
    with the projective diameter D = max log(A_ik A_jl / (A_il A_jk)) of the start matrix (which
    diagonal scalings keep) and kappa = tanh(D / 4), every row-and-column sweep contracts the
    Hilbert distance d(r, 1) = log(max r / min r) by kappa^2 (Franklin & Lorenz 1989). Since the
    r sum to N, max |r - 1| <= expm1(d); so after ``iters`` (one column step, iters - 1 sweeps)
    max |r - 1| <= expm1(kappa^(2 (iters - 1)) d_1), d_1 measured after the first column step;
    plus float64 rounding, N * eps64 per normalisation."""
    gen = torch.Generator().manual_seed(n * 100 + iters)
    a = torch.softmax(2.0 * torch.randn(64, n, n, generator=gen, dtype=torch.float64), dim=-1)
    out = sinkhorn(a, iters, eps=0.0)
    rounding = 2 * iters * n * EPS64
    torch.testing.assert_close(out.sum(-2), torch.ones(64, n, dtype=torch.float64), rtol=0.0,
                               atol=rounding)
    la = a.log()
    cross = la[:, :, None, :, None] + la[:, None, :, None, :] - la[:, :, None, None, :] - la[:, None, :, :, None]
    diameter = cross.flatten(1).amax(1)                        # [64]
    kappa = torch.tanh(diameter / 4)
    r1 = sinkhorn(a, 1, eps=0.0).sum(-1)
    d1 = (r1.amax(-1) / r1.amin(-1)).log()
    bound = torch.expm1(kappa ** (2 * (iters - 1)) * d1) + rounding
    deviation = (out.sum(-1) - 1).abs().amax(-1)
    assert (deviation <= bound).all(), (deviation - bound).max()
    assert math.isfinite(float(bound.max()))


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="hc_mult=0"):
        our_config(0)
    with pytest.raises(ValueError, match="hc_sinkhorn_iters=0"):
        our_config(4, iters=0)


def test_bf16_parameters_compute_in_fp32() -> None:
    """A BF16 model's mHC (``Float16Module`` casts every parameter): the projection's role is
    FP32, never FP8, and the math runs in FP32 on the BF16 values, i.e. transformers' module with
    those values in its FP32 ``base``/``scale`` (``_keep_in_fp32_modules_strict``) and BF16 ``fn``."""
    hf, ours = pair(4, seed=5)
    ours = ours.bfloat16()
    assert ours.fn.dtype == ours.base.dtype == ours.scale.dtype == torch.bfloat16
    assert ours.numerics.role.value == "mhc.proj" and not ours.numerics.quantized
    assert ours.numerics.dtype(torch.bfloat16) == torch.float32
    with torch.no_grad():
        hf.fn.copy_(ours.fn.float())
        hf.base.copy_(ours.base.float())
        hf.scale.copy_(ours.scale.float())
    x = torch.randn(2, 5, 4, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    hf.fn.data = hf.fn.data.bfloat16()
    with torch.no_grad():
        for a, e in zip(ours(x), hf(x)):
            torch.testing.assert_close(a, e, rtol=0.0, atol=0.0)
