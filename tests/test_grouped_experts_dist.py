"""Grouped experts under expert parallelism (EP = 2) and expert tensor parallelism (ETP = 2), in
megatron's ``MoELayer`` with its router and allgather dispatcher, against ``SequentialMLP``: the same
seed gives the same weight shards; output, input gradient and every parameter gradient; and a
sharded state dict identical to ``SequentialMLP``'s (keys, global shapes, offsets, replica ids).
Two gloo processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port

SETTINGS = ({"expert_model_parallel_size": 2}, {"expert_tensor_parallel_size": 2})


def _moe_layer(grouped: bool, parallel: dict):
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kpool_layers.spec import SPLocalSpecProvider

    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, moe_ffn_hidden_size=16,
        num_moe_experts=4, moe_router_topk=2, moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.float32, moe_grouped_gemm=grouped, **parallel,
    )
    builder = get_moe_module_spec_for_backend(SPLocalSpecProvider(), num_experts=4, moe_grouped_gemm=grouped)
    return builder(config=cfg, layer_number=1)


def _grads(layer) -> dict[str, torch.Tensor]:
    """Parameter gradients by SequentialMLP's names (grouped weights split per local expert)."""
    out = {}
    for name, p in layer.named_parameters():
        if name.endswith(("experts.weight1", "experts.weight2")):
            fc = "linear_fc1" if name.endswith("1") else "linear_fc2"
            for e, g in enumerate(p.grad.unbind(0)):
                out[f"experts.local_experts.{e}.{fc}.weight"] = g
        else:
            out[name] = p.grad
    return out


def _worker(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    from kpool_layers.compat import cpu as _cpu

    _cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from kpool_layers.moe.experts import GroupedExperts
    from tests.test_grouped_experts import _leaves

    dist.init_process_group("gloo", rank=rank, world_size=2)
    for parallel in SETTINGS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, **parallel)
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(0)
        seq = _moe_layer(False, parallel)
        torch.manual_seed(0)
        grouped = _moe_layer(True, parallel)
        assert isinstance(grouped.experts, GroupedExperts), parallel
        ref, got = seq.state_dict(), grouped.state_dict()  # same seed, same (expert-TP split) weights
        assert all(torch.equal(got[k], v) for k, v in ref.items() if isinstance(v, torch.Tensor)), parallel
        for p_seq, p_grp in ((seq.experts.local_experts[0].linear_fc1.weight, grouped.experts.weight1),
                             (seq.experts.local_experts[0].linear_fc2.weight, grouped.experts.weight2)):
            assert p_grp.allreduce == p_seq.allreduce and p_grp.tensor_model_parallel, parallel
        x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(rank))
        w = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(10 + rank))
        results = []
        for layer in (seq, grouped):
            xi = x.clone().requires_grad_()
            out, _ = layer(xi)
            (out * w).sum().backward()
            results.append((out.detach(), xi.grad, _grads(layer)))
        (o_s, gx_s, g_s), (o_g, gx_g, g_g) = results
        # Same per-expert GEMMs on the CPU (observed bit-equal); bounds: tests/test_grouped_experts.py.
        tight = dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o_g, o_s, **tight, msg=lambda m: f"{parallel} output: {m}")
        torch.testing.assert_close(gx_g, gx_s, **tight, msg=lambda m: f"{parallel} input grad: {m}")
        assert g_g.keys() == g_s.keys(), parallel
        for name, g in g_s.items():
            if g is None:
                assert g_g[name] is None, (parallel, name)
                continue
            torch.testing.assert_close(g_g[name], g, **tight, msg=lambda m, n=name: f"{parallel} {n}: {m}")
        ours, theirs = _leaves(grouped.sharded_state_dict()), _leaves(seq.sharded_state_dict())
        assert ours.keys() == theirs.keys(), parallel
        for key in theirs:
            for a, b in zip(ours[key], theirs[key], strict=True):
                assert a[:-1] == b[:-1], (parallel, key, a[:-1], b[:-1])
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.dist
def test_grouped_equals_sequential_under_ep2_and_etp2() -> None:
    mp.spawn(_worker, args=(free_port(),), nprocs=2, join=True)
