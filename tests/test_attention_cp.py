"""GLMSparseMLA under context parallelism equals CP = 1: each CP rank's output rows and input
gradient rows, the parameter gradients summed over CP ranks (what DDP's reduction over the
data-parallel x CP ranks does), the logged indexer loss, and every rank's top-k indices for its
queries. BSHD and packed THD (documents straddling the ranks' chunks), dense and sparse indexer
loss, plain DSA and KPool with the tail; CP = 2 on 2 gloo processes and CP = 2 x TP = 2 (with
sequence parallelism) on 4. Also: the batch split of the training loop
(:func:`recipes.train.data.context_parallel_slice`, megatron's) holds exactly the positions the layer
assumes (:func:`kpool_layers.dsa.context_parallel.local_positions`)."""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.test_attention_tp import _assert_tp_close
from tests.tp_harness import assert_sharded_grads, gather_sequence, shard

CP_CASES = [  # (packed THD boundaries, sparse indexer loss, kpool)
    (None, False, 1),
    (None, True, 1),
    ([0, 5, 9, 16], False, 1),
    ([0, 11, 16], True, 1),
    (None, True, 4),
    ([0, 5, 9, 16], False, 2),
]
CP_TP_CASES = [  # TP = 2 with sequence parallelism
    ([0, 11, 16], True, 1),
    (None, False, 4),
]
SEQ = 16


def _layer(tp: int, cp: int, cu: Optional[list[int]], sparse_loss: bool, kpool: int,
           reference: Optional[torch.nn.Module]) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.test_attention import build, tiny_config

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(tensor_model_parallel_size=tp, context_parallel_size=cp,
                      cp_comm_type="all_gather" if cp > 1 else None,
                      sequence_parallel=tp > 1, dsa_indexer_loss_coeff=0.7,
                      dsa_indexer_use_sparse_loss=sparse_loss, init_method_std=0.3,
                      dsa_indexer_kpool=kpool, dsa_indexer_kpool_always_select_tail=kpool > 1)
    torch.manual_seed(0)
    module = build(cfg)
    if reference is not None:
        rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for param, ref in zip(module.parameters(), reference.parameters()):
                param.copy_(shard(ref, param, rank, tp))
    return module


def _run(tp: int, cp: int, cu: Optional[list[int]], sparse_loss: bool, kpool: int,
         x: torch.Tensor, weight: torch.Tensor, reference: Optional[torch.nn.Module] = None):
    """The layer at TP = ``tp``, CP = ``cp`` on this rank's rows of ``x``; forward, backward of
    ``sum(out * weight)`` and the gradient reductions of megatron's DDP and finalize_model_grads
    (sum over CP: each rank's loss is its rows' part of the whole row's). Returns (module, this
    CP rank's output rows, their input grad, mean logged indexer loss over CP, top-k, positions)."""
    from megatron.core import parallel_state as ps

    from kpool_layers.mla.attention import collect_indexer_losses
    from kpool_layers.dsa.context_parallel import local_positions
    from tests.test_attention import thd

    module = _layer(tp, cp, cu, sparse_loss, kpool, reference)
    tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    cp_group = ps.get_context_parallel_group()
    rows = local_positions(SEQ // cp, cp, ps.get_context_parallel_rank(), x.device)
    x_in = x[rows].detach()
    w_in = weight[rows]
    if tp > 1:
        x_in, w_in = x_in.chunk(tp)[tp_rank].clone(), w_in.chunk(tp)[tp_rank]
    x_in.requires_grad_()
    selected: list[torch.Tensor] = []
    module.indexer.register_forward_hook(lambda _m, _i, o: selected.append(o.topk_indices))
    out, _ = module(x_in, None, packed_seq_params=thd(cu) if cu is not None else None)
    (out * w_in).sum().backward()
    for param in module.parameters():
        if param.grad is None:  # frozen (the KPool ape)
            continue
        if cp > 1:
            dist.all_reduce(param.grad, group=cp_group)
        if tp > 1 and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=tp_group)
        if tp > 1 and getattr(param, "average_gradients_across_tp_domain", False):
            dist.all_reduce(param.grad, group=tp_group)
            param.grad /= tp
    out, grad_x = out.detach(), x_in.grad
    if tp > 1:
        out, grad_x = (gather_sequence(t, tp, tp_group) for t in (out, grad_x))
    losses = collect_indexer_losses(module)
    loss = torch.tensor(losses[""], dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(loss, group=cp_group)
        loss /= cp
    return module, out, grad_x, float(loss), selected[0], rows


def _check_batch_split() -> None:
    """The loop's split (megatron's get_batch_on_this_cp_rank) keeps the layer's positions."""
    from megatron.core import parallel_state as ps

    from kpool_layers.dsa.context_parallel import local_positions
    from recipes.train.data import context_parallel_slice

    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones(2, SEQ),
             "position_ids": tokens % SEQ}
    part = context_parallel_slice(batch)
    cp = ps.get_context_parallel_world_size()
    rows = local_positions(SEQ // cp, cp, ps.get_context_parallel_rank(), tokens.device)
    for key, value in batch.items():
        assert torch.equal(part[key], value[:, rows]), key


def _worker(rank: int, world: int, port: int, tp: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    from kpool_layers.compat import cpu as _cpu

    _cpu.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp = world // tp
    for cu, sparse_loss, kpool in CP_CASES if tp == 1 else CP_TP_CASES:
        case = f"tp={tp} cp={cp} thd={cu} sparse_loss={sparse_loss} kpool={kpool}"
        b = 1 if cu is not None else 2
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(SEQ, b, 32, generator=gen)
        weight = torch.randn(SEQ, b, 32, generator=gen)
        ref, ref_out, ref_gx, ref_loss, ref_idx, _ = _run(1, 1, cu, sparse_loss, kpool, x, weight)
        mod, out, gx, loss, idx, rows = _run(tp, cp, cu, sparse_loss, kpool, x, weight, reference=ref)
        assert torch.equal(idx, ref_idx[:, rows]), f"{case}: top-k differs from CP = 1's"
        _assert_tp_close(out, ref_out[rows], f"{case} output")
        _assert_tp_close(gx, ref_gx[rows], f"{case} input grad")
        assert loss == pytest.approx(ref_loss, rel=1e-5), (case, loss, ref_loss)
        from megatron.core import parallel_state as ps

        assert_sharded_grads(mod, ref, ps.get_tensor_model_parallel_rank(), tp, _assert_tp_close, case)
        _check_batch_split()
    dist.destroy_process_group()


@pytest.mark.dist
def test_cp2_equals_cp1() -> None:
    mp.spawn(_worker, args=(2, free_port(), 1), nprocs=2, join=True)


@pytest.mark.dist
def test_cp2_tp2_equals_cp1() -> None:
    mp.spawn(_worker, args=(4, free_port(), 2), nprocs=4, join=True)
