"""Precision policy routing, backend resolution and the quantized linear (emulate on CPU, the
torch FP8 GEMM on CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kpool_layers.precision import fp8, policy as precision
from kpool_layers.precision import fp8_format
from kpool_layers.precision.policy import PrecisionPolicy, Role
from recipes.observe.precision_map import profile_policy

ALWAYS = {"mlp.fc1", "mlp.fc2", "moe.expert_fc1", "moe.expert_fc2", "moe.shared_fc1", "moe.shared_fc2"}
MLA = {"mla.q_down", "mla.q_up", "mla.kv_down", "mla.kv_up", "mla.out"}
INDEXER_QK = {"indexer.q", "indexer.k", "indexer.kpool_gate"}
KDA_PROJ = {"kda.qkv", "kda.out"}  # attention projections, MLA's switch; kda.gate never FP8

EXPECTED_QUANTIZED = {
    "bf16": set(),
    "fp32": set(),
    "fp8": ALWAYS | MLA | KDA_PROJ | INDEXER_QK | {"indexer.weights"},
    "serving_match": ALWAYS,
}


def _profile(name: str, **overrides) -> PrecisionPolicy:
    """The policy of ``conf/precision/<name>.yaml`` with field overrides."""
    return dataclasses.replace(profile_policy(name), **overrides)


@pytest.mark.parametrize("name", EXPECTED_QUANTIZED)
def test_profile_routing_table(name):
    policy = profile_policy(name)
    got = {role.value for role in Role if policy.quantized(role)}
    assert got == EXPECTED_QUANTIZED[name]
    assert len(Role) == 22


def test_profile_dtypes_and_flags():
    bf16 = torch.bfloat16
    sm = profile_policy("serving_match")
    assert sm.fp8 and sm.recipe == "blockwise" and sm.scale_format == "ue8m0"
    assert sm.dsa_indexer_kpool_use_quantization and sm.dsa_indexer_k_norm_fp32
    assert sm.compute_dtype("indexer.weights", bf16) == torch.float32
    assert sm.compute_dtype("moe.router", bf16) == torch.float32
    assert sm.compute_dtype("mhc.proj", bf16) == torch.float32 and not sm.quantized("mhc.proj")
    assert all(sm.compute_dtype(role, bf16) == bf16 for role in ("embedding", "output", "mla.q_up"))
    fp8_profile = profile_policy("fp8")
    assert fp8_profile.compute_dtype("indexer.weights", bf16) == bf16
    assert fp8_profile.compute_dtype("indexer.weights", torch.float32) == torch.float32
    assert not fp8_profile.dsa_indexer_kpool_use_quantization
    assert profile_policy("bf16").compute_dtype("moe.router", bf16) == torch.float32
    assert profile_policy("fp32").params_dtype == torch.float32


def test_policy_validation_names_keys():
    with pytest.raises(ValueError, match=r"precision\.recipe='mxfp8'"):
        PrecisionPolicy(recipe="mxfp8")
    with pytest.raises(ValueError, match=r"precision\.scale_format"):
        PrecisionPolicy(scale_format="e5m2")
    with pytest.raises(ValueError, match=r"precision\.backend='te'"):
        PrecisionPolicy(backend="te")
    with pytest.raises(ValueError, match=r"precision\.dsa_indexer_weights_proj_disable_quantization"):
        PrecisionPolicy(fp8=True, dsa_indexer_weights_proj_dtype="fp32")
    with pytest.raises(ValueError):
        PrecisionPolicy().quantized("mla.q_proj")


def test_backend_resolution(monkeypatch):
    monkeypatch.setattr(precision, "_cuda_fp8_available", lambda: False)
    assert precision.available_backends() == ["emulate"]
    assert precision.resolve_backend(PrecisionPolicy(backend="torch")) == "none"  # no FP8
    assert precision.resolve_backend(PrecisionPolicy(fp8=True)) == "emulate"
    with pytest.raises(ValueError) as err:
        precision.resolve_backend(PrecisionPolicy(fp8=True, backend="torch"))
    msg = str(err.value)
    assert "precision.backend" in msg and "'torch'" in msg and "['emulate']" in msg
    monkeypatch.setattr(precision, "_cuda_fp8_available", lambda: True)
    assert precision.available_backends() == ["torch", "emulate"]
    assert precision.resolve_backend(PrecisionPolicy(fp8=True)) == "torch"


@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
def test_emulate_forward_matches_quantize_dequantize(recipe):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 256, generator=g), torch.randn(192, 256, generator=g) * 0.05
    y = precision.quantized_matmul(x, w, recipe, "emulate")
    xd = fp8.emulate(x.reshape(15, 256), recipe, "activation")
    wd = fp8.emulate(w, recipe, "weight")
    assert y.shape == (3, 5, 192)
    torch.testing.assert_close(y, (xd @ wd.t()).reshape(3, 5, 192), rtol=0, atol=0)
    assert not torch.equal(y, x @ w.t())  # quantization really happened


@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_close_to_unquantized(recipe, dtype):
    g = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g) * 0.05
    gy = torch.randn(64, 128, generator=g)
    grads = {}
    for quant in (False, True):
        x, w = x0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
        y = precision.quantized_matmul(x, w, recipe, "emulate") if quant else x @ w.t()
        y.backward(gy.to(dtype))
        assert x.grad.dtype == dtype and w.grad.dtype == dtype
        grads[quant] = (x.grad.float(), w.grad.float())
    for ref, got in zip(grads[False], grads[True]):
        assert torch.isfinite(got).all()
        assert torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0) > 0.99


def test_backward_is_straight_through():
    # dx = dy @ Q(w), dw = dy.T @ Q(x) exactly (FP32 inputs).
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 128, generator=g).requires_grad_()
    w = torch.randn(8, 128, generator=g).requires_grad_()
    gy = torch.randn(4, 8, generator=g)
    precision.quantized_matmul(x, w, "blockwise", "emulate").backward(gy)
    torch.testing.assert_close(x.grad, gy @ fp8.emulate(w.detach(), "blockwise", "weight"), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, gy.t() @ fp8.emulate(x.detach(), "blockwise", "activation"), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
def test_zero_rows_give_empty_output_and_zero_weight_grad(recipe):
    # An MoE expert that receives no tokens runs its linears on [0, K] inputs.
    x = torch.zeros(0, 200, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(40, 200, dtype=torch.bfloat16, requires_grad=True)
    y = precision.quantized_matmul(x, w, recipe, "emulate")
    assert y.shape == (0, 40) and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.shape == (0, 200) and torch.equal(w.grad, torch.zeros_like(w))


def test_quantized_matmul_needs_a_concrete_backend():
    with pytest.raises(ValueError, match="'torch' or 'emulate', got 'auto'"):
        precision.quantized_matmul(torch.zeros(2, 16), torch.zeros(4, 16), "blockwise", "auto")


_TOY_ROLES = {"q_up": "mla.q_up", "idx_q": "indexer.q", "idx_w": "indexer.weights", "fc1": "mlp.fc1"}
_TOY_BIAS = {"q_up", "fc1"}


def _toy(policy: PrecisionPolicy) -> torch.nn.ModuleDict:
    """Role-tagged duplicated linears of a BF16 model under ``policy`` (seeded weights)."""
    from types import SimpleNamespace

    from kpool_layers.precision.linears import RoleDuplicatedLinear

    config = SimpleNamespace(precision=policy, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                             perform_initialization=True)
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        name: RoleDuplicatedLinear(128, 4 if name == "idx_w" else 256, config=config, role=role,
                                   init_method=torch.nn.init.xavier_normal_, bias=name in _TOY_BIAS)
        for name, role in _TOY_ROLES.items()
    })


def test_role_linears_serving_match():
    x = torch.randn(6, 128).to(torch.bfloat16)
    plain = _toy(profile_policy("bf16"))
    before = {n: plain[n](x) for n in _TOY_ROLES}
    model = _toy(_profile("serving_match", backend="emulate"))
    assert [(m.role.value, m.numerics.quantized, m.numerics.dtype(m.weight.dtype)) for m in model.values()] == [
        ("mla.q_up", False, torch.bfloat16),
        ("indexer.q", False, torch.bfloat16),
        ("indexer.weights", False, torch.float32),
        ("mlp.fc1", True, torch.bfloat16),
    ]
    # Unquantized BF16 roles compute as nn.Linear.
    assert not model["q_up"].numerics.replaces_gemm(torch.bfloat16) and torch.equal(model["q_up"](x), before["q_up"])
    # FP32 weights projection: FP32 output from FP32 operands.
    w_out = model["idx_w"](x)
    assert w_out.dtype == torch.float32
    torch.testing.assert_close(w_out, x.float() @ model["idx_w"].weight.float().t(), rtol=0, atol=0)
    # Quantized MLP: the emulated FP8 GEMM plus bias.
    fc1 = model["fc1"]
    expected = precision.quantized_matmul(x, fc1.weight, "blockwise", "emulate") + fc1.bias
    assert torch.equal(fc1(x), expected) and not torch.equal(expected, before["fc1"])
    # Under fp8 the MLA projection is quantized too; under bf16 everything is nn.Linear.
    fp8_model = _toy(_profile("fp8", backend="emulate"))
    assert fp8_model["q_up"](x).dtype == torch.bfloat16 and not torch.equal(fp8_model["q_up"](x), before["q_up"])
    assert plain["idx_w"](x).dtype == torch.bfloat16


def _megatron_config(policy: PrecisionPolicy):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=128, num_attention_heads=1, use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    config.precision = policy
    return config


def _parallel_linear(kind: str, config, role: str | None = None):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear

    init = torch.nn.init.xavier_normal_
    torch.manual_seed(3)
    if kind == "column":
        cls = ColumnParallelLinear if role is None else RoleColumnParallelLinear
        return cls(128, 256, config=config, init_method=init, bias=True, gather_output=False,
                   **({} if role is None else {"role": role}))
    cls = RowParallelLinear if role is None else RoleRowParallelLinear
    return cls(128, 256, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False,
               **({} if role is None else {"role": role}))


@pytest.mark.parametrize("kind", ["column", "row"])
def test_role_megatron_linear(single_rank_parallel_state, kind):
    policy = _profile("fp8", backend="emulate")
    ref_layer = _parallel_linear(kind, _megatron_config(policy))
    layer = _parallel_linear(kind, _megatron_config(policy), role="mlp.fc1")
    assert torch.equal(layer.weight, ref_layer.weight) and layer.numerics.quantized
    x = torch.randn(5, 2, 128, requires_grad=True)  # [s, b, h]
    ref_out, _ = ref_layer(x)
    out, _ = layer(x)
    expected = precision.quantized_matmul(x.detach(), layer.weight.detach(), "blockwise", "emulate") + layer.bias.detach()
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(x.grad).all()
    ref_out.square().sum().backward()
    assert torch.nn.functional.cosine_similarity(out.detach().flatten(), ref_out.detach().flatten(), dim=0) > 0.99
    # An unquantized role in the weight's dtype runs megatron's own forward.
    plain = _parallel_linear(kind, _megatron_config(policy), role="embedding")
    assert torch.equal(plain(x)[0], ref_layer(x)[0])


def test_role_linear_refuses_what_its_gemm_does_not_do(single_rank_parallel_state):
    config = _megatron_config(_profile("fp8", backend="emulate"))
    config.defer_embedding_wgrad_compute = True
    with pytest.raises(ValueError, match="mlp.fc1 .*defer_embedding_wgrad_compute"):
        _parallel_linear("column", config, role="mlp.fc1")


# ----------------------------------------------------------------------------------------------
# CUDA FP8 GEMM (torch backend)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8_format.RECIPES)
@pytest.mark.parametrize(
    "m,k,n",
    [(200, 512, 768), (37, 2048, 576), (64, 2048, 32), (5, 200, 40), (0, 2048, 1024)],
    ids=["aligned", "kv_down_N576", "indexer_weights_N32", "K200_N40", "no_rows"],
)
def test_torch_backend_matches_emulate(recipe, m, k, n):
    """The FP8 GEMM (zero-padded to the kernels' multiples where needed) equals emulate."""
    if not precision._cuda_fp8_available():
        pytest.skip("needs an FP8-capable GPU (sm_89+)")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    y = precision.quantized_matmul(x, w, recipe, "torch")
    y_emu = precision.quantized_matmul(x.detach().float(), w.detach().float(), recipe, "emulate")
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), y_emu, rtol=1e-2, atol=1e-2)
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
