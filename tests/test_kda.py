"""KDA (kpool_layers.linear_attention): the torch chunked delta rule against a per-token recurrence
in float64; the layer against transformers' ``Glm5NextTextLinearAttention`` with copied weights;
packed THD documents against separate runs; backend resolution; on a GPU the fla backend against
the torch reference in forward and every gradient."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kpool_layers.linear_attention import backends
from kpool_layers.linear_attention.delta_rule import chunk_kda_torch, l2_normalize
from kpool_layers.linear_attention.kda import KimiDeltaAttention, kda_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.spec_utils import build_module

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
EPS_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significand bits)

HEADS, HEAD_DIM, HIDDEN, TAPS = 4, 8, 32, 4


def naive_recurrence(q, k, v, g, beta, scale):  # noqa: ANN001, ANN201 (the oracle, per token)
    """``S <- diag(exp g_t) S; S <- S + k_t beta_t (v_t - S^T k_t)^T; o_t = S^T scale q_t`` with
    L2-normalised q/k; ``[B, T, H, *]`` layouts."""
    b, t, h, dk = q.shape
    q, k = l2_normalize(q) * scale, l2_normalize(k)
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None]
        u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i]))
        state = state + k[:, i, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i]))
    return torch.stack(out, dim=1)


def random_inputs(b: int, t: int, h: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v normal; g = -5 sigmoid(normal) (GLM-5.3's bounded gate); beta uniform(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen, dtype=dtype)
    k = torch.randn(b, t, h, dk, generator=gen, dtype=dtype)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    g = -5.0 * torch.sigmoid(torch.randn(b, t, h, dk, generator=gen, dtype=torch.float32)).to(dtype)
    beta = torch.rand(b, t, h, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _recurrence_bound(t: int, dk: int, dv: int, eps: float, scale: float) -> float:
    """Both computations are exact up to roundings in a map that does not expand errors: with
    unit-norm keys and beta in [0, 1], ``S -> (I - beta k k^T) diag(exp g) S`` has norm <= 1, so
    every rounding made at one token (dot products of length K or V, O(K + V) operations per
    state entry) is carried to the end without growth. Over T tokens the error of an output is at
    most ``T * (K + V + 2) * eps`` times the largest state entry; the state entries are bounded by
    ``T * max|v|``-ish sums, so the scale used is ``max|o|`` of the oracle (an output is a dot of
    the state with a unit query) plus ``max|v|``."""
    return t * (dk + dv + 2) * eps * scale


@pytest.mark.parametrize("t, chunk", [(1, 64), (37, 8), (64, 16), (70, 64)])
def test_chunked_reference_equals_per_token_recurrence_fp64(t: int, chunk: int) -> None:
    q, k, v, g, beta = random_inputs(2, t, 3, 8, 6, torch.float64, seed=t)
    scale = 8 ** -0.5
    expected = naive_recurrence(q, k, v, g, beta, scale)
    actual = chunk_kda_torch(q, k, v, g, beta, scale, chunk_size=chunk)
    bound = _recurrence_bound(t, 8, 6, EPS64, float(expected.abs().max() + v.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=bound)


def test_chunked_reference_packed_documents_restart_the_state() -> None:
    q, k, v, g, beta = random_inputs(1, 29, 2, 8, 8, torch.float64, seed=3)
    cu = [0, 5, 5, 21, 29]  # an empty document too
    packed = chunk_kda_torch(q, k, v, g, beta, 0.3, cu_seqlens=torch.tensor(cu), chunk_size=4)
    for b0, b1 in zip(cu, cu[1:]):
        if b1 == b0:
            continue
        alone = naive_recurrence(*(x[:, b0:b1] for x in (q, k, v, g, beta)), 0.3)
        bound = _recurrence_bound(b1 - b0, 8, 8, EPS64, float(alone.abs().max() + v.abs().max()))
        torch.testing.assert_close(packed[:, b0:b1], alone, rtol=0.0, atol=bound)


def test_backend_resolution_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backends.resolve("torch") == "torch"
    assert backends.resolve("fla") == "fla"
    assert backends.resolve("auto", on_device=False) == "fla"  # a dry run plans for GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.resolve("auto") == "torch"
    with pytest.raises(backends.KernelUnavailable, match=r"linear_attention_kernels='cuda'.*allowed"):
        backends.resolve("cuda")
    backends.check_backend("torch")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.resolve("auto") == "torch"  # CUDA without the package: no extra needed
    with pytest.raises(backends.KernelUnavailable, match=r"\.\[fla\]"):
        backends.check_backend("fla")
    backends.check_backend("fla", on_device=False)  # a dry run plans for another machine
    with pytest.raises(backends.KernelUnavailable, match="not resolved"):
        backends.layer_kernels("auto")


def test_config_key_validated_and_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.linear_attention_kernels``: ``fla`` named on a machine without the package (or
    without CUDA) is a ConfigError naming the key and the fix, except for a dry run; ``auto`` is
    resolved to ``torch`` here before the megatron config is made."""
    from recipes.config.megatron import to_transformer_config
    from recipes.config.schema import ConfigError
    from recipes.config.rules import validate
    from recipes.config.typed import to_config
    from tests.test_config import _compose

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"model\.linear_attention_kernels='fla'.*torch"):
        validate(_compose(["model=glm5_tiny", "model.linear_attention_kernels=fla"]), 1)
    validate(_compose(["model=glm5_tiny", "model.linear_attention_kernels=fla", "train.dry_run=true"]), 1)
    cfg = _compose(["model=glm5_tiny"])
    validate(cfg, 1)
    assert to_transformer_config(to_config(cfg)).linear_attention_kernels == "torch"


# --- the layer against transformers -------------------------------------------------------------

def hf_config(lower_bound: float | None):  # noqa: ANN201
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
        mlp_layer_types=["dense"], indexer_types=["full"], linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM, linear_conv_kernel_dim=TAPS, linear_lower_bound=lower_bound,
        rms_norm_eps=1e-5, num_attention_heads=2, num_key_value_heads=2, index_topk=16,
        index_kpool=4, vocab_size=300, pad_token_id=0)


def our_config(lower_bound: float | None, **overrides: object):  # noqa: ANN201
    from tests.test_attention import tiny_config

    fields: dict[str, object] = dict(
        hidden_size=HIDDEN, linear_num_key_heads=HEADS, linear_num_value_heads=HEADS,
        linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=TAPS,
        linear_gate_lower_bound=lower_bound, layernorm_epsilon=1e-5)
    fields.update(overrides)
    return tiny_config(**fields)


def build_kda(config) -> KimiDeltaAttention:  # noqa: ANN001
    return build_module(kda_spec(config), config=config, layer_number=1)


def copy_from_hf(ours: KimiDeltaAttention, hf: torch.nn.Module) -> None:
    """transformers' weights into our layer (TP = 1); the conv weight ``[3 W, 1, K]`` is q, k, v."""
    w = HEADS * HEAD_DIM
    conv = hf.conv1d.weight.detach()[:, 0]
    pairs = {
        "linear_q.weight": hf.q_proj.weight, "linear_k.weight": hf.k_proj.weight,
        "linear_v.weight": hf.v_proj.weight, "linear_f_a.weight": hf.forget_gate.f_a_proj.weight,
        "linear_f_b.weight": hf.forget_gate.f_b_proj.weight, "linear_beta.weight": hf.b_proj.weight,
        "linear_g_a.weight": hf.g_a_proj.weight, "linear_g_b.weight": hf.g_b_proj.weight,
        "linear_proj.weight": hf.o_proj.weight, "conv_q": conv[:w], "conv_k": conv[w:2 * w],
        "conv_v": conv[2 * w:], "dt_bias": hf.forget_gate.dt_bias, "A_log": hf.forget_gate.A_log,
        "out_norm_weight": hf.o_norm.weight,
    }
    params = dict(ours.named_parameters())
    assert set(params) == set(pairs), set(params) ^ set(pairs)
    with torch.no_grad():
        for name, value in pairs.items():
            params[name].copy_(value.detach())


def hf_layer(lower_bound: float | None, seed: int = 0) -> torch.nn.Module:
    """transformers' layer with every parameter drawn at random (normal * 0.3; A_log normal so the
    decay rates differ per head; the norm weight near 1)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    torch.manual_seed(seed)
    layer = Glm5NextTextLinearAttention(hf_config(lower_bound), layer_idx=0).float()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name == "o_norm.weight" else 0.3 * torch.randn_like(p))
    return layer


def _layer_bound(t: int, scale: float) -> float:
    """fp32 against fp32, the same math in another order (chunked WY form against transformers'
    forward substitution, other matmul blockings): each side is within the recurrence bound of
    :func:`_recurrence_bound` (D + D + 2 per token over T tokens) plus the dot products before and
    after it (hidden size for the projections, H * D for the output projection), times eps32,
    times the output's scale; twice that for the difference of two such results."""
    return 2 * (t * (2 * HEAD_DIM + 2) + HIDDEN + HEADS * HEAD_DIM) * EPS32 * scale


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_layer_matches_transformers(single_rank_parallel_state, lower_bound: float | None) -> None:
    hf = hf_layer(lower_bound)
    ours = build_kda(our_config(lower_bound))
    copy_from_hf(ours, hf)
    x = torch.randn(2, 19, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = hf(x)
    actual, bias = ours(x.transpose(0, 1).contiguous())
    assert bias is None
    actual = actual.transpose(0, 1)
    torch.testing.assert_close(actual, expected, rtol=0.0,
                               atol=_layer_bound(19, float(expected.abs().max())))


def test_rejects_unsupported_inputs(single_rank_parallel_state) -> None:
    """The ``self_attention`` slot's arguments the layer does not implement are refused by name
    (``kpool_layers.compat.attention_slot``), so is a packed THD batch wider than 1."""
    ours = build_kda(our_config(-5.0))
    x = torch.randn(8, 1, HIDDEN)
    with pytest.raises(ValueError, match=r"KimiDeltaAttention does not support \['rotary_pos_emb', 'attention_bias'\]"):
        ours(x, None, rotary_pos_emb=torch.zeros(8, 1, 1, 4), attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="packed THD needs batch size 1, got 2"):
        ours(torch.randn(8, 2, HIDDEN), None, packed_seq_params=thd([0, 8]))


def thd(cu: list[int]) -> PackedSeqParams:
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = int((cu_t[1:] - cu_t[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def test_packed_documents_equal_separate_runs(single_rank_parallel_state) -> None:
    """The conv (4 taps, documents of 1..9 tokens) and the recurrence restart at each boundary;
    tokens past the last boundary form one more document. Output and input gradient."""
    ours = build_kda(our_config(-5.0))
    cu, total = [0, 3, 4, 13], 20  # documents [0,3) [3,4) [4,13) and the tail [13,20)
    x = torch.randn(total, 1, HIDDEN, generator=torch.Generator().manual_seed(2), requires_grad=True)
    packed, _ = ours(x, packed_seq_params=thd(cu))
    packed.square().sum().backward()
    for b0, b1 in zip(cu[:-1] + [13], cu[1:] + [total]):
        xd = x.detach()[b0:b1].clone().requires_grad_(True)
        alone, _ = ours(xd)
        alone.square().sum().backward()
        scale = float(alone.abs().max())
        torch.testing.assert_close(packed[b0:b1], alone, rtol=0.0, atol=_layer_bound(b1 - b0, scale))
        torch.testing.assert_close(x.grad[b0:b1], xd.grad, rtol=0.0,
                                   atol=2 * _layer_bound(b1 - b0, float(xd.grad.abs().max())))


def test_config_errors_name_the_keys(single_rank_parallel_state) -> None:
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        build_kda(our_config(-5.0, linear_num_value_heads=8))
    with pytest.raises(ValueError, match="linear_value_head_dim"):
        build_kda(our_config(-5.0, linear_value_head_dim=16))
    with pytest.raises(ValueError, match="linear_attention_kernels='auto'"):
        our_config(-5.0, linear_attention_kernels="auto")
    ours = build_kda(our_config(-5.0))
    with pytest.raises(ValueError, match="key_value_states"):
        ours(torch.zeros(4, 1, HIDDEN), key_value_states=torch.zeros(4, 1, HIDDEN))


def test_in_megatron_transformer_layer(single_rank_parallel_state) -> None:
    """Drop-in for the ``self_attention`` slot of megatron's ``TransformerLayer`` (pre-norm,
    residual add): the layer's output is ``x + KDA(norm(x))`` plus the MLP part; packed THD goes
    through; every parameter gets a finite gradient."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from kpool_layers.spec import glm_layer_spec

    cfg = our_config(-5.0, ffn_hidden_size=64, num_moe_experts=None, hidden_dropout=0.0)
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, glm_layer_spec(cfg, kda_spec(cfg), moe=False).submodules,
                             layer_number=1)
    assert isinstance(layer.self_attention, KimiDeltaAttention)
    x = torch.randn(9, 1, HIDDEN, generator=torch.Generator().manual_seed(3), requires_grad=True)
    packed = thd([0, 4, 9])
    out, _ = layer(x, None, packed_seq_params=packed)
    with torch.no_grad():  # the same modules called by hand: the same operations, bit-equal
        mid = x + layer.self_attention(layer.input_layernorm(x), packed_seq_params=packed)[0]
        expected = mid + layer.mlp(layer.pre_mlp_layernorm(mid))[0]
    torch.testing.assert_close(out, expected, rtol=0.0, atol=0.0)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_dist_checkpoint_round_trip(single_rank_parallel_state, tmp_path) -> None:
    """megatron's dist_checkpointing saves the layer's sharded state dict and loads it into a
    freshly initialised layer: every tensor back bit for bit."""
    from megatron.core import dist_checkpointing

    saved = build_kda(our_config(-5.0))
    with torch.no_grad():
        for p in saved.parameters():
            p.normal_()
    dist_checkpointing.save(saved.sharded_state_dict(prefix="kda."), str(tmp_path))
    fresh = build_kda(our_config(-5.0))
    fresh_params = dict(fresh.named_parameters())
    assert not any(torch.equal(fresh_params[n], p) for n, p in saved.named_parameters())
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(prefix="kda."), str(tmp_path))
    fresh.load_state_dict({k.removeprefix("kda."): v for k, v in loaded.items()})
    for name, want in saved.named_parameters():
        assert torch.equal(fresh_params[name], want), name


# --- GPU: the fla backend against the torch reference -----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("cu", [None, [0, 100, 164, 400, 512]])
def test_fla_matches_torch_reference_forward_and_gradients(cu: list[int] | None) -> None:
    """bf16 inputs (the model dtype), the same inputs to both. fla computes in float32 but stores
    its chunk intermediates (the WY factors w and u, the corrected values v_new and the chunk
    states h) in the input dtype: about four bf16 roundings (relative 2^-8 each) on the path to an
    output, plus one per chunk boundary the state crosses (NT = T / 64 chunks), each carried
    without growth by the non-expansive recurrence. Bound: (4 + NT) * 2^-8 * max|reference| for
    the output; gradients go through the same intermediates twice (recomputed forward, then
    backward): 2 * (4 + NT) * 2^-8 * max|reference gradient|. The reference computes in float32
    from the same bf16 values, so its own error (eps32-sized) is negligible against this."""
    pytest.importorskip("fla", reason="needs the fla extra: pip install -e '.[fla]'")
    b, t, h, d = (1 if cu else 2), 512, 4, 128
    q, k, v, g, beta = (x.cuda() for x in random_inputs(b, t, h, d, d, torch.float32, seed=5))
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    nt = t // 64
    grads = {}
    outs = {}
    for name in ("torch", "fla"):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        out = backends.layer_kernels(name).delta_rule(*leaves, d ** -0.5, cu_t)
        weight = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(7),
                             device="cuda", dtype=torch.float32)
        (out.float() * weight).sum().backward()
        outs[name] = out.float()
        grads[name] = [leaf.grad.float() for leaf in leaves]
    ref = outs["torch"]
    torch.testing.assert_close(outs["fla"], ref, rtol=0.0,
                               atol=(4 + nt) * EPS_BF16 * float(ref.abs().max()))
    for what, got, want in zip(("q", "k", "v", "g", "beta"), grads["fla"], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=0.0,
                                   atol=2 * (4 + nt) * EPS_BF16 * float(want.abs().max()),
                                   msg=lambda m, what=what: f"d{what}: {m}")


# --- GPU: fla's conv, gate and gated norm against the torch ops -------------------------------

ROUND_BF16 = 2.0 ** -7 * (1 + 2.0 ** -7)
"""Two float32 values that differ by ``d`` round to bf16 values at most one bf16 ulp apart (an ulp
is <= 2^-7 of the value, 8 significand bits) plus ``d``: relative tolerance of a bf16 output."""


def _assert_within(name: str, got: torch.Tensor, want: torch.Tensor, fp32_abs: float) -> None:
    """``|got - want| <= fp32_abs + (ROUND_BF16 |want| for a bf16 result)``: the float32 arithmetic's
    derived error ``fp32_abs`` and, where the result is stored in bf16, one rounding step."""
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape)
    rtol = ROUND_BF16 if want.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=fp32_abs,
                               msg=lambda m: f"{name}: {m}")


def _grads(fn, inputs: list[torch.Tensor], seed: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:  # noqa: ANN001
    """``fn(*inputs)`` and the gradients of ``sum(out * w)`` for a fixed random ``w`` (returned)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    weight = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
    (out.float() * weight).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves], weight


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [None, [0, 3, 100, 100, 164, 400, 512]])
def test_fla_conv_matches_torch_ops(cu: list[int] | None) -> None:
    """The short conv, bf16 (the model dtype): both sum K products of bf16 values (exact in fp32)
    in fp32, SiLU (Lipschitz 1.1), one bf16 rounding. fp32 part: any order of an n-term sum is
    within 2 n eps32 sum|terms| of another; y, dx: n = K, terms <= max|x| max|w| (dy's 1.1 max|w|);
    dw: n = tokens, terms <= 1.1 max|dy| max|x|; plus 8 eps32 of the result for SiLU and its
    derivative."""
    pytest.importorskip("fla", reason="needs the fla extra: pip install -e '.[fla]'")
    from kpool_layers.linear_attention.fla_kernels import FLA_KERNELS
    from kpool_layers.linear_attention.layer_ops import TORCH_KERNELS, document_index

    b, s, c, taps = (1 if cu else 2), 512, 256, 4
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(b, s, c, generator=gen).bfloat16().cuda()
    w = (0.5 * torch.randn(c, taps, generator=gen)).bfloat16().cuda()
    docs = document_index(s, None if cu is None else torch.tensor(cu, device="cuda"), x.device)
    runs = {name: _grads(lambda x, w, k=k: k.conv(x, w, docs), [x, w], seed=12)
            for name, k in (("fla", FLA_KERNELS), ("torch", TORCH_KERNELS))}
    (y, (dx, dw), dy), (y_ref, (dx_ref, dw_ref), _) = runs["fla"], runs["torch"]
    mx, mw, mdy = float(x.abs().max()), float(w.abs().max()), float(dy.abs().max())
    n_tok = b * s
    _assert_within("y", y, y_ref, 2 * taps * EPS32 * taps * mx * mw * 1.1 + 8 * EPS32 * float(y_ref.abs().max()))
    _assert_within("dx", dx, dx_ref, 2 * taps * EPS32 * taps * 1.1 * mdy * mw + 8 * EPS32 * float(dx_ref.abs().max()))
    _assert_within("dw", dw, dw_ref, 2 * n_tok * EPS32 * n_tok * 1.1 * mdy * mx)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_decay_matches_torch_ops(lower_bound: float | None) -> None:
    """The forget gate from bf16 ``f``, ``A_log``, ``dt_bias`` (the model dtype): fp32 math with a
    few operations per element, each side within 8 eps32 of its result for g and df (exp, the
    sigmoid or softplus); df is rounded to bf16. dA and dbias sum n = tokens (x D for dA) terms:
    2 n eps32 n max|term|, terms <= max|dg| r max|f + b| (dA) and max|dg| r (dbias), r = max exp(A_log)."""
    pytest.importorskip("fla", reason="needs the fla extra: pip install -e '.[fla]'")
    from kpool_layers.linear_attention.fla_kernels import FLA_KERNELS
    from kpool_layers.linear_attention.layer_ops import TORCH_KERNELS

    s, b, h, d = 512, 2, 4, 128
    gen = torch.Generator().manual_seed(13)
    f = torch.randn(s, b, h, d, generator=gen).bfloat16().cuda()
    a_log = torch.randn(h, generator=gen).bfloat16().cuda()
    dt_bias = (0.5 * torch.randn(h * d, generator=gen)).bfloat16().cuda()
    runs = {name: _grads(lambda f, a, bias, k=k: k.decay(f, a, bias, lower_bound), [f, a_log, dt_bias], seed=14)
            for name, k in (("fla", FLA_KERNELS), ("torch", TORCH_KERNELS))}
    (g, (df, da, dbias), dg), (g_ref, (df_ref, da_ref, dbias_ref), _) = runs["fla"], runs["torch"]
    assert g.dtype == torch.float32
    rate = float(a_log.float().exp().max())
    fb = float((f.float() + dt_bias.float().view(h, d)).abs().max())
    mdg = float(dg.abs().max())
    n_tok = s * b
    _assert_within("g", g, g_ref, 8 * EPS32 * float(g_ref.abs().max()))
    _assert_within("df", df, df_ref, 8 * EPS32 * float(df_ref.abs().max()))
    scale_a = (abs(lower_bound) / 4 * fb if lower_bound is not None else fb + 1.0) * rate * mdg
    _assert_within("dA_log", da, da_ref, 2 * n_tok * d * EPS32 * n_tok * d * scale_a)
    _assert_within("ddt_bias", dbias, dbias_ref, 2 * n_tok * EPS32 * n_tok * rate * mdg)


@pytest.mark.gpu
def test_fla_gated_norm_matches_torch_ops() -> None:
    """RMSNorm_D(o) w sigmoid(gate), bf16 in and out: the sum of D squares has relative error
    <= D eps32 (positive terms), so y and dgate are within 2 (D + 8) eps32 of their largest value,
    do of its terms' (plus one bf16 rounding each); dw sums n = rows terms <= max|dy| max|o rstd|:
    2 n eps32 n max|term|."""
    pytest.importorskip("fla", reason="needs the fla extra: pip install -e '.[fla]'")
    from kpool_layers.linear_attention.fla_kernels import FLA_KERNELS
    from kpool_layers.linear_attention.layer_ops import TORCH_KERNELS

    rows, d, eps = 2048, 128, 1e-5
    gen = torch.Generator().manual_seed(15)
    o = torch.randn(rows // 4, 4, d, generator=gen).bfloat16().cuda()
    gate = torch.randn(rows // 4, 4, d, generator=gen).bfloat16().cuda()
    w = (1 + 0.1 * torch.randn(d, generator=gen)).bfloat16().cuda()
    runs = {name: _grads(lambda o, gate, w, k=k: k.gated_norm(o, gate, w, eps), [o, gate, w], seed=16)
            for name, k in (("fla", FLA_KERNELS), ("torch", TORCH_KERNELS))}
    (y, (do, dgate, dw), dy), (y_ref, (do_ref, dgate_ref, dw_ref), _) = runs["fla"], runs["torch"]
    of = o.float()
    rstd = torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)
    normed = float((of * rstd).abs().max())
    rel = 2 * (d + 8) * EPS32
    for name, got, want in (("y", y, y_ref), ("dgate", dgate, dgate_ref)):
        _assert_within(name, got, want, rel * float(want.abs().max()))
    # do = rstd (a - o_hat mean(a o_hat)), a = w sigmoid(gate) dy: its error scales with its terms
    terms = float(rstd.max()) * float(w.float().abs().max()) * float(dy.abs().max()) * (1 + normed ** 2)
    _assert_within("do", do, do_ref, rel * terms)
    _assert_within("dw", dw, dw_ref, 2 * rows * EPS32 * rows * float(dy.abs().max()) * normed)
