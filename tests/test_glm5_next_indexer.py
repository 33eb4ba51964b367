"""Our KPool ``DSAIndexer`` against transformers' ``Glm5NextTextIndexer`` (GLM-5.3-Flash, the
external oracle): a tiny random NoPE indexer with kpool 2, 4, 8 and the tail on and off, its config
derived and its weights mapped by the import path (``recipes.hf.config``, ``recipes.hf.mapping``).
Both must select the same token set for every query, in a batch and packed as THD; selections may
differ only where two pools tie at the top-k boundary, which is counted and printed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer  # noqa: E402

from kpool_layers.config import GLMTransformerConfig  # noqa: E402
from kpool_layers.precision.hadamard import rotate_activation  # noqa: E402
from kpool_layers.dsa.indexer import DSAIndexer, ScoredSelection  # noqa: E402
from kpool_layers.dsa.kpool import kpool_topk  # noqa: E402
from recipes.hf.config import model_config_from_hf  # noqa: E402
from recipes.hf.mapping import layer_maps  # noqa: E402
from tests.scoring import row_scores  # noqa: E402

HIDDEN, Q_LORA, HEADS, HEAD_DIM, BATCH = 64, 32, 8, 32, 2
HF_PREFIX = "model.layers.0.self_attn.indexer."
TIE_RTOL = 1e-5  # relative to the query's largest |score|: float32 rounding of two scoring orders


def hf_indexer(kpool: int, tail: bool, seed: int) -> tuple[Glm5NextTextIndexer, dict]:
    """A random transformers indexer (non-uniform pooling gates, nonzero ape and k_norm bias) and its
    text config dict as ``config.json`` holds it."""
    cfg = transformers.Glm5NextTextConfig(
        hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=HEADS, index_head_dim=HEAD_DIM,
        index_topk=4 * kpool, index_kpool=kpool, index_kpool_always_select_tail=tail, num_hidden_layers=1,
        layer_types=["indexed_attention"], mlp_layer_types=["dense"])
    torch.manual_seed(seed)
    indexer = Glm5NextTextIndexer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        indexer.k_norm.weight.normal_(1.0, 0.2)
        indexer.k_norm.bias.normal_(0.0, 0.2)
        indexer.index_kpool_compress_gate.normal_(0.0, 0.3)
        indexer.index_kpool_compress_ape.normal_(0.0, 1.0)
    return indexer, cfg.to_dict()


def our_indexer(hf: Glm5NextTextIndexer, hf_cfg: dict) -> DSAIndexer:
    """Our indexer configured by the import's config derivation, loaded through the import's tensor
    maps (``to_megatron`` of every indexer map of layer 0)."""
    model = model_config_from_hf(hf_cfg, "glm5_next_tiny")
    fields = {f.name for f in dataclasses.fields(GLMTransformerConfig)}
    config = GLMTransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, kv_lora_rank=8, qk_head_dim=8, v_head_dim=8,
        use_cpu_initialization=True, dsa_indexer_query_chunk_size=7,
        **{k: v for k, v in model.items() if k in fields and (k.startswith("dsa_indexer_") or
                                                            k in ("q_lora_rank", "qk_pos_emb_head_dim"))})
    ours = DSAIndexer(config, layer_number=1)
    hf_state = {HF_PREFIX + name: t for name, t in hf.state_dict().items()}
    maps = [m for m in layer_maps(SimpleNamespace(**model), "", "model.layers.0.", 1, moe=False)
            if m.megatron.startswith("self_attention.indexer.")]
    state = {m.megatron.removeprefix("self_attention.indexer."): m.conversion.to_megatron([hf_state[n] for n in m.hf])
             for m in maps}
    assert {n for m in maps for n in m.hf} == set(hf_state)  # every HF indexer tensor is mapped
    ours.load_state_dict(state, strict=True)
    return ours


def compare(ours: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, kpool: int, topk: int) -> int:
    """Assert the token sets of ``ours`` [s, W] and ``ref`` [s, W'] are equal for every query, except
    where our top-k pools and the reference's differ only among pools whose score (``scores`` [s, n]
    pool scores, -inf = invisible) ties with the boundary score. Returns the number of such queries."""
    ties = 0
    for p in range(ours.shape[0]):
        a, b = set(ours[p].tolist()) - {-1}, set(ref[p].tolist()) - {-1}
        if a == b:
            continue
        only_ours = sorted({t // kpool for t in a - b})
        only_ref = sorted({t // kpool for t in b - a})
        assert all((t // kpool) * kpool + kpool - 1 <= p for t in a ^ b), f"query {p}: tail tokens differ"
        row = scores[p]
        tol = TIE_RTOL * float(row[torch.isfinite(row)].abs().max())
        boundary = float(row.topk(min(topk // kpool, int(torch.isfinite(row).sum()))).values[-1])
        assert all(abs(float(row[j]) - boundary) <= tol for j in only_ours + only_ref), (
            f"query {p}: ours-only pools {only_ours} vs transformers-only {only_ref}, scores "
            f"{[float(row[j]) for j in only_ours]} / {[float(row[j]) for j in only_ref]}, boundary {boundary}")
        ties += 1
    return ties


@pytest.mark.parametrize("tail", [False, True], ids=["no_tail", "tail"])
@pytest.mark.parametrize("kpool", [2, 4, 8])
def test_selection_matches_transformers(single_rank_parallel_state, kpool: int, tail: bool) -> None:
    hf, hf_cfg = hf_indexer(kpool, tail, seed=kpool + 10 * tail)
    ours = our_indexer(hf, hf_cfg)
    seq = 16 * kpool + kpool - 1  # 16 complete pools (top-4 of them), then a trailing partial pool
    g = torch.Generator().manual_seed(kpool)
    hidden = torch.randn(BATCH, seq, HIDDEN, generator=g)
    q_resid = torch.randn(BATCH, seq, Q_LORA, generator=g)
    with torch.no_grad():
        ref = hf(hidden, q_resid, torch.ones(BATCH, seq, dtype=torch.bool), cache=None).long()
        out = ours(hidden.transpose(0, 1), q_resid.transpose(0, 1))
        got, scored = out.topk_indices, ScoredSelection.of(out, ours.numerics)
        # Packed THD: the two rows as two documents of one row == each row alone, shifted.
        cu = torch.tensor([0, seq, 2 * seq], dtype=torch.int32)
        packed = ours(hidden.reshape(1, -1, HIDDEN).transpose(0, 1), q_resid.reshape(1, -1, Q_LORA).transpose(0, 1),
                      cu_seqlens=cu).topk_indices[0].view(BATCH, seq, -1)
    width = 4 * kpool + (kpool - 1 if tail else 0)
    assert ref.shape == got.shape == (BATCH, seq, width)
    assert torch.equal(packed - (packed >= 0) * torch.arange(BATCH).view(-1, 1, 1) * seq, got)
    ties = sum(compare(got[r], ref[r], row_scores(scored, r, seq), kpool, 4 * kpool)
               for r in range(BATCH))
    print(f"kpool={kpool} tail={tail}: {ties} of {BATCH * seq} queries differ by a boundary tie")
    assert ties == 0  # measured 0 for every kpool / tail: random float32 scores do not tie


def test_rotation_after_pooling_keeps_the_selection(single_rank_parallel_state) -> None:
    """Rotation placement. The import derives ``dsa_indexer_rotate_activation: true`` (upstream
    Megatron-LM and SGLang rotate): the Hadamard acts on the queries and on the pooled keys, after
    pooling, where it is orthonormal, so the selections equal transformers' (which never rotates)
    up to boundary ties, as they do with the rotation off. Rotating the token keys before pooling
    (an order this code once used) is another model: the per-channel softmax pooling does not
    commute with the rotation, and selections differ."""
    hf, hf_cfg = hf_indexer(4, True, seed=3)
    ours = our_indexer(hf, hf_cfg)
    assert ours.config.dsa_indexer_rotate_activation
    seq = 67
    g = torch.Generator().manual_seed(5)
    hidden, q_resid = torch.randn(1, seq, HIDDEN, generator=g), torch.randn(1, seq, Q_LORA, generator=g)
    with torch.no_grad():
        ref = hf(hidden, q_resid, torch.ones(1, seq, dtype=torch.bool), cache=None).long()[0]
        out = ours(hidden.transpose(0, 1), q_resid.transpose(0, 1))
        scores = row_scores(ScoredSelection.of(out, ours.numerics), 0, seq)
        ours.config.dsa_indexer_rotate_activation = False
        plain = ours(hidden.transpose(0, 1), q_resid.transpose(0, 1))
        plain_scores = row_scores(ScoredSelection.of(plain, ours.numerics), 0, seq)
        # The other order: rotate q and the token keys, then pool.
        q = rotate_activation(ours.linear_wq_b(q_resid[0]).view(seq, HEADS, HEAD_DIM))
        k = rotate_activation(ours.k_norm(ours.linear_wk(hidden[0])))
        before = kpool_topk(q, k, ours.index_kpool_compress_gate(hidden[0]), ours.index_kpool_compress_ape,
                            out.weights[:, 0], kpool=4, topk=16, always_select_tail=True, relu=True)
    assert compare(out.topk_indices[0], ref, scores, 4, 16) == 0  # measured: no boundary tie
    assert compare(plain.topk_indices[0], ref, plain_scores, 4, 16) == 0
    differ = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(before, ref))
    print(f"rotation before pooling: {differ} of {seq} queries select other tokens than transformers")
    assert differ > 0
