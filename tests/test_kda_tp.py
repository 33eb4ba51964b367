"""KimiDeltaAttention at TP = 2 (with and without sequence parallelism, BSHD and packed THD)
equals TP = 1: output, input gradient and every parameter gradient (sharded ones against their
slice). Two gloo processes."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

from tests.tp_harness import copy_sharded, forward_backward, shard, spawn_two_ranks

CASES = [(False, None), (True, None), (True, [0, 5, 9, 16]), (False, [0, 11, 16])]
"""(sequence_parallel, packed THD boundaries)"""

EPS32 = torch.finfo(torch.float32).eps
T, HIDDEN, HEADS, HEAD_DIM = 16, 32, 4, 8
LONGEST_CHAIN = max(HIDDEN, 2 * T, HEADS * HEAD_DIM, T * (2 * HEAD_DIM + 2))
"""TP = 2 splits the heads and the rank-D gate projections: the same fp32 terms are summed in
another order (all-reduces of partial sums over 32-long contractions; per-head work of another
batch shape). A reordered sum of n terms differs by at most (n - 1) * eps * sum|terms| (Higham,
section 4.2); the longest chain of dependent roundings is the recurrence, T tokens of (2 D + 2)
operations each, carried without growth (tests/test_kda.py, _recurrence_bound). A TP bug (a
missing all-reduce, a wrong shard) is off by O(max|TP1|)."""


def _assert_tp_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol = LONGEST_CHAIN * EPS32 * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol, msg=lambda m: f"{what}: {m}")


def _run(sp: bool, tp: int, cu: Optional[list[int]], x: torch.Tensor, weight: torch.Tensor,
         reference: Optional[torch.nn.Module] = None):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.test_kda import build_kda, our_config, thd

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = our_config(-5.0, tensor_model_parallel_size=tp, sequence_parallel=sp, init_method_std=0.3)
    torch.manual_seed(0)  # the same TP = 1 reference on both processes
    module = build_kda(cfg)
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    if reference is None:
        with torch.no_grad():
            module.A_log.normal_(0.0, 1.0)  # decay rates that differ per head
    else:
        copy_sharded(module, reference, rank, tp)
    out, grad_x = forward_backward(module, x, weight, sp, tp, group,
                                   packed_seq_params=thd(cu) if cu is not None else None)
    return module, out, grad_x


def _check_sharded_state_dict(mod: torch.nn.Module, ref: torch.nn.Module, case: str) -> None:
    """Every parameter is a ShardedTensor of TP = 1's global shape; this rank's slice for the
    TP-split ones (the linears' and the layer's own conv / dt_bias / A_log), whole otherwise."""
    sharded = mod.sharded_state_dict(prefix="kda.")
    rank = dist.get_rank()
    for (name, param), ref_param in zip(mod.named_parameters(), ref.parameters()):
        tensor = sharded[f"kda.{name}"]
        assert tuple(tensor.global_shape) == tuple(ref_param.shape), (case, name, tensor)
        assert tuple(tensor.local_shape) == tuple(param.shape), (case, name, tensor)
        split = getattr(param, "tensor_model_parallel", False)
        offset = [0] * param.dim()
        if split:
            offset[param.partition_dim] = rank * param.shape[param.partition_dim]
        assert list(tensor.global_offset) == offset, (case, name, tensor)


def _cases() -> None:
    for sp, cu in CASES:
        case = f"sp={sp} thd={cu}"
        b = 1 if cu is not None else 2
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(T, b, HIDDEN, generator=gen)
        weight = torch.randn(T, b, HIDDEN, generator=gen)
        ref, ref_out, ref_gx = _run(False, 1, cu, x, weight)
        mod, out, gx = _run(sp, 2, cu, x, weight, reference=ref)
        _assert_tp_close(out, ref_out, f"{case} output")
        _assert_tp_close(gx, ref_gx, f"{case} input grad")
        _check_sharded_state_dict(mod, ref, case)
        names = [name for name, _ in mod.named_parameters()]
        assert names == [name for name, _ in ref.named_parameters()], case
        for (name, param), ref_param in zip(mod.named_parameters(), ref.parameters()):
            want = shard(ref_param.grad, param, dist.get_rank(), 2)
            _assert_tp_close(param.grad, want, f"{case} grad {name}")


@pytest.mark.dist
def test_tp2_equals_tp1() -> None:
    spawn_two_ranks(_cases)
