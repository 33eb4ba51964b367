"""KimiDeltaAttention under context parallelism equals CP = 1: each CP rank's output rows and input
gradient rows, and every parameter gradient summed over the CP ranks (what megatron's DDP
reduction over the data-parallel x CP ranks does). BSHD and packed THD with document boundaries
inside the ranks' chunks (and documents straddling ranks); CP = 2 on 2 gloo processes and
CP = 2 x TP = 2 (sequence parallelism) on 4. The layer's parameters and their sharded state dict do
not depend on CP."""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.test_kda_tp import HIDDEN, _assert_tp_close
from tests.tp_harness import assert_sharded_grads, gather_sequence, shard

SEQ = 16
"""Tokens per row: 2 * CP = 4 chunks of 4 tokens; each CP rank holds chunks (0, 3) or (1, 2)."""
CP_CASES: list[Optional[list[int]]] = [None, [0, 5, 9, 16], [0, 11, 16]]
"""Packed THD boundaries (None: BSHD, batch 2). 5 and 9 cut chunks 1 and 2 (rank 1's), 11 chunk 2;
the document [0, 11) straddles both ranks."""
CP_TP_CASES: list[Optional[list[int]]] = [[0, 5, 9, 16]]
# The bound is tests/test_kda_tp.py's: CP regroups the same fp32 terms (the linears and the gates on
# another split of the rows, every weight gradient a sum over the tokens in two partial sums plus an
# all-reduce, the conv and the delta rule on a batch of H / CP heads instead of H); the recurrence,
# T tokens of (2 D + 2) dependent roundings, is the longest chain, so a reordered result differs by
# at most LONGEST_CHAIN * eps * max|CP = 1| (Higham, section 4.2). A CP bug (chunk order not undone,
# a head's conv rows on the wrong rank, a missing reduction) is off by O(max|CP = 1|).


def _layer(tp: int, cp: int, reference: Optional[torch.nn.Module]) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.test_kda import build_kda, our_config

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1234)
    cfg = our_config(-5.0, tensor_model_parallel_size=tp, context_parallel_size=cp,
                     cp_comm_type="all_gather" if cp > 1 else None,  # megatron's DSA config check
                     sequence_parallel=tp > 1, init_method_std=0.3)
    torch.manual_seed(0)  # the same CP = 1 reference on every process
    module = build_kda(cfg)
    if reference is None:
        with torch.no_grad():
            module.A_log.normal_(0.0, 1.0)  # decay rates that differ per head
    else:
        rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for param, ref in zip(module.parameters(), reference.parameters()):
                param.copy_(shard(ref, param, rank, tp))
    return module


def _run(tp: int, cp: int, cu: Optional[list[int]], x: torch.Tensor, weight: torch.Tensor,
         reference: Optional[torch.nn.Module] = None):
    """The layer at TP = ``tp``, CP = ``cp`` on this rank's rows of ``x``; forward, backward of
    ``sum(out * weight)`` over them and the gradient reductions of megatron's DDP (sum over CP:
    each rank's loss is its rows' part of the whole row's) and finalize_model_grads (TP). Returns
    (module, this CP rank's output rows, their input gradient, their positions)."""
    from megatron.core import parallel_state as ps

    from kpool_layers.dsa.context_parallel import local_positions
    from tests.test_kda import thd

    module = _layer(tp, cp, reference)
    tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    rows = local_positions(SEQ // cp, cp, ps.get_context_parallel_rank(), x.device)
    x_in, w_in = x[rows].detach(), weight[rows]
    if tp > 1:
        x_in, w_in = x_in.chunk(tp)[tp_rank].clone(), w_in.chunk(tp)[tp_rank]
    x_in.requires_grad_()
    out, _ = module(x_in, None, packed_seq_params=thd(cu) if cu is not None else None)
    (out * w_in).sum().backward()
    for param in module.parameters():
        if cp > 1:
            dist.all_reduce(param.grad, group=ps.get_context_parallel_group())
        if tp > 1 and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=tp_group)
        if tp > 1 and getattr(param, "average_gradients_across_tp_domain", False):
            dist.all_reduce(param.grad, group=tp_group)
            param.grad /= tp
    out, grad_x = out.detach(), x_in.grad
    if tp > 1:
        out, grad_x = (gather_sequence(t, tp, tp_group) for t in (out, grad_x))
    return module, out, grad_x, rows


def _worker(rank: int, world: int, port: int, tp: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    from kpool_layers.compat import cpu as _cpu

    _cpu.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    cp = world // tp
    for cu in CP_CASES if tp == 1 else CP_TP_CASES:
        case = f"tp={tp} cp={cp} thd={cu}"
        b = 1 if cu is not None else 2
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(SEQ, b, HIDDEN, generator=gen)
        weight = torch.randn(SEQ, b, HIDDEN, generator=gen)
        ref, ref_out, ref_gx, _ = _run(1, 1, cu, x, weight)
        mod, out, gx, rows = _run(tp, cp, cu, x, weight, reference=ref)
        _assert_tp_close(out, ref_out[rows], f"{case} output")
        _assert_tp_close(gx, ref_gx[rows], f"{case} input grad")
        sharded = mod.sharded_state_dict(prefix="kda.")
        for (name, _), ref_param in zip(mod.named_parameters(), ref.parameters()):
            assert tuple(sharded[f"kda.{name}"].global_shape) == tuple(ref_param.shape), (case, name)
        assert_sharded_grads(mod, ref, ps.get_tensor_model_parallel_rank(), tp, _assert_tp_close, case)
    dist.destroy_process_group()


@pytest.mark.dist
def test_cp2_equals_cp1() -> None:
    mp.spawn(_worker, args=(2, free_port(), 1), nprocs=2, join=True)


@pytest.mark.dist
def test_cp2_tp2_equals_cp1() -> None:
    mp.spawn(_worker, args=(4, free_port(), 2), nprocs=4, join=True)


def test_heads_must_divide_by_tp_times_cp() -> None:
    """The layer refuses H not a multiple of TP * CP, naming both sizes (the config rule, in
    recipes/config/rules.py, refuses it first for a training run)."""
    from kpool_layers.linear_attention.kda import _check_config
    from tests.test_kda import our_config

    _check_config(our_config(-5.0), tp=2, cp=2)  # its 4 heads over TP * CP = 4
    with pytest.raises(ValueError, match=r"linear_num_key_heads=4 must be a multiple of "
                                         r"tensor_model_parallel_size \* context_parallel_size = 1 \* 8"):
        _check_config(our_config(-5.0), tp=1, cp=8)


def test_memory_plan_counts_kda_under_cp() -> None:
    """At CP = 2 a rank keeps half of every layer's per-token activations (a KDA layer: the whole
    row for half its heads between its all-to-alls, as many elements as half the row for all of
    them) and, on DSA layers only, the whole row's keys gathered over CP; the KDA layers gather
    none (recipes/plan/memory_plan.py)."""
    from recipes.config.typed import to_config
    from recipes.plan import memory_plan
    from tests.test_config import _compose

    base = ["model=glm5_3_flash_tiny", "precision=fp32", "data.seq_length=64",
            "train.micro_batch_size=1", "train.global_batch_size=1"]
    groups = ([(0, 0)] * 5, {"embedding": (0, 0), "head": (0, 0), "mtp": (0, 0)})  # no parameters
    (one,) = memory_plan.plan_groups(to_config(_compose(base + ["parallelism=single"])), groups)
    cfg = to_config(_compose(base + ["parallelism=cp2"]))
    (two,) = memory_plan.plan_groups(cfg, groups)
    m = cfg.model
    keys = m.kv_lora_rank + m.qk_pos_emb_head_dim + 2 * m.dsa_indexer_head_dim  # KPool: + its gate
    dsa_layers = 3  # K D D K D
    gathered = dsa_layers * 64 * 4 * keys  # the whole row, fp32
    assert two.activations * memory_plan.GIB == pytest.approx(
        one.activations * memory_plan.GIB / 2 + gathered, rel=1e-12)
