"""Indexer KL loss: megatron's ``compute_dsa_indexer_loss`` for plain DSA (value and gradients),
a per-query loop for KPool, and query-chunk invariance."""

from __future__ import annotations

import pytest
import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss
from megatron.core.transformer.experimental_attention_variant.dsa_masking import (
    generate_varlen_mask_params,
)

from kpool_layers.dsa.indexer import DSAIndexer
from kpool_layers.dsa.indexer_loss import indexer_kl_loss
from kpool_layers.dsa.topk import index_scores
from tests.test_indexer import tiny_config

SCALE = 0.4


def run_indexer(cfg, s: int, b: int, cu=None, seed: int = 0):
    torch.manual_seed(seed)
    indexer = DSAIndexer(cfg, layer_number=1)
    if cfg.dsa_indexer_kpool > 1:
        with torch.no_grad():
            indexer.index_kpool_compress_gate.weight.normal_()
            indexer.index_kpool_compress_ape.normal_()
    out = indexer(torch.randn(s, b, 16), torch.randn(s, b, 8), cu_seqlens=cu)
    main_q, main_k = torch.randn(s, b, 3, 6), torch.randn(s, b, 1, 6)
    return indexer, out, main_q, main_k


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_plain_matches_megatron(
    single_rank_parallel_state, sparse: bool, packed: bool, relu: bool
) -> None:
    s, b = 13, 1 if packed else 2
    cu = torch.tensor([0, 4, 13], dtype=torch.int32) if packed else None
    cfg = tiny_config(dsa_indexer_scoring_relu=relu, dsa_indexer_loss_coeff=0.5, dsa_indexer_topk=3)
    indexer, out, main_q, main_k = run_indexer(cfg, s, b, cu)
    ours = indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=sparse, cu_seqlens=cu)

    scores = torch.stack(
        [index_scores(out.q[:, r], out.keys[:, r], out.weights[:, r], relu=relu) for r in range(b)]
    )
    varlen = {}
    if packed:
        starts, ends = generate_varlen_mask_params(cu)
        varlen = dict(varlen_starts=starts, varlen_ends=ends)
    reference = compute_dsa_indexer_loss(
        scores, out.topk_indices, main_q, main_k.expand(-1, -1, 3, -1), SCALE, 0.5, sparse,
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]), **varlen,
    )
    torch.testing.assert_close(ours, reference)
    tensors = [out.q, out.weights, out.keys]
    grads = torch.autograd.grad(ours, tensors, retain_graph=True)
    for a, r in zip(grads, torch.autograd.grad(reference, tensors)):
        torch.testing.assert_close(a, r)


def loop_kpool_loss(
    out, main_q, main_k, *, kpool: int, sparse: bool, relu: bool, coeff: float
) -> torch.Tensor:
    """One query at a time: pool mass of the main attention vs softmax of the pool scores."""
    layout = out.layout
    s, b = main_q.shape[:2]
    total = torch.zeros((), dtype=torch.float64)
    for r in range(b):
        for p in range(s):
            start = int(layout.doc_start[p])
            tokens = list(range(start, p + 1))
            pools = list(range(int(layout.query_lo[p]), int(layout.query_hi[p])))
            if sparse:
                chosen = set(out.topk_indices[r, p].tolist())
                tokens = [t for t in tokens if t in chosen]
                pools = [j for j in pools if int(layout.pool_start[j]) in chosen]
            if not pools:
                continue
            logits = main_q[p, r].double() @ main_k[tokens, r, 0].double().T * SCALE  # [heads, tokens]
            mass = torch.softmax(logits, dim=-1).sum(0)
            first = [int(layout.pool_start[j]) for j in pools]
            target = torch.stack([
                sum(m for t, m in zip(tokens, mass) if 0 <= t - f < kpool) + 0 * mass[0]
                for f in first
            ])
            target = target / target.sum()
            q, keys, w = out.q[p:p + 1, r], out.keys[pools, r], out.weights[p:p + 1, r]
            pred = index_scores(q.double(), keys.double(), w.double(), relu=relu)[0]
            log_pred = torch.log_softmax(pred, dim=0)
            total = total + (target * (torch.log(target.clamp_min(1e-10)) - log_pred)).sum()
    return total / (b * s) * coeff


@pytest.mark.parametrize("kpool", [2, 4])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("tail", [False, True])
def test_kpool_matches_loop(single_rank_parallel_state, kpool: int, sparse: bool, tail: bool) -> None:
    cu = torch.tensor([0, kpool - 1, 4 * kpool + 2, 9 * kpool], dtype=torch.int32)
    s = int(cu[-1])
    cfg = tiny_config(
        dsa_indexer_kpool=kpool, dsa_indexer_topk=2 * kpool, dsa_indexer_kpool_always_select_tail=tail,
        dsa_indexer_scoring_relu=False, dsa_indexer_query_chunk_size=7,
    )
    indexer, out, main_q, main_k = run_indexer(cfg, s, 1, cu, seed=kpool)
    ours = indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=sparse, cu_seqlens=cu)
    expected = loop_kpool_loss(out, main_q, main_k, kpool=kpool, sparse=sparse, relu=False, coeff=1.0)
    assert ours.item() > 0
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)
    tensors = [out.q, out.weights, out.keys]
    grads = torch.autograd.grad(ours, tensors, retain_graph=True)
    for a, r in zip(grads, torch.autograd.grad(expected, tensors)):
        torch.testing.assert_close(a, r.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kpool", [1, 4])
def test_chunk_size_invariance(single_rank_parallel_state, kpool: int) -> None:
    s, b = 21, 2
    values = []
    for chunk in (1, 4, 64):
        cfg = tiny_config(
            dsa_indexer_kpool=kpool, dsa_indexer_topk=2 * kpool, dsa_indexer_query_chunk_size=chunk
        )
        indexer, out, main_q, main_k = run_indexer(cfg, s, b, seed=3)
        values.append(indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=False))
    torch.testing.assert_close(values[0], values[1])
    torch.testing.assert_close(values[0], values[2])


def test_mismatched_cu_seqlens_rejected(single_rank_parallel_state) -> None:
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    indexer, out, main_q, main_k = run_indexer(tiny_config(), 8, 1, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=False)


def reference_slot_mass(main_q, main_k, topk, key_start):
    """Each slot's attention probability summed over heads, [b, s, W] (what the Triton sparse-MLA
    forward returns with ``return_slot_probs``): softmax over the valid slots of every query."""
    s, b, n, _ = main_q.shape
    rows = torch.arange(s)
    valid = (topk >= key_start[None, :, None]) & (topk <= rows[None, :, None])  # [b, s, W]
    keys = main_k[:, :, 0].transpose(0, 1)  # [b, s, d]
    k_sel = torch.stack([keys[i][topk[i].clamp_min(0)] for i in range(b)])  # [b, s, W, d]
    logits = torch.einsum("sbnd,bswd->bsnw", main_q, k_sel) * SCALE
    probs = torch.softmax(logits.masked_fill(~valid[:, :, None], float("-inf")), dim=-1)
    return torch.nan_to_num(probs).sum(2) * valid


@pytest.mark.parametrize("kpool,tail", [(1, False), (2, False), (4, True)])
@pytest.mark.parametrize("packed", [False, True])
def test_sparse_target_from_slot_mass_equals_the_recomputed_one(
        single_rank_parallel_state, kpool: int, tail: bool, packed: bool) -> None:
    """The sparse loss from the attention forward's slot probabilities (no second attention pass)
    is the loss that recomputes the main attention: value and gradients, float64."""
    cu = torch.tensor([0, kpool + 1, 6 * kpool + 1], dtype=torch.int32) if packed else None
    s = 6 * kpool + 1
    b = 1 if packed else 2
    cfg = tiny_config(dsa_indexer_kpool=kpool, dsa_indexer_topk=2 * kpool,
                      dsa_indexer_kpool_always_select_tail=tail, dsa_indexer_query_chunk_size=5)
    indexer, out, main_q, main_k = run_indexer(cfg, s, b, cu, seed=kpool)
    indexer.double()
    out.q, out.weights, out.keys = out.q.double(), out.weights.double(), out.keys.double()
    main_q, main_k = main_q.double(), main_k.double()
    key_start = out.layout.doc_start
    mass = reference_slot_mass(main_q, main_k, out.topk_indices, key_start)
    ours = indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=True, cu_seqlens=cu,
                           slot_mass=mass)
    expected = indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=True, cu_seqlens=cu)
    assert expected.item() > 0
    torch.testing.assert_close(ours, expected.to(ours.dtype), rtol=1e-10, atol=1e-12)
    tensors = [out.q, out.weights, out.keys]
    for a, r in zip(torch.autograd.grad(ours, tensors, retain_graph=True),
                    torch.autograd.grad(expected, tensors)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="sparse"):
        indexer_kl_loss(indexer, out, main_q, main_k, SCALE, sparse=False, cu_seqlens=cu,
                        slot_mass=mass)
