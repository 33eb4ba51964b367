"""KPool contract: ``kpool_topk`` against an obviously-correct loop, the layer's chunked path,
kpool = 1 == plain DSA, FP32 ape under Float16Module, gradients and saved-tensor memory."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from megatron.core.transformer.module import Float16Module
from torch.func import functional_call

from kpool_layers.dsa.indexer import DSAIndexer
from kpool_layers.dsa.indexer_loss import indexer_kl_loss
from kpool_layers.dsa.kpool import kpool_select, kpool_topk, pool_keys, pool_layout
from kpool_layers.dsa.topk import chunked_range_topk
from tests.test_indexer import causal_topk, random_qkw, tiny_config


def slow_kpool_topk(q, k, gate, ape, w, *, kpool, topk, tail, relu, lengths):
    """Every query, every pool, in plain Python floats."""
    q, k, gate, ape, w = (x.tolist() for x in (q, k, gate, ape, w))
    act = (lambda x: max(x, 0.0)) if relu else (lambda x: x)
    width = topk + (kpool - 1 if tail else 0)
    out = []
    base = 0
    for length in lengths:
        pooled = []
        for j in range(length // kpool):
            toks = [base + j * kpool + m for m in range(kpool)]
            key = []
            for ch in range(len(k[0])):
                logits = [gate[tm][ch] + ape[m][ch] for m, tm in enumerate(toks)]
                top = max(logits)
                e = [math.exp(x - top) for x in logits]
                key.append(sum(e[m] / sum(e) * k[tm][ch] for m, tm in enumerate(toks)))
            pooled.append(key)
        for p in range(length):
            t = base + p
            seen = (p + 1) // kpool
            score = [
                sum(wh * act(sum(a * c for a, c in zip(qh, pooled[j]))) for wh, qh in zip(w[t], q[t]))
                for j in range(seen)
            ]
            best = sorted(range(seen), key=lambda j: (-score[j], j))[: topk // kpool]
            row = [base + j * kpool + m for j in sorted(best) for m in range(kpool)]
            row += [-1] * (topk - len(row))
            if tail:
                rest = list(range(base + seen * kpool, t + 1))
                row += rest + [-1] * (kpool - 1 - len(rest))
            assert len(row) == width
            out.append(row)
        base += length
    return torch.tensor(out, dtype=torch.long)


def random_case(lengths, kpool, seed, dtype=torch.float64):
    t = sum(lengths)
    q, k, w = random_qkw(t, h=2, d=4, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 100)
    gate = torch.randn(t, 4, generator=g, dtype=dtype)
    ape = torch.randn(kpool, 4, generator=g, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, gate, ape, w, cu


@pytest.mark.parametrize("kpool", [2, 4, 8])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_kpool_topk_matches_loop(kpool: int, tail: bool, relu: bool, packed: bool) -> None:
    # documents shorter than kpool, with few pools (< topk / kpool) and with many pools
    lengths = [kpool - 1, 2 * kpool + 1, 7 * kpool + 1] if packed else [7 * kpool + 3]
    q, k, gate, ape, w, cu = random_case(lengths, kpool, seed=kpool + 10 * tail + 20 * relu)
    topk = 3 * kpool
    ours = kpool_topk(
        q, k, gate, ape, w, kpool=kpool, topk=topk, always_select_tail=tail, relu=relu,
        cu_seqlens=cu if packed else None,
    )
    expected = slow_kpool_topk(
        q, k, gate, ape, w, kpool=kpool, topk=topk, tail=tail, relu=relu, lengths=lengths
    )
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("kpool", [2, 4])
@pytest.mark.parametrize("relu", [False, True])
def test_chunked_select_equals_reference(kpool: int, relu: bool) -> None:
    lengths = [kpool - 1, 5 * kpool + 1, 3 * kpool + 3]
    q, k, gate, ape, w, cu = random_case(lengths, kpool, seed=3)
    layout = pool_layout(sum(lengths), kpool, cu)
    keys = pool_keys(k, gate, ape, layout)
    options = dict(topk=2 * kpool, always_select_tail=True, relu=relu)
    expected = kpool_topk(q, k, gate, ape, w, kpool=kpool, cu_seqlens=cu, **options)
    for chunk in (1, 5, 64):
        ours = kpool_select(q, keys, w, layout, range_topk=partial(chunked_range_topk, chunk_size=chunk),
                            **options)
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("relu", [False, True])
def test_kpool_one_is_plain_dsa(relu: bool) -> None:
    cu = torch.tensor([0, 6, 17], dtype=torch.int32)
    q, k, w = random_qkw(17, seed=8)
    gate, ape = torch.randn(17, 8), torch.randn(1, 8)
    ours = kpool_topk(
        q, k, gate, ape, w, kpool=1, topk=5, always_select_tail=True, relu=relu, cu_seqlens=cu
    )
    assert torch.equal(ours, causal_topk(q, k, w, topk=5, relu=relu, chunk_size=4, cu_seqlens=cu))
    layout = pool_layout(17, 1, cu)
    assert torch.equal(pool_keys(k, gate, ape, layout), k)  # one slot: the token key, bit for bit


def _layer_inputs(indexer: DSAIndexer, hidden: torch.Tensor, latent: torch.Tensor):
    """Unrotated index queries, token keys and gate logits recomputed from the layer's submodules
    (NoPE; the rotation, which is on, is left to ``kpool_topk(rotate=True)``: after pooling)."""
    q = indexer.linear_wq_b(latent).view(latent.shape[0], indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.linear_wk(hidden))
    return q, k, indexer.index_kpool_compress_gate(hidden)


@pytest.mark.parametrize("tail", [False, True])
def test_layer_indices_equal_kpool_topk(single_rank_parallel_state, tail: bool) -> None:
    cfg = tiny_config(
        dsa_indexer_kpool=2, dsa_indexer_kpool_always_select_tail=tail, dsa_indexer_topk=4,
        dsa_indexer_query_chunk_size=3,
    )
    indexer = DSAIndexer(cfg, layer_number=1)
    with torch.no_grad():  # a non-trivial gate and ape
        indexer.index_kpool_compress_gate.weight.normal_()
        indexer.index_kpool_compress_ape.normal_()
    cu = torch.tensor([0, 1, 8, 19], dtype=torch.int32)
    hidden, latent = torch.randn(19, 1, 16), torch.randn(19, 1, 8)
    out = indexer(hidden, latent, cu_seqlens=cu)
    assert cfg.dsa_indexer_rotate_activation
    q, k, gate = _layer_inputs(indexer, hidden[:, 0], latent[:, 0])
    expected = kpool_topk(
        q, k, gate, indexer.index_kpool_compress_ape, out.weights[:, 0], kpool=2, topk=4,
        always_select_tail=tail, relu=cfg.dsa_indexer_scoring_relu, cu_seqlens=cu, rotate=True,
    )
    assert out.topk_indices.shape == (1, 19, cfg.dsa_indexer_output_width)
    assert torch.equal(out.topk_indices[0], expected)
    assert out.weights.dtype == torch.float32


def test_ape_stays_fp32_under_float16_module(single_rank_parallel_state) -> None:
    cfg = tiny_config(dsa_indexer_kpool=4, dsa_indexer_topk=8)
    indexer = DSAIndexer(cfg, layer_number=1)
    assert not indexer.index_kpool_compress_ape.requires_grad  # frozen by default
    bf16 = tiny_config(dsa_indexer_kpool=4, dsa_indexer_topk=8, bf16=True, params_dtype=torch.bfloat16)
    wrapped = Float16Module(bf16, indexer)
    inner = wrapped.module
    assert inner.index_kpool_compress_ape.dtype == torch.float32
    assert inner.index_kpool_compress_gate.weight.dtype == torch.bfloat16
    assert inner.linear_wk.weight.dtype == torch.bfloat16
    out = inner(torch.randn(12, 1, 16).bfloat16(), torch.randn(12, 1, 8).bfloat16())
    assert out.keys.dtype == torch.bfloat16 and out.weights.dtype == torch.float32
    assert inner.index_kpool_compress_ape.dtype == torch.float32


def test_ape_trainable_when_configured(single_rank_parallel_state) -> None:
    indexer = DSAIndexer(tiny_config(dsa_indexer_kpool=2, dsa_indexer_kpool_train_ape=True), 1)
    assert indexer.index_kpool_compress_ape.requires_grad


@pytest.mark.parametrize("sparse", [False, True])
def test_kpool_loss_gradcheck(single_rank_parallel_state, sparse: bool) -> None:
    cfg = tiny_config(
        hidden_size=8, q_lora_rank=4, dsa_indexer_head_dim=4, dsa_indexer_kpool=2, dsa_indexer_topk=4,
        dsa_indexer_kpool_train_ape=True, dsa_indexer_kpool_always_select_tail=True,
        dsa_indexer_scoring_relu=False, dsa_indexer_query_chunk_size=4,
    )
    indexer = DSAIndexer(cfg, layer_number=1)
    g = torch.Generator().manual_seed(0)
    names = [n for n, _ in indexer.named_parameters()]
    params = [
        torch.randn(p.shape, generator=g, dtype=torch.float64, requires_grad=True)
        for _, p in indexer.named_parameters()
    ]
    s = 11  # the second document has 4 pools, more than the 2 selected
    cu = torch.tensor([0, 3, 11], dtype=torch.int32)
    hidden = torch.randn(s, 1, 8, generator=g, dtype=torch.float64)
    latent = torch.randn(s, 1, 4, generator=g, dtype=torch.float64)
    main_q = torch.randn(s, 1, 2, 6, generator=g, dtype=torch.float64)
    main_k = torch.randn(s, 1, 1, 6, generator=g, dtype=torch.float64)

    def loss(*values):
        out = functional_call(indexer, dict(zip(names, values)), (hidden, latent), {"cu_seqlens": cu})
        return indexer_kl_loss(indexer, out, main_q, main_k, 0.5, sparse=sparse, cu_seqlens=cu)

    value = loss(*params)
    value.backward()
    assert value.item() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params), names
    assert torch.autograd.gradcheck(loss, params, eps=1e-6, atol=1e-6)


def test_nothing_quadratic_saved_for_backward(single_rank_parallel_state) -> None:
    s, kpool = 256, 2
    cfg = tiny_config(dsa_indexer_kpool=kpool, dsa_indexer_topk=8, dsa_indexer_query_chunk_size=32)
    indexer = DSAIndexer(cfg, layer_number=1)
    hidden, latent = torch.randn(s, 1, 16), torch.randn(s, 1, 8)
    main_q, main_k = torch.randn(s, 1, 2, 8), torch.randn(s, 1, 1, 8)
    storages: dict[int, int] = {}  # saved storages (views of one tensor count once) -> elements

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes() // x.element_size()
        return x

    quadratic = s * (s // kpool)  # elements of a [s, s / kpool] tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = indexer(hidden, latent)
        assert storages and max(storages.values()) < quadratic
        storages.clear()
        loss = indexer_kl_loss(indexer, out, main_q, main_k, 0.3, sparse=False)
    # the loss's chunks are checkpointed: only their inputs are kept, no chunk of scores
    assert sum(storages.values()) < quadratic, sorted(storages.values())[-3:]
    loss.backward()
    assert indexer.index_kpool_compress_gate.weight.grad.abs().sum() > 0
