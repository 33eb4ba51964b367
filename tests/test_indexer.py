"""Plain DSA lightning indexer: chunked deterministic top-k against megatron's
``fused_qk_topk_naive`` and the DSAIndexer layer (projections, rotary, detaching, TP tags)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import fused_qk_topk_naive
from megatron.core.transformer.experimental_attention_variant.dsa_masking import (
    generate_varlen_mask_params,
)

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.precision.hadamard import rotate_activation
from kpool_layers.dsa.indexer import DSAIndexer
from kpool_layers.dsa.kpool import pool_layout
from kpool_layers.dsa.topk import chunked_range_topk, index_scores, topk_lower_index_ties


def tiny_config(**overrides: object) -> GLMTransformerConfig:
    """A few-channel GLM config with an indexer (NoPE, FP32, CPU init, loss coeff 1)."""
    fields: dict[str, object] = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_head_dim=8,
        qk_pos_emb_head_dim=0,
        v_head_dim=8,
        dsa_indexer_n_heads=2,
        dsa_indexer_head_dim=8,
        dsa_indexer_topk=4,
        dsa_indexer_loss_coeff=1.0,
        dsa_indexer_query_chunk_size=5,
        use_cpu_initialization=True,
    )
    fields.update(overrides)
    return GLMTransformerConfig(**fields)


def random_qkw(t: int, h: int = 2, d: int = 8, seed: int = 0, dtype=torch.float32):
    """q [t, h, d], k [t, d], weights [t, h] with mixed-sign weights."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, h, d, generator=g, dtype=dtype),
        torch.randn(t, d, generator=g, dtype=dtype),
        torch.randn(t, h, generator=g, dtype=dtype),
    )


def causal_topk(q, k, w, *, topk, relu, chunk_size, cu_seqlens=None):
    layout = pool_layout(q.shape[0], 1, cu_seqlens)
    return chunked_range_topk(
        q, k, w, layout.query_lo, layout.query_hi, topk=topk, relu=relu, chunk_size=chunk_size
    )


def assert_matches_oracle(ours: torch.Tensor, oracle: torch.Tensor, scores: torch.Tensor) -> None:
    """Ours lists the oracle's (best-first) selection in ascending key order, except that among keys
    of equal score (at the top-k boundary) the oracle may pick others; ours must then take the
    lowest indices of the tie."""
    assert ours.shape == oracle.shape
    for row in range(ours.shape[0]):
        a, o = ours[row], oracle[row]
        assert torch.equal(a < 0, o < 0), f"row {row}: padding differs"
        valid = a >= 0
        mine_all = a[valid]
        assert (mine_all[1:] > mine_all[:-1]).all(), f"row {row}: not in ascending key order"
        if torch.equal(mine_all, o[valid].sort().values):
            continue
        sa = scores[row, mine_all]
        torch.testing.assert_close(sa.sort(descending=True).values,
                                   scores[row, o[valid]].sort(descending=True).values)  # same scores
        for value in sa.unique():  # within a tie ours takes the lowest indices of that score
            tied = (scores[row] == value).nonzero().flatten()
            mine = mine_all[sa == value]
            assert torch.equal(mine, tied[: mine.numel()]), f"row {row}: tie not lowest-index"


@pytest.mark.parametrize("relu", [True, False])
def test_causal_parity_with_megatron(relu: bool) -> None:
    t, topk = 23, 6
    q, k, w = random_qkw(t, seed=1)
    scores, oracle = fused_qk_topk_naive(
        q[:, None], k[:, None], w[:, None], topk, mask=torch.triu(
            torch.full((t, t), float("-inf")), diagonal=1
        ), use_relu=relu,
    )
    ours = causal_topk(q, k, w, topk=topk, relu=relu, chunk_size=4)
    assert_matches_oracle(ours, oracle[0], scores[0])
    assert (ours[:topk - 1] == -1).any()  # early queries see fewer than topk keys


@pytest.mark.parametrize("relu", [True, False])
def test_packed_parity_with_megatron(relu: bool) -> None:
    cu = torch.tensor([0, 5, 14, 26], dtype=torch.int32)
    q, k, w = random_qkw(26, seed=2)
    starts, ends = generate_varlen_mask_params(cu)
    scores, oracle = fused_qk_topk_naive(
        q[:, None], k[:, None], w[:, None], 7, varlen_starts=starts, varlen_ends=ends, use_relu=relu
    )
    ours = causal_topk(q, k, w, topk=7, relu=relu, chunk_size=6, cu_seqlens=cu)
    assert_matches_oracle(ours, oracle[0], scores[0])


def test_relu_ties_go_to_lower_index() -> None:
    # every score is exactly 0 (ReLU of negative logits): the selection is the first keys
    q = -torch.ones(6, 1, 2)
    k = torch.ones(6, 2)
    ours = causal_topk(q, k, torch.ones(6, 1), topk=3, relu=True, chunk_size=4)
    expected = torch.tensor([[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]])
    assert torch.equal(ours, expected)


def test_negative_zero_ties_like_positive_zero() -> None:
    scores = torch.tensor([[-0.0, 0.0, -0.0, 1.0, 0.0]])
    assert torch.equal(topk_lower_index_ties(scores, 3), torch.tensor([[3, 0, 1]]))


def test_padding_with_minus_one() -> None:
    q, k, w = random_qkw(5, seed=3)
    ours = causal_topk(q, k, w, topk=8, relu=False, chunk_size=2)
    for p in range(5):
        assert sorted(ours[p, : p + 1].tolist()) == list(range(p + 1))
        assert (ours[p, p + 1 :] == -1).all()


@pytest.mark.parametrize("relu", [True, False])
def test_chunked_equals_unchunked(relu: bool) -> None:
    q, k, w = random_qkw(19, seed=4)
    full = causal_topk(q, k, w, topk=5, relu=relu, chunk_size=19)
    for chunk in (1, 3, 7):
        assert torch.equal(causal_topk(q, k, w, topk=5, relu=relu, chunk_size=chunk), full)


@pytest.mark.parametrize("relu", [True, False])
def test_packed_equals_separate_documents(relu: bool) -> None:
    lengths = [4, 9, 7]
    cu = torch.tensor([0, 4, 13, 20], dtype=torch.int32)
    q, k, w = random_qkw(20, seed=5)
    packed = causal_topk(q, k, w, topk=5, relu=relu, chunk_size=6, cu_seqlens=cu)
    for start, n in zip(cu[:-1].tolist(), lengths):
        doc = slice(start, start + n)
        alone = causal_topk(q[doc], k[doc], w[doc], topk=5, relu=relu, chunk_size=6)
        assert torch.equal(packed[doc], torch.where(alone >= 0, alone + start, -1))


def test_no_key_from_another_document() -> None:
    cu = torch.tensor([0, 3, 11, 12, 25], dtype=torch.int32)
    q, k, w = random_qkw(25, seed=6)
    k[:3] *= 100.0  # document 0's keys would win every query if they were visible
    ours = causal_topk(q, k, w, topk=6, relu=False, chunk_size=5, cu_seqlens=cu)
    layout = pool_layout(25, 1, cu)
    for p in range(25):
        picked = ours[p][ours[p] >= 0]
        assert ((picked >= layout.doc_start[p]) & (picked <= p)).all()
        assert picked.numel() == min(6, p - int(layout.doc_start[p]) + 1)


def test_index_scores_formula() -> None:
    q, k, w = random_qkw(4, seed=7, dtype=torch.float64)
    for relu in (True, False):
        act = torch.relu if relu else (lambda x: x)
        expected = torch.stack(
            [torch.stack([(w[t] * act(q[t] @ k[j])).sum() for j in range(4)]) for t in range(4)]
        )
        torch.testing.assert_close(index_scores(q, k, w, relu=relu), expected)


def _rotary_fn(x: torch.Tensor) -> torch.Tensor:
    """A position-dependent stand-in for rotary on the first 4 channels of [s, b, n, d] (the
    others passed through, as :class:`kpool_layers.mla.rope.BoundRotary` does)."""
    pos = torch.arange(x.shape[0], dtype=x.dtype).view(-1, 1, 1, 1)
    rot = x[..., :4]
    return torch.cat([rot * torch.cos(pos) + rot.roll(1, dims=-1) * torch.sin(pos), x[..., 4:]], dim=-1)


@pytest.mark.parametrize("rope_dim", [0, 4])
def test_layer_math(single_rank_parallel_state, rope_dim: int) -> None:
    cfg = tiny_config(qk_pos_emb_head_dim=rope_dim, dsa_indexer_scoring_relu=False)
    indexer = DSAIndexer(cfg, layer_number=1)
    s, b = 9, 2
    hidden, latent = torch.randn(s, b, 16), torch.randn(s, b, 8)
    rotary = _rotary_fn if rope_dim else None
    out = indexer(hidden, latent, rotary_fn=rotary)

    q = indexer.linear_wq_b(latent).view(s, b, 2, 8)
    k = indexer.k_norm(indexer.linear_wk(hidden)).view(s, b, 1, 8)
    if rope_dim:
        q, k = _rotary_fn(q), _rotary_fn(k)
    q, k = rotate_activation(q), rotate_activation(k[:, :, 0])
    w = indexer.linear_weights_proj(hidden) * (2**-0.5 * 8**-0.5)
    torch.testing.assert_close(out.q, q)
    torch.testing.assert_close(out.keys, k)
    torch.testing.assert_close(out.weights, w)
    assert out.topk_indices.shape == (b, s, cfg.dsa_indexer_output_width)
    for row in range(b):
        expected = causal_topk(q[:, row], k[:, row], w[:, row], topk=4, relu=False, chunk_size=s)
        assert torch.equal(out.topk_indices[row], expected)


def test_layer_detaches_inputs_and_tags_params(single_rank_parallel_state) -> None:
    indexer = DSAIndexer(tiny_config(dsa_indexer_kpool=2), layer_number=1)
    hidden = torch.randn(6, 1, 16, requires_grad=True)
    latent = torch.randn(6, 1, 8, requires_grad=True)
    out = indexer(hidden, latent)
    (out.q.sum() + out.keys.sum() + out.weights.sum()).backward()
    assert hidden.grad is None and latent.grad is None
    assert all(p.average_gradients_across_tp_domain for p in indexer.parameters())
    assert indexer.linear_wq_b.weight.grad is not None
    assert indexer.index_kpool_compress_gate.weight.grad is not None


def test_layer_rotary_contract(single_rank_parallel_state) -> None:
    hidden, latent = torch.randn(4, 1, 16), torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="rotary_fn"):
        DSAIndexer(tiny_config(qk_pos_emb_head_dim=4), 1)(hidden, latent)
    with pytest.raises(ValueError, match="rotary_fn"):
        DSAIndexer(tiny_config(), 1)(hidden, latent, rotary_fn=_rotary_fn)


def test_layer_packed_rows(single_rank_parallel_state) -> None:
    indexer = DSAIndexer(tiny_config(), layer_number=1)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    hidden, latent = torch.randn(10, 1, 16), torch.randn(10, 1, 8)
    out = indexer(hidden, latent, cu_seqlens=cu)
    expected = causal_topk(
        out.q[:, 0], out.keys[:, 0], out.weights[:, 0], topk=4, relu=True, chunk_size=10, cu_seqlens=cu
    )
    assert torch.equal(out.topk_indices[0], expected)
    assert (out.topk_indices[0, 3:] >= 3).logical_or(out.topk_indices[0, 3:] == -1).all()
