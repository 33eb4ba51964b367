"""GLMSparseMLA at TP = 2 (with and without sequence parallelism, BSHD and packed THD, indexer loss
on, plain DSA and KPool with the tail) equals TP = 1: output, input gradient, every parameter
gradient, and both TP ranks select exactly TP = 1's top-k indices. Two gloo processes."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

from tests.tp_harness import copy_sharded, forward_backward, shard, spawn_two_ranks

CASES = [  # (sequence_parallel, packed THD boundaries, sparse indexer loss, kpool)
    (False, None, False, 1),
    (True, None, True, 1),
    (True, [0, 5, 9, 16], False, 1),
    (False, [0, 11, 16], True, 1),
    (True, None, True, 4),
    (False, [0, 5, 9, 16], False, 2),
]


EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
LONGEST_SUM = 32
"""The longest contraction in the layer: hidden size 32 and s * b = 32 tokens per weight gradient."""


def _assert_tp_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """TP = 2 splits contractions (over heads, over sequence-parallel tokens) into partial sums
    joined by an all-reduce, i.e. adds the same fp32 terms in another order. A reordered sum of n
    terms differs by at most (n - 1) * eps * sum|terms| (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., section 4.2); with n <= LONGEST_SUM and the tensor's largest
    magnitude as the scale of the terms: |TP2 - TP1| <= LONGEST_SUM * eps * max|TP1| (2.3e-5 for
    the largest gradient here, 6.1). Measured on these cases: at most 3.3 * eps * max|TP1| (random
    rounding errors add like a random walk, ~sqrt(n)), so the bound has a 10x margin that a loaded
    machine cannot use up, while a TP bug (missing all-reduce, wrong shard) is off by O(max|TP1|)."""
    atol = LONGEST_SUM * EPS32 * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol, msg=lambda m: f"{what}: {m}")


def _run(sp: bool, tp: int, cu: Optional[list[int]], sparse_loss: bool, kpool: int,
         x: torch.Tensor, weight: torch.Tensor, reference: Optional[torch.nn.Module] = None):
    """Build the layer at TP = ``tp`` (weights copied from ``reference`` when given), run forward
    and backward; returns (module, full output, full input grad, logged indexer losses, the
    indexer's top-k indices)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from kpool_layers.mla.attention import collect_indexer_losses
    from tests.test_attention import build, thd, tiny_config

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp,
                      dsa_indexer_loss_coeff=0.7, dsa_indexer_use_sparse_loss=sparse_loss,
                      init_method_std=0.3, dsa_indexer_kpool=kpool,
                      dsa_indexer_kpool_always_select_tail=kpool > 1)
    torch.manual_seed(0)
    module = build(cfg)
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    if reference is not None:
        copy_sharded(module, reference, rank, tp)
    packed = thd(cu) if cu is not None else None
    selected: list[torch.Tensor] = []
    module.indexer.register_forward_hook(lambda _m, _i, o: selected.append(o.topk_indices))
    out, grad_x = forward_backward(module, x, weight, sp, tp, group, packed_seq_params=packed)
    return module, out, grad_x, collect_indexer_losses(module), selected[0]


def _cases() -> None:
    for sp, cu, sparse_loss, kpool in CASES:
        case = f"sp={sp} thd={cu} sparse_loss={sparse_loss} kpool={kpool}"
        b = 1 if cu is not None else 2
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(16, b, 32, generator=gen)
        weight = torch.randn(16, b, 32, generator=gen)
        ref, ref_out, ref_gx, ref_losses, ref_idx = _run(False, 1, cu, sparse_loss, kpool, x, weight)
        mod, out, gx, losses, idx = _run(sp, 2, cu, sparse_loss, kpool, x, weight, reference=ref)
        ranks_idx = [torch.empty_like(idx) for _ in range(2)]
        dist.all_gather(ranks_idx, idx)
        assert all(torch.equal(r, ref_idx) for r in ranks_idx), f"{case}: top-k differs across TP"
        _assert_tp_close(out, ref_out, f"{case} output")
        _assert_tp_close(gx, ref_gx, f"{case} input grad")
        assert losses.keys() == ref_losses.keys() == {""}, case
        assert losses[""] == pytest.approx(ref_losses[""], rel=1e-5), (case, losses, ref_losses)
        tp_rank = dist.get_rank()
        for (name, param), ref_param in zip(mod.named_parameters(), ref.parameters()):
            if ref_param.grad is None:
                assert param.grad is None and not param.requires_grad, f"{case} {name}"
                continue
            want = shard(ref_param.grad, param, tp_rank, 2)
            _assert_tp_close(param.grad, want, f"{case} grad {name}")


@pytest.mark.dist
def test_tp2_equals_tp1() -> None:
    spawn_two_ranks(_cases)
