"""The KPool selection contract (docs/kpool.md; upstream Megatron-LM's ``fused_qk_topk_kpool`` and
transformers' ``Glm5NextTextIndexer``) as literal cases, checked on every backend.

Each :class:`Case` states a row layout and the expected int64 ``[t, W]`` result row by row:
pool layout, tail slots, document restarts, -1 padding, index order (ascending token positions,
not score order), the lower-index tie rule, and rows (or whole calls) without a complete pool,
where upstream returns -1 pools plus the tail (t = 1, kpool 4, topk 4: ``[-1, -1, -1, -1, 0, -1,
-1]``). The inputs make every score exact: token key ``k[t] = v_j * e_0`` for the tokens of pool
``j`` (other tokens 0), zero gate and ape (the pooled key is the mean, ``v_j * e_0`` exactly:
softmax weights ``1 / kpool`` are powers of two), queries ``e_0`` on every head and head weights
``e_0``, identity scoring: ``score(p, j) = v_j`` with small integers ``v_j``. With
``rotate`` the Hadamard (scale ``16 ** -0.5 = 0.25``, exact) maps ``e_0`` to ``0.25 * ones``, so
the rotated scores are ``16 * 0.25 * 0.25 * v_j = v_j`` exactly too.

Backends: the reference :func:`kpool_topk`; :func:`kpool_select` over the torch top-k at several
chunk sizes, over the Triton kernel (under ``TRITON_INTERPRET=1`` in a subprocess on CPU, as
tests/test_indexer_topk_triton.py runs it; on CUDA in the GPU class) and over the TileLang adapter
(GPU; exact ties excepted: it breaks them as ``torch.topk`` does); the ``DSAIndexer`` layer on
short and pool-less rows (torch and Triton top-k). Rotation placement (after pooling, on the
pooled keys and the queries) is a case of its own with hand-derived scores; the serving path's
(``serving_match``) pooled keys are ``serving_index_quant`` of the unrotated softmax pool bit for
bit. Rows without pools keep the indexer loss and the drift metrics finite, and the whole
attention layer trains on them (forward and backward finite).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from kpool_layers.precision import fp8
from kpool_layers.precision.hadamard import rotate_activation
from kpool_layers.dsa.indexer import DSAIndexer, ScoredSelection
from kpool_layers.dsa.numerics import IndexerNumerics, RoutedProjections
from kpool_layers.dsa.indexer_loss import indexer_kl_loss
from kpool_layers.dsa.kpool import index_keys, kpool_select, kpool_topk, pool_keys, pool_layout
from kpool_layers.precision.policy import PrecisionPolicy
from kpool_layers.dsa.topk import chunked_range_topk
from recipes.observe.drift import Recorded, layer_drift
from tests.test_indexer import tiny_config
from tests.scoring import row_scores

ROOT = Path(__file__).resolve().parents[1]
D = 16  # channels of the CPU cases: the Hadamard scale 16 ** -0.5 = 0.25 is exact


@dataclass(frozen=True)
class Case:
    """One row of packed documents ``lengths`` and its expected selection ``rows``: per query
    ``(pool tokens, tail tokens)``, each list padded with -1 to ``topk`` and ``kpool - 1`` slots
    (the tail only with ``tail``). ``values[j]`` is the score of pool ``j`` (pools numbered back
    to back over the documents). ``ties``: the case relies on the lower-index tie rule."""

    lengths: tuple[int, ...]
    kpool: int
    topk: int
    tail: bool
    values: tuple[int, ...]
    rows: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    ties: bool = False

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.int32)

    def expected(self) -> torch.Tensor:
        width = self.kpool - 1 if self.tail else 0
        out = []
        for body, tail in self.rows:
            assert len(body) <= self.topk and len(tail) <= width and (self.tail or not tail)
            out.append([*body, *[-1] * (self.topk - len(body)), *tail, *[-1] * (width - len(tail))])
        return torch.tensor(out, dtype=torch.long)


P4 = (0, 1, 2, 3)
CASES: dict[str, Case] = {
    # One document of 10 tokens, kpool 4: pools {0..3}, {4..7}; tokens 8, 9 belong to no pool.
    # A query at local position p sees the pools j < (p + 1) // 4 and its tail (p+1)//4*4 .. p.
    "pool_layout_and_tail": Case(
        (10,), kpool=4, topk=8, tail=True, values=(1, 2),
        rows=(((), (0,)), ((), (0, 1)), ((), (0, 1, 2)), (P4, ()), (P4, (4,)), (P4, (4, 5)),
              (P4, (4, 5, 6)), (tuple(range(8)), ()), (tuple(range(8)), (8,)), (tuple(range(8)), (8, 9)))),
    # kpool 2, top-2 of 4 pools scored 1, 3, 2, 4: query 7 picks pools 3 and 1 (best first) and
    # lists them in ascending token order; fewer visible pools than topk / kpool: -1 padding.
    "index_order_and_padding": Case(
        (8,), kpool=2, topk=4, tail=False, values=(1, 3, 2, 4),
        rows=(((), ()), ((0, 1), ()), ((0, 1), ()), (P4, ()), (P4, ()), ((2, 3, 4, 5), ()),
              ((2, 3, 4, 5), ()), ((2, 3, 6, 7), ()))),
    # Pools 1 and 2 tie at 3: the lower pool index wins.
    "ties_to_lower_pool": Case(
        (8,), kpool=2, topk=2, tail=False, values=(1, 3, 3, 2), ties=True,
        rows=(((), ()), ((0, 1), ()), ((0, 1), ()), ((2, 3), ()), ((2, 3), ()), ((2, 3), ()),
              ((2, 3), ()), ((2, 3), ()))),
    # Documents of 3 and 5 tokens, kpool 2: pool 0 = {0, 1} (document 0), pools 1 = {3, 4} and
    # 2 = {5, 6} (document 1). Pooling restarts at token 3, whose query sees no pool of document 0.
    "document_restarts": Case(
        (3, 5), kpool=2, topk=4, tail=True, values=(1, 2, 3),
        rows=(((), (0,)), ((0, 1), ()), ((0, 1), (2,)), ((), (3,)), ((3, 4), ()), ((3, 4), (5,)),
              ((3, 4, 5, 6), ()), ((3, 4, 5, 6), (7,)))),
    # Document 0 (3 tokens) has no pool, document 1 (9 tokens) pools {3..6} = 5 and {7..10} = 6.
    "pool_less_document_then_pools": Case(
        (3, 9), kpool=4, topk=4, tail=True, values=(5, 6),
        rows=(((), (0,)), ((), (0, 1)), ((), (0, 1, 2)), ((), (3,)), ((), (3, 4)), ((), (3, 4, 5)),
              ((3, 4, 5, 6), ()), ((3, 4, 5, 6), (7,)), ((3, 4, 5, 6), (7, 8)), ((3, 4, 5, 6), (7, 8, 9)),
              ((7, 8, 9, 10), ()), ((7, 8, 9, 10), (11,)))),
    # Zero pools in the whole call. Upstream's example: t = 1, kpool 4.
    "one_token_row": Case((1,), kpool=4, topk=4, tail=True, values=(), rows=(((), (0,)),)),
    "short_row_without_tail": Case((3,), kpool=4, topk=8, tail=False, values=(),
                                   rows=(((), ()), ((), ()), ((), ()))),
    # 16 packed tokens, kpool 8, documents of 5 / 4 / 7 tokens: no document has a pool.
    "packed_documents_all_short": Case(
        (5, 4, 7), kpool=8, topk=8, tail=True, values=(),
        rows=(((), (0,)), ((), (0, 1)), ((), (0, 1, 2)), ((), (0, 1, 2, 3)), ((), (0, 1, 2, 3, 4)),
              ((), (5,)), ((), (5, 6)), ((), (5, 6, 7)), ((), (5, 6, 7, 8)),
              ((), (9,)), ((), (9, 10)), ((), (9, 10, 11)), ((), (9, 10, 11, 12)),
              ((), (9, 10, 11, 12, 13)), ((), (9, 10, 11, 12, 13, 14)), ((), (9, 10, 11, 12, 13, 14, 15)))),
}


def case_inputs(case: Case, heads: int = 1, d: int = D, dtype: torch.dtype = torch.float32,
                device: str = "cpu"):
    """q [t, h, d], k [t, d], gate [t, d], ape [kpool, d], weights [t, h] and the layout of
    ``case`` (module docstring: every score is exact)."""
    t = sum(case.lengths)
    layout = pool_layout(t, case.kpool, case.cu_seqlens.to(device), device=torch.device(device))
    assert layout.n_pools == len(case.values), "a case states one value per pool"
    k = torch.zeros(t, d, dtype=dtype, device=device)
    for start, value in zip(layout.pool_start.tolist(), case.values):
        k[start:start + case.kpool, 0] = value
    q = torch.zeros(t, heads, d, dtype=dtype, device=device)
    q[..., 0] = 1
    w = torch.zeros(t, heads, dtype=torch.float32, device=device)
    w[:, 0] = 1
    gate = torch.zeros(t, d, dtype=dtype, device=device)
    ape = torch.zeros(case.kpool, d, dtype=torch.float32, device=device)
    return q, k, gate, ape, w, layout


def select_with(case: Case, range_topk: Callable[..., torch.Tensor], *, rotate: bool, heads: int = 1,
                d: int = D, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The layer's path: :func:`index_keys` (pool, then rotate) and :func:`kpool_select` over
    ``range_topk``, on the case's inputs."""
    q, k, gate, ape, w, layout = case_inputs(case, heads, d, dtype, device)
    keys = index_keys(k, gate, ape, layout, rotate=rotate)
    q = rotate_activation(q) if rotate else q
    return kpool_select(q, keys, w, layout, topk=case.topk, always_select_tail=case.tail, relu=False,
                        range_topk=range_topk)


# --- CPU: the reference and the torch top-k --------------------------------------------------------


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_states_the_contract(name: str, rotate: bool) -> None:
    case = CASES[name]
    q, k, gate, ape, w, _ = case_inputs(case)
    got = kpool_topk(q, k, gate, ape, w, kpool=case.kpool, topk=case.topk, always_select_tail=case.tail,
                     relu=False, cu_seqlens=case.cu_seqlens, rotate=rotate)
    assert torch.equal(got, case.expected())


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_topk_states_the_contract(name: str, rotate: bool, chunk: int) -> None:
    case = CASES[name]
    got = select_with(case, partial(chunked_range_topk, chunk_size=chunk), rotate=rotate)
    assert torch.equal(got, case.expected())


def test_rotation_acts_after_pooling() -> None:
    """Rotation placement, scores derived by hand. d = 4 (Hadamard ``0.5 * H_4``, exact), one
    document of 4 tokens, kpool 2 (pools {0, 1}, {2, 3}), top-1 pool, identity scoring, q = e_0.
    The ape (+-60) makes each pool's softmax weights one-hot per channel to within exp(-120):
    channels 0, 1 take the pool's first token, channels 2, 3 its second. With k0 = e_0, k3 =
    -4 e_2, k1 = k2 = 0:

    * pool, then rotate q and the pooled key (upstream, SGLang, ours): the rotation is orthonormal,
      score(j) = q . pk[j] = pk[j, 0]: pool 0 scores 1, pool 1 scores 0 -> query 3 takes {0, 1};
    * rotate the token keys, then pool: score = Hq . pk' with Hq = 0.5 * ones and
      (Hk)_0 + (Hk)_1 = k_0 + k_2, (Hk)_2 + (Hk)_3 = k_0 - k_2, so
      score(j) = 0.5 * (k_a0 + k_a2 + k_b0 - k_b2): pool 0 scores 0.5, pool 1 scores 2 -> {2, 3}.
    """
    d = 4
    k = torch.zeros(4, d, dtype=torch.float64)
    k[0, 0], k[3, 2] = 1.0, -4.0
    q = torch.zeros(4, 1, d, dtype=torch.float64)
    q[..., 0] = 1.0
    w = torch.ones(4, 1, dtype=torch.float64)
    gate = torch.zeros(4, d, dtype=torch.float64)
    ape = torch.tensor([[60.0, 60.0, -60.0, -60.0], [-60.0, -60.0, 60.0, 60.0]], dtype=torch.float64)
    opts = dict(kpool=2, topk=2, always_select_tail=False, relu=False)
    expected = torch.tensor([[-1, -1], [0, 1], [0, 1], [0, 1]])
    assert torch.equal(kpool_topk(q, k, gate, ape, w, rotate=True, **opts), expected)
    assert torch.equal(kpool_topk(q, k, gate, ape, w, rotate=False, **opts), expected)
    layout = pool_layout(4, 2)
    torch.testing.assert_close(index_keys(k, gate, ape, layout, rotate=True),
                               rotate_activation(pool_keys(k, gate, ape, layout)), rtol=0, atol=0)
    # The other order, for contrast: pooling the rotated token keys selects pool 1 at query 3.
    before = kpool_topk(rotate_activation(q), rotate_activation(k), gate, ape, w, rotate=False, **opts)
    assert torch.equal(before, torch.tensor([[-1, -1], [0, 1], [0, 1], [2, 3]]))


# --- the layer: short rows, zero pools, loss and drift --------------------------------------------


def _indexer(kpool: int, topk: int, tail: bool, range_topk: Optional[Callable[..., torch.Tensor]] = None,
             **overrides):
    """A tiny NoPE indexer (rotation on) with seeded random weights, a non-trivial gate and ape."""

    cfg = tiny_config(dsa_indexer_kpool=kpool, dsa_indexer_topk=topk,
                      dsa_indexer_kpool_always_select_tail=tail, dsa_indexer_query_chunk_size=3,
                      **overrides)
    torch.manual_seed(kpool)
    indexer = DSAIndexer(cfg, layer_number=1, range_topk=range_topk)
    with torch.no_grad():
        indexer.index_kpool_compress_gate.weight.normal_()
        indexer.index_kpool_compress_ape.normal_()
    return indexer


def layer_matches_reference(indexer, lengths: tuple[int, ...], seed: int) -> None:
    """``indexer`` (NoPE, rotation on) on one row of packed ``lengths`` selects what
    ``kpool_topk(rotate=True)`` selects from the same unrotated q / k / gate."""
    cfg = indexer.config
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    hidden, latent = torch.randn(t, 1, 16, generator=g), torch.randn(t, 1, 8, generator=g)
    with torch.no_grad():
        out = indexer(hidden, latent, cu_seqlens=cu)
        q = indexer.linear_wq_b(latent[:, 0]).view(t, indexer.n_heads, indexer.head_dim)
        k = indexer.k_norm(indexer.linear_wk(hidden[:, 0]))
        gate = indexer.index_kpool_compress_gate(hidden[:, 0])
        expected = kpool_topk(q, k, gate, indexer.index_kpool_compress_ape, out.weights[:, 0],
                              kpool=cfg.dsa_indexer_kpool, topk=cfg.dsa_indexer_topk,
                              always_select_tail=cfg.dsa_indexer_kpool_always_select_tail,
                              relu=cfg.dsa_indexer_scoring_relu, cu_seqlens=cu, rotate=True)
    assert torch.equal(out.topk_indices[0], expected), (out.topk_indices[0], expected)


LAYER_ROWS = [((1,), 4), ((3,), 4), ((5, 4, 7), 8), ((3, 9), 4), ((2, 2, 1), 2)]
"""(document lengths, kpool) of the layer cases: rows and documents shorter than kpool."""


@pytest.mark.parametrize("lengths,kpool", LAYER_ROWS)
def test_layer_on_short_rows(single_rank_parallel_state, lengths, kpool: int) -> None:
    indexer = _indexer(kpool, 2 * kpool, tail=True)
    assert indexer.config.dsa_indexer_rotate_activation
    layer_matches_reference(indexer, lengths, seed=kpool)


def _main_attention(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 1, 2, 8, generator=g), torch.randn(t, 1, 1, 8, generator=g)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("lengths,kpool", [((3,), 4), ((5, 4, 7), 8), ((3, 9), 4)])
def test_loss_and_drift_finite_without_pools(single_rank_parallel_state, lengths, kpool: int,
                                             sparse: bool) -> None:
    """Forward, indexer loss and backward on rows with pool-less documents (and whole rows without
    a pool): the loss is finite, 0 exactly when no query sees a pool (no KL term), and every
    gradient is finite; the drift metrics of the selection against a recomputation are finite."""

    indexer = _indexer(kpool, 2 * kpool, tail=True)
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    hidden, latent = torch.randn(t, 1, 16, generator=g), torch.randn(t, 1, 8, generator=g)
    out = indexer(hidden, latent, cu_seqlens=cu)
    main_q, main_k = _main_attention(t, seed=2)
    loss = indexer_kl_loss(indexer, out, main_q, main_k, 8**-0.5, sparse=sparse, cu_seqlens=cu)
    assert torch.isfinite(loss)
    if out.layout.n_pools == 0:
        assert float(loss) == 0.0 and out.keys.shape == (0, 1, indexer.head_dim)
    else:
        loss.backward()
        grads = [p.grad for p in indexer.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(gr).all() for gr in grads)
        assert indexer.index_kpool_compress_gate.weight.grad.abs().sum() > 0
    # Drift (recipes.observe.drift's per-layer path) against a recompute under the serving
    # numerics (FP8 index inputs).
    serving = IndexerNumerics(projections=RoutedProjections(), k_norm_fp32=False, index_quant="ue8m0")
    recorded = Recorded({"hidden": hidden, "q_latent": latent, "rotary_fn": None, "cu_seqlens": cu},
                        ScoredSelection.of(out, indexer.numerics))
    metrics = layer_drift(indexer, recorded, serving)
    assert {"topk_overlap", "pool_overlap", "score_rel_err", "boundary_tie_frac"} <= set(metrics)
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    ref = indexer.recompute(serving, hidden, latent, cu_seqlens=cu)
    tail = kpool - 1
    # Every query sees its tail, so every row is non-empty and the tails agree exactly.
    assert torch.equal(out.topk_indices[..., -tail:], ref.topk_indices[..., -tail:])


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("cu,kpool,tail", [([0, 3], 4, True), ([0, 5, 9, 16], 8, True),
                                           ([0, 5, 9, 16], 8, False), ([0, 3, 12], 4, False)])
def test_attention_layer_trains_on_short_rows(single_rank_parallel_state, cu, kpool: int, tail: bool,
                                              sparse: bool) -> None:
    """The whole attention layer (rotary indexer, rotation on, indexer loss on) on rows whose
    documents are shorter than kpool (or partly so): forward and backward are finite, the
    recorded indexer loss is finite (0 where no query sees a pool: no KL term)."""
    from kpool_layers.mla.attention import collect_indexer_losses
    from tests.test_attention import build, thd
    from tests.test_attention import tiny_config as attention_config

    torch.manual_seed(kpool)
    cfg = attention_config(dsa_indexer_kpool=kpool, dsa_indexer_topk=2 * kpool,
                           dsa_indexer_kpool_always_select_tail=tail, dsa_indexer_loss_coeff=1.0,
                           dsa_indexer_use_sparse_loss=sparse)
    assert cfg.dsa_indexer_rotate_activation and cfg.qk_pos_emb_head_dim > 0
    module = build(cfg)
    x = torch.randn(cu[-1], 1, 32, requires_grad=True)
    out, _ = module(x, None, packed_seq_params=thd(cu))
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)
    losses = collect_indexer_losses(module)
    assert len(losses) == 1 and all(math.isfinite(v) for v in losses.values())
    if all(b - a < kpool for a, b in zip(cu[:-1], cu[1:])):
        assert list(losses.values()) == [0.0]


def test_serving_path_quantizes_the_unrotated_softmax_pool(single_rank_parallel_state) -> None:
    """``serving_match`` (``dsa_indexer_kpool_use_quantization``) with kpool 4: the scored keys
    are ``serving_index_quant`` (BF16 -> Hadamard -> BF16 -> E4M3, SGLang's pooled-key write) of
    the softmax pool of the unrotated token keys, bit for bit, and the queries the same map of
    the unrotated index queries; the scores equal ``fp8.serving_index_scores`` of those inputs
    (FP32 sums in another order: 1e-6, as tests/test_precision_profiles.py bounds them)."""
    plain = _indexer(4, 8, tail=True, dsa_indexer_head_dim=32, dsa_indexer_n_heads=4)
    cfg = dataclasses.replace(plain.config, precision=PrecisionPolicy(dsa_indexer_kpool_use_quantization=True))

    indexer = DSAIndexer(cfg, layer_number=1)
    indexer.load_state_dict(plain.state_dict())
    assert indexer.numerics.index_quant == "ue8m0"
    t, lengths = 22, (3, 19)
    cu = torch.tensor([0, 3, 22], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    hidden, latent = torch.randn(t, 1, 16, generator=g), torch.randn(t, 1, 8, generator=g)
    with torch.no_grad():
        out = indexer(hidden, latent, cu_seqlens=cu)
        scored = ScoredSelection.of(out, indexer.numerics)
        q = indexer.linear_wq_b(latent[:, 0]).view(t, 4, 32)
        k = indexer.k_norm(indexer.linear_wk(hidden[:, 0]))
        gate = indexer.index_kpool_compress_gate(hidden[:, 0])
        layout = pool_layout(t, 4, cu)
        pooled = pool_keys(k, gate, indexer.index_kpool_compress_ape, layout)
    assert layout.n_pools == sum(n // 4 for n in lengths)
    assert torch.equal(scored.keys[:, 0], fp8.serving_index_quant(pooled))
    assert torch.equal(scored.q[:, 0], fp8.serving_index_quant(q))
    expected = fp8.serving_index_scores(q, pooled, out.weights[:, 0])
    got = row_scores(scored, 0, 5)
    visible = torch.isfinite(got)
    torch.testing.assert_close(got[visible], expected[visible], rtol=1e-6, atol=1e-6)


# --- Triton under the interpreter (CPU subprocess) --------------------------------------------------


def _interpreted_cases() -> dict[str, Optional[str]]:
    """Every case on ``range_topk_triton`` (plain and rotated) and the layer on short rows with
    the Triton top-k; {name: None | traceback}."""
    from kpool_layers.kernels.indexer_topk_triton import range_topk_triton

    results: dict[str, Optional[str]] = {}

    def run(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()

    for name, case in CASES.items():
        for rotate in (False, True):
            def check(case: Case = case, rotate: bool = rotate) -> None:
                got = select_with(case, range_topk_triton, rotate=rotate)
                assert torch.equal(got, case.expected()), got
            run(f"{name}/{'rotated' if rotate else 'plain'}", check)
    for lengths, kpool in LAYER_ROWS:
        def layer(lengths=lengths, kpool=kpool) -> None:
            indexer = _indexer(kpool, 2 * kpool, tail=True, range_topk=range_topk_triton)
            layer_matches_reference(indexer, lengths, seed=kpool)
        run(f"layer/{'_'.join(map(str, lengths))}/kpool{kpool}", layer)
    return results


def _interpreted_names() -> list[str]:
    names = [f"{n}/{r}" for n in CASES for r in ("plain", "rotated")]
    return names + [f"layer/{'_'.join(map(str, lengths))}/kpool{kpool}" for lengths, kpool in LAYER_ROWS]


def _run_interpreted() -> None:
    """Entry point of the interpreter subprocess: one JSON line of :func:`_interpreted_cases`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from kpool_layers.compat import cpu as _cpu
    from tests.conftest import free_port

    _cpu.install()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        print(json.dumps(_interpreted_cases()))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.test_kpool_contract"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", _interpreted_names())
def test_triton_interpreted(name: str, interpreter_results: dict) -> None:
    result = interpreter_results[name]
    assert result is None, result


# --- GPU: Triton and the TileLang adapter on CUDA ----------------------------------------------------

GPU_BACKENDS = ["triton", "tilelang"]


def _gpu_range_topk(backend: str) -> Callable[..., torch.Tensor]:
    from kpool_layers.dsa.backends import range_topk_kernel

    if backend == "tilelang":
        pytest.importorskip("tilelang")
    return range_topk_kernel(backend, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_backend_states_the_contract(name: str, backend: str) -> None:
    """The cases in bf16 at the GLM-5 indexer shape (32 heads x 128; only head 0 weighted, so
    the scores are the cases' small integers, exact in bf16 and FP32). Unrotated inputs: the
    rotation is :func:`index_keys`' (tested above), and ``128 ** -0.5`` is not exact in bf16.
    TileLang breaks exact ties as ``torch.topk`` does, so its tie case is left out."""
    case = CASES[name]
    if backend == "tilelang" and case.ties:
        pytest.skip("TileLang's top-k breaks exact ties as torch.topk does (kernels/tilelang_dsa.py)")
    got = select_with(case, _gpu_range_topk(backend), rotate=False, heads=32, d=128,
                      dtype=torch.bfloat16, device="cuda")
    assert torch.equal(got.cpu(), case.expected())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backend_zero_pool_call(backend: str) -> None:
    """A whole call with zero keys: every slot -1, shape [t, topk]."""
    range_topk = _gpu_range_topk(backend)
    t = 5
    q = torch.randn(t, 32, 128, device="cuda").bfloat16()
    keys = torch.zeros(0, 128, device="cuda").bfloat16()
    lo = hi = torch.zeros(t, dtype=torch.long, device="cuda")
    got = range_topk(q, keys, torch.rand(t, 32, device="cuda"), lo, hi, topk=4, relu=True)
    assert torch.equal(got.cpu(), torch.full((t, 4), -1))


@pytest.mark.gpu
@pytest.mark.parametrize("lengths,kpool", LAYER_ROWS)
def test_gpu_layer_with_triton_on_short_rows(single_rank_parallel_state, lengths, kpool: int) -> None:
    """The layer (FP32, CUDA) with the Triton top-k on short and pool-less rows, against the
    reference on the same device. FP32 scores of two summation orders: the random inputs have
    no near-ties at these sizes (the CPU interpreter case of the same rows selects identically)."""
    from kpool_layers.kernels.indexer_topk_triton import range_topk_triton

    indexer = _indexer(kpool, 2 * kpool, tail=True, range_topk=range_topk_triton).cuda()
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(kpool)
    hidden, latent = torch.randn(t, 1, 16, generator=g).cuda(), torch.randn(t, 1, 8, generator=g).cuda()
    with torch.no_grad():
        out = indexer(hidden, latent, cu_seqlens=cu)
        q = indexer.linear_wq_b(latent[:, 0]).view(t, indexer.n_heads, indexer.head_dim)
        k = indexer.k_norm(indexer.linear_wk(hidden[:, 0]))
        gate = indexer.index_kpool_compress_gate(hidden[:, 0])
        expected = kpool_topk(q, k, gate, indexer.index_kpool_compress_ape, out.weights[:, 0],
                              kpool=kpool, topk=2 * kpool, always_select_tail=True, relu=True,
                              cu_seqlens=cu, rotate=True)
    assert torch.equal(out.topk_indices[0], expected)


if __name__ == "__main__":
    _run_interpreted()
