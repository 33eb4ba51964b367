"""kpool_layers.moe.permute: the expert-major row order of megatron's ``permute``, its inverse, and
the fixed-order sums of a token's expert rows (the combine and the permutation's backward), in torch
and in the Triton kernel (:mod:`kpool_layers.kernels.row_sum_triton`, under Triton's interpreter on
the CPU, on the GPU where there is one).

The sums add ``K`` rows in FP32, ``k`` ascending, and round once to the rows' dtype. Against the
exact (float64) sum of the same operands a result then errs by at most ``u |exact| + (1 + u)
gamma_{K-1} sum_k |rows_k|`` with ``u`` the unit roundoff of the rows' dtype (``2^-8`` BF16,
``2^-24`` FP32) and ``gamma_k = k 2^-24 / (1 - k 2^-24)``; the torch form and the kernel add in the
same order and are compared bit for bit."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from kpool_layers.moe.permute import combine_rows, expert_order, permute_rows, row_sum, torch_row_sum
from tests.interpreter import run_interpreted


def routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dropless top-``topk`` routing map ``[T, E]`` and FP32 probabilities (zero off the map)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    return routing_map, scores * routing_map


def _bound(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    u = 2.0**-8 if rows.dtype == torch.bfloat16 else 2.0**-24
    k = index.shape[1]
    gamma = (k - 1) * 2.0**-24 / (1 - (k - 1) * 2.0**-24)
    gathered = rows.double()[index]  # [T, K, H]
    return u * gathered.sum(1).abs() + (1 + u) * gamma * gathered.abs().sum(1)


@pytest.mark.parametrize("tokens,experts,topk", [(37, 6, 2), (64, 16, 4), (29, 9, 8), (5, 3, 3)])
def test_expert_order_is_megatrons_and_its_inverse(tokens: int, experts: int, topk: int) -> None:
    routing_map, probs = routing(tokens, experts, topk, seed=tokens)
    x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(1))
    ref_rows, ref_probs, ref_tokens, _, _ = permute(x, routing_map, probs=probs, num_out_tokens=tokens * topk)
    order = expert_order(routing_map, topk)
    assert torch.equal(order.row_tokens, ref_tokens)
    assert torch.equal(permute_rows(x, order), ref_rows)
    assert torch.equal(probs.t().reshape(-1)[order.flat], ref_probs)
    # token_rows: each token's own rows, ascending
    assert order.token_rows.shape == (tokens, topk)
    assert torch.equal(order.row_tokens[order.token_rows], torch.arange(tokens)[:, None].expand(-1, topk))
    assert bool((order.token_rows.diff(dim=1) > 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("topk", [1, 2, 8])
def test_row_sum_within_one_rounding_of_the_exact_sum(dtype: torch.dtype, topk: int) -> None:
    routing_map, _ = routing(41, 12, topk, seed=topk)
    order = expert_order(routing_map, topk)
    g = torch.Generator().manual_seed(2)
    rows = (torch.randn(41 * topk, 70, generator=g) * torch.logspace(-3, 3, 70)).to(dtype)
    out = torch_row_sum(rows, order.token_rows)
    exact = rows.double()[order.token_rows].sum(1)
    assert out.dtype == dtype
    assert bool(((out.double() - exact).abs() <= _bound(rows, order.token_rows)).all())
    # K == 1 and FP32: the sum is the row itself
    if topk == 1:
        assert torch.equal(out, rows[order.token_rows[:, 0]])


def test_combine_is_megatrons_unpermute_and_permute_its_adjoint() -> None:
    """FP64: the combine equals megatron's ``unpermute`` up to FP64 rounding, and the two maps'
    gradients are each other's (gradcheck)."""
    tokens, experts, topk = 23, 7, 3
    routing_map, _ = routing(tokens, experts, topk, seed=3)
    order = expert_order(routing_map, topk)
    y = torch.randn(tokens * topk, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref = unpermute(y, order.row_tokens, torch.Size((tokens, 5)))
    torch.testing.assert_close(combine_rows(y, order), ref, rtol=1e-14, atol=1e-14)
    x = torch.randn(tokens, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: permute_rows(v, order), (x,))
    assert torch.autograd.gradcheck(lambda v: combine_rows(v, order), (y.requires_grad_(),))


def test_kernel_equals_torch_bit_for_bit_under_the_interpreter() -> None:
    """The Triton kernel against :func:`torch_row_sum`: BF16 and FP32 rows, row widths below, at
    and above the kernel's channel block, ``K`` from 1 to 8, and no tokens."""
    out = run_interpreted(r"""
import torch
from kpool_layers.kernels.row_sum_triton import BLOCK_H, gather_row_sum
from kpool_layers.moe.permute import torch_row_sum
g = torch.Generator().manual_seed(0)
cases = 0
for dtype in (torch.bfloat16, torch.float32):
    for t, k, h in ((7, 1, 3), (5, 3, 130), (4, 8, BLOCK_H), (3, 4, BLOCK_H + 77), (0, 2, 16)):
        rows = (torch.randn(t * k + 3, h, generator=g) * torch.logspace(-4, 4, h)).to(dtype)
        index = torch.randint(0, t * k + 3, (t, k), generator=g)
        got, want = gather_row_sum(rows, index), torch_row_sum(rows, index)
        assert got.dtype == dtype and got.shape == (t, h), (got.dtype, got.shape)
        assert torch.equal(got, want), (dtype, t, k, h, (got.float() - want.float()).abs().max())
        cases += 1
print("cases", cases)
""")
    assert "cases 10" in out


def test_kernel_refuses_an_index_of_another_shape_or_dtype() -> None:
    from kpool_layers.kernels.row_sum_triton import gather_row_sum

    rows = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="index must be int64"):
        gather_row_sum(rows, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="index must be int64"):
        gather_row_sum(rows, torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_kernel_equals_torch_and_reruns_bit_for_bit() -> None:
    """On the GPU at glm5_proxy's MoE shape (4,096 tokens, top-4, hidden 2048) and at GLM-5's
    (top-8, hidden 6144): the kernel (through :func:`row_sum`) equals :func:`torch_row_sum` bit for
    bit, and reruns give the same bits."""
    for tokens, experts, topk, hidden in ((4096, 16, 4, 2048), (4096, 16, 8, 6144)):
        routing_map, _ = routing(tokens, experts, topk, seed=5)
        order = expert_order(routing_map.cuda(), topk)
        rows = torch.randn(tokens * topk, hidden, device="cuda").to(torch.bfloat16)
        got = row_sum(rows, order.token_rows)
        assert torch.equal(got, torch_row_sum(rows, order.token_rows))
        assert torch.equal(got, row_sum(rows, order.token_rows))
