"""kpool_layers.moe.layer: megatron's allgather token dispatch for local experts without host
synchronisations, and the same MoE layer output and gradients as megatron's."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

from kpool_layers.moe.experts import GroupedExperts
from kpool_layers.moe.layer import GLMMoELayer, LocalTokenDispatcher

HIDDEN, EXPERTS, TOPK = 16, 6, 2


@pytest.fixture(autouse=True)
def _fresh_metrics_tracker():
    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def config(**overrides: object) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=32,
                moe_ffn_hidden_size=24, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32)
    return TransformerConfig(**{**base, **overrides})


def _experts(grouped: bool):
    if grouped:
        return GroupedExperts
    return partial(SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def layers(cfg: TransformerConfig, grouped: bool) -> tuple[MoELayer, GLMMoELayer]:
    """megatron's MoE layer and ours with the same weights, training."""
    built = []
    for cls in (MoELayer, GLMMoELayer):
        torch.manual_seed(0)
        layer = cls(cfg, submodules=MoESubmodules(experts=_experts(grouped), router=TopKRouter), layer_number=1)
        built.append(layer.train())
    built[1].load_state_dict(built[0].state_dict())
    return built[0], built[1]


class _OwnOpNames(TorchDispatchMode):
    """aten op names run by an MoE layer's own code (the dispatcher's), outside its router and
    experts."""

    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.names: list[str] = []
        self._inside = 0
        for child in (layer.router, layer.experts):
            child.register_forward_pre_hook(lambda *_: setattr(self, "_inside", self._inside + 1))
            child.register_forward_hook(lambda *_: setattr(self, "_inside", self._inside - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN204
        if not self._inside and torch._C._current_autograd_node() is None:
            self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grouped", [False, True])
def test_same_output_and_gradients_as_megatron_without_host_syncs(single_rank_parallel_state,
                                                                  grouped: bool) -> None:
    cfg = config()
    ref, ours = layers(cfg, grouped)
    assert ours.local_token_dispatch and type(ours.token_dispatcher) is LocalTokenDispatcher
    x = torch.randn(7, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(7, 3, HIDDEN, generator=torch.Generator().manual_seed(2))
    results = []
    for layer in (ref, ours):
        inp = x.clone().requires_grad_()
        with _OwnOpNames(layer) as ops:
            out, _ = layer(inp)
        (out * weight).sum().backward()
        grads = {name: p.grad for name, p in layer.named_parameters()}
        results.append((out.detach(), inp.grad, grads, ops.names))
    (out_ref, dx_ref, g_ref, ops_ref), (out, dx, g, ops) = results
    assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[k], g_ref[k]) for k in g)
    # megatron's dispatch reads the counts' sum on the host (.item()) and selects the probs with
    # masked_select (a host sync on a GPU); ours does neither
    assert "_local_scalar_dense" in ops_ref and "masked_select" in ops_ref
    assert "_local_scalar_dense" not in ops and "masked_select" not in ops


def test_capacity_factor_keeps_megatrons_allgather_dispatcher(single_rank_parallel_state) -> None:
    """Token dropping makes the permuted size data dependent: megatron's dispatcher stays."""
    torch.manual_seed(0)
    layer = GLMMoELayer(config(moe_expert_capacity_factor=1.0),
                        submodules=MoESubmodules(experts=_experts(False), router=TopKRouter), layer_number=1)
    assert not layer.local_token_dispatch
    assert type(layer.token_dispatcher) is MoEAllGatherTokenDispatcher



def test_combine_adds_each_tokens_expert_rows_in_fp32_in_a_fixed_order(single_rank_parallel_state) -> None:
    """BF16, top-4: the layer's output is :func:`kpool_layers.moe.permute.torch_row_sum` of the
    experts' rows (FP32 sums, ``k`` ascending, one BF16 rounding; megatron's ``scatter_add`` rounds
    to BF16 after every addition), bit for bit, and a rerun gives the same bits. The permutation's
    backward is the same sum (``tests/test_moe_permute.py``)."""
    from kpool_layers.moe.permute import torch_row_sum

    cfg = config(moe_router_topk=4, params_dtype=torch.bfloat16, bf16=True)
    _, ours = layers(cfg, grouped=True)
    seen = {}
    ours.experts.register_forward_hook(lambda module, args, out: seen.update(rows=out[0]))
    x = torch.randn(9, 2, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out, _ = ours(x)
    token_rows = ours.token_dispatcher.order.token_rows
    assert token_rows.shape == (18, 4)
    assert torch.equal(out.reshape(18, HIDDEN), torch_row_sum(seen["rows"], token_rows))
    assert torch.equal(ours(x)[0], out)
