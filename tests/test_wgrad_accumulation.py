"""kpool_layers.compat.wgrad_accumulation: megatron's gradient-accumulation fusion without apex.

End to end every training run uses it (``recipes.loop`` builds with ``ddp=True``; the training
tests, resume bit-exactness included, run through it)."""

from __future__ import annotations

import megatron.core.tensor_parallel.layers as megatron_layers
import pytest
import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from kpool_layers.precision import fp8
from kpool_layers.compat import wgrad_accumulation
from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear
from kpool_layers.precision.policy import LinearNumerics, PrecisionPolicy, Role
from tests.op_counts import OwnOps


def test_fp32_accumulation_adds_the_exact_product() -> None:
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(9, 6, generator=gen), torch.randn(9, 4, generator=gen)
    main_grad = torch.randn(4, 6, generator=gen)
    want = main_grad + g.t() @ x  # the unfused path for fp32 weights: the wgrad, then DDP's add
    wgrad_accumulation.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert torch.equal(main_grad, want)
    # bf16 operands: the product in fp32, never rounded to bf16
    xb, gb, acc = x.bfloat16(), g.bfloat16(), torch.zeros(4, 6)
    wgrad_accumulation.wgrad_gemm_accum_fp32(xb, gb, acc)
    assert torch.equal(acc, gb.float().t() @ xb.float())


def test_16_bit_main_grad_accumulates_in_its_dtype() -> None:
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(9, 6, generator=gen).bfloat16(), torch.randn(9, 4, generator=gen).bfloat16()
    main_grad = torch.randn(4, 6, generator=gen).bfloat16()
    want = torch.addmm(main_grad, g.t(), x)
    wgrad_accumulation.wgrad_gemm_accum_fp16(x, g, main_grad)
    assert torch.equal(main_grad, want)


def test_install_keeps_apex_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron_layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(megatron_layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    wgrad_accumulation.install()
    wgrad_accumulation.install()
    assert megatron_layers._grad_accum_fusion_available
    assert megatron_layers.fused_weight_gradient_mlp_cuda is wgrad_accumulation.FUSED_WGRAD
    apex = object()
    monkeypatch.setattr(megatron_layers, "fused_weight_gradient_mlp_cuda", apex)
    wgrad_accumulation.install()
    assert megatron_layers.fused_weight_gradient_mlp_cuda is apex


class _Pair(torch.nn.Module):
    """megatron's column- then row-parallel linear (an MLP without activation); with ``roles``
    the role-tagged linears of ``kpool_layers.precision.linears`` (``config.precision`` decides their GEMM)."""

    def __init__(self, config: TransformerConfig, roles: bool = False) -> None:
        super().__init__()
        init = torch.nn.init.normal_
        column, row = (RoleColumnParallelLinear, RoleRowParallelLinear) if roles else (ColumnParallelLinear,
                                                                                     RowParallelLinear)
        tags = ({"role": Role.MLP_FC1}, {"role": Role.MLP_FC2}) if roles else ({}, {})
        self.fc1 = column(128, 256, config=config, init_method=init, bias=False, **tags[0])
        self.fc2 = row(256, 128, config=config, init_method=init, bias=False,
                       input_is_parallel=True, skip_bias_add=True, **tags[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)[0]))[0]


def _main_grads(fusion: bool, micro_batches: int = 2,
                policy: PrecisionPolicy | None = None) -> tuple[list[torch.Tensor], int]:
    """``main_grad`` of both weights after ``micro_batches`` backward passes under megatron's DDP,
    and the aten ops run outside the modules in backward (DDP's hooks). With ``policy`` the pair
    is built from role linears computing under it."""
    if fusion:
        wgrad_accumulation.install()
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=1,
                               use_cpu_initialization=True, gradient_accumulation_fusion=fusion)
    if policy is not None:
        config.precision = policy
    torch.manual_seed(0)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  _Pair(config, roles=policy is not None))
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(2)
    with OwnOps(ddp) as ops:
        for _ in range(micro_batches):
            ddp(torch.randn(5, 3, 128, generator=gen)).square().sum().backward()
    pair = ddp.module
    return [pair.fc1.weight.main_grad.clone(), pair.fc2.weight.main_grad.clone()], ops.counts[("<outside>", "bwd")]


def test_megatron_linears_accumulate_into_main_grad(single_rank_parallel_state) -> None:
    """The same ``main_grad`` as the unfused path, bit for bit (fp32 weights: the same products
    added in the same order), without DDP's per-weight add: one kernel less per weight and
    micro-batch."""
    fused, fused_ops = _main_grads(True)
    plain, plain_ops = _main_grads(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert fused[0].abs().sum() > 0
    assert plain_ops - fused_ops == 2 * 2  # two weights, two micro-batches


@pytest.mark.parametrize("fp8_backward", ["bf16", "fp8"])
def test_fp8_role_linears_accumulate_into_main_grad(single_rank_parallel_state, fp8_backward: str) -> None:
    """The FP8 role linears (their own GEMM) follow the flag: ``main_grad`` bit-identical to DDP's
    add of their weight gradients (FP32 model, emulated FP8: the same dequantized products), one
    add fewer per weight and micro-batch; with the straight-through and the FP8 backward alike."""
    policy = PrecisionPolicy(fp8=True, recipe="blockwise", backend="emulate", dtype="fp32",
                             fp8_backward=fp8_backward)
    fused, fused_ops = _main_grads(True, policy=policy)
    plain, plain_ops = _main_grads(False, policy=policy)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert fused[0].abs().sum() > 0
    assert plain_ops - fused_ops == 2 * 2  # two weights, two micro-batches
    assert LinearNumerics(policy, Role.MLP_FC1).accumulate_wgrad is False  # off unless the config says


def test_fp8_linear_without_main_grad_returns_its_weight_gradient() -> None:
    """Outside DDP (no ``main_grad``) the flag changes nothing: the gradient lands in ``weight.grad``."""
    policy = PrecisionPolicy(fp8=True, recipe="blockwise", backend="emulate", dtype="fp32")
    numerics = LinearNumerics(policy, Role.MLP_FC1, accumulate_wgrad=True)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 128, generator=gen).requires_grad_()
    x, g = torch.randn(6, 128, generator=gen), torch.randn(6, 256, generator=gen)
    numerics(x, w).backward(g)
    want = g.t() @ fp8.emulate(x, "blockwise", "activation")
    assert torch.equal(w.grad, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_accumulation_is_one_gemm_into_main_grad(dtype: torch.dtype) -> None:
    """On CUDA: ``main_grad += g^T x`` with the product accumulated in FP32 (one ``addmm`` for
    16-bit operands), within the FP32 dot-product bound ``gamma_(K+1) * (|main_grad| + |g|^T |x|)``
    (K = 4096 tokens; the operands are exact in FP32)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 384, device="cuda", generator=gen).to(dtype)
    g = torch.randn(4096, 256, device="cuda", generator=gen).to(dtype)
    main_grad = torch.randn(256, 384, device="cuda", generator=gen)
    exact = main_grad.double() + g.double().t() @ x.double()
    magnitude = main_grad.double().abs() + g.double().abs().t() @ x.double().abs()
    wgrad_accumulation.wgrad_gemm_accum_fp32(x, g, main_grad)
    u = 2.0**-24
    gamma = (x.shape[0] + 1) * u / (1 - (x.shape[0] + 1) * u)
    assert ((main_grad.double() - exact).abs() <= gamma * magnitude).all()
