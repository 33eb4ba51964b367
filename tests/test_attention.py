"""GLMSparseMLA (TP = 1) against a naive, non-absorbed MLA reference with megatron's rotary and a
dense mask keeping exactly the indexer's top-k; packed THD; NoPE; IndexShare; indexer loss."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_get_mscale,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.spec_utils import build_module

import kpool_layers.mla.rope as rope_mod
from kpool_layers.mla.attention import (
    GLMSparseMLA,
    IndexerLossAutoScaler,
    TopKShare,
    collect_indexer_losses,
    glm_attention_spec,
    mla_softmax_scale,
)
from kpool_layers.config import GLMTransformerConfig
from kpool_layers.dsa.core_attention import TorchSparseMLA


def tiny_config(**overrides: object) -> GLMTransformerConfig:
    """4 heads, few channels, YaRN rotary, indexer top-4, CPU init."""
    fields: dict[str, object] = dict(
        num_layers=3, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8,
        qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn",
        rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale=1.0,
        mscale_all_dim=0.8, dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=4,
        dsa_indexer_query_chunk_size=5, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32, experimental_attention_variant="dsa",
    )
    fields.update(overrides)
    return GLMTransformerConfig(**fields)


def build(config: GLMTransformerConfig, layer_number: int = 1,
          share: Optional[TopKShare] = None) -> GLMSparseMLA:
    return build_module(glm_attention_spec(config, share), config=config, layer_number=layer_number)


def thd(cu: list[int]) -> PackedSeqParams:
    cu_t = torch.tensor(cu, dtype=torch.int32)
    longest = int((cu_t[1:] - cu_t[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def capture_topk(module: GLMSparseMLA) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    module.indexer.register_forward_hook(lambda _m, _a, out: seen.append(out.topk_indices))
    return seen


def megatron_rotate(config: GLMTransformerConfig, t: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """megatron's MLA rotary (its own tables, ``mla_rotary_interleaved=True``) at ``positions``."""
    p = config.qk_pos_emb_head_dim
    if config.rope_type == "yarn":
        table = YarnRotaryEmbedding(
            p, rotary_base=config.rotary_base, use_cpu_initialization=True,
            scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim)
        freqs, mscale = table.get_emb(int(positions.max()) + 1)
    else:
        table = RotaryEmbedding(p, config.rotary_percent, rotary_base=config.rotary_base,
                                use_cpu_initialization=True)
        freqs, mscale = table.get_emb(int(positions.max()) + 1), 1.0
    return _apply_rotary_pos_emb_bshd(t, freqs[positions].to(t.device), mla_rotary_interleaved=True,
                                      mscale=mscale)


def naive_mla(module: GLMSparseMLA, x: torch.Tensor, topk: torch.Tensor,
              cu: Optional[list[int]] = None) -> torch.Tensor:
    """Standard (non-absorbed) MLA with per-head keys/values, megatron's rotary and softmax scale,
    dense-masked to the top-k keys that are causal and in the query's document."""
    cfg = module.config
    s, b, _ = x.shape
    n, qk, p, v, r = (cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
                      cfg.v_head_dim, cfg.kv_lora_rank)
    starts = [0] if cu is None else cu[:-1]
    doc_start = torch.tensor([max(c for c in starts if c <= i) for i in range(s)])
    positions = torch.arange(s) - doc_start
    q_lat = module.q_layernorm(x @ module.linear_q_down_proj.weight.T)
    q = (q_lat @ module.linear_q_up_proj.weight.T).view(s, b, n, qk + p)
    kv = x @ module.linear_kv_down_proj.weight.T
    c = module.kv_layernorm(kv[..., :r])
    kv_up = (c @ module.linear_kv_up_proj.weight.T).view(s, b, n, qk + v)
    k_nope, value = kv_up[..., :qk], kv_up[..., qk:]
    scores = torch.einsum("ibnd,jbnd->bnij", q[..., :qk], k_nope)
    if p:
        q_pe = megatron_rotate(cfg, q[..., qk:], positions)
        k_pe = megatron_rotate(cfg, kv[..., r:].unsqueeze(2), positions)
        scores = scores + torch.einsum("ibnd,jbxd->bnij", q_pe, k_pe)
    mscale = _yarn_get_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    scores = scores * mscale * mscale / math.sqrt(qk + p)
    keep = torch.zeros(b, s, s + 1, dtype=torch.bool)
    keep.scatter_(2, torch.where(topk < 0, s, topk), True)
    rows = torch.arange(s)
    keep = keep[..., :s] & (rows[None, :] <= rows[:, None]) & (rows[None, :] >= doc_start[:, None])
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), -1).nan_to_num(0.0)
    out = torch.einsum("bnij,jbnv->ibnv", probs, value).reshape(s, b, n * v)
    return out @ module.linear_proj.weight.T


@pytest.mark.parametrize("rope_type", ["yarn", "rope"])
def test_matches_naive_mla_with_megatron_rotary(single_rank_parallel_state, rope_type: str) -> None:
    torch.manual_seed(0)
    module = build(tiny_config(rope_type=rope_type)).double()
    seen = capture_topk(module)
    x = torch.randn(13, 2, 32, dtype=torch.float64, requires_grad=True)
    out, bias = module(x, None)
    assert bias is None and out.shape == x.shape
    ref = naive_mla(module, x, seen[0])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    weight = torch.randn_like(out)
    params = [x, *[p for name, p in module.named_parameters() if "indexer" not in name]]
    got = torch.autograd.grad((out * weight).sum(), params)
    want = torch.autograd.grad((ref * weight).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_softmax_scale_is_megatrons() -> None:
    cfg = tiny_config(rotary_scaling_factor=40.0, mscale_all_dim=1.0)
    mscale = 0.1 * math.log(40.0) + 1.0
    assert mla_softmax_scale(cfg) == pytest.approx(mscale**2 / math.sqrt(12), rel=1e-14)
    assert mla_softmax_scale(tiny_config(qk_pos_emb_head_dim=0, mscale_all_dim=0.0)) == (
        pytest.approx(1 / math.sqrt(8)))


def test_nope_builds_and_applies_no_rotary(single_rank_parallel_state, monkeypatch) -> None:
    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("rotary code ran under NoPE")

    monkeypatch.setattr(rope_mod.Rotary, "from_config", forbidden)
    monkeypatch.setattr(rope_mod.Rotary, "bind", forbidden)
    monkeypatch.setattr(rope_mod, "apply_rotary", forbidden)
    torch.manual_seed(0)
    cfg = tiny_config(qk_pos_emb_head_dim=0)
    module = build(cfg).double()
    assert module.rotary is None
    assert module.linear_q_up_proj.weight.shape == (4 * 8, 16)
    assert module.linear_kv_down_proj.weight.shape == (8, 32)
    assert not any("rotary" in name for name, _ in module.named_modules())
    seen = capture_topk(module)
    x = torch.randn(11, 1, 32, dtype=torch.float64)
    cu = [0, 4, 11]
    out, _ = module(x, None, packed_seq_params=thd(cu))
    torch.testing.assert_close(out, naive_mla(module, x, seen[0], cu), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kpool,tail", [(1, False), (2, True)])
def test_packed_thd_equals_separate_documents(single_rank_parallel_state, kpool: int,
                                              tail: bool) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(dsa_indexer_kpool=kpool, dsa_indexer_kpool_always_select_tail=tail,
                      dsa_indexer_loss_coeff=0.0)
    module = build(cfg).double()
    cu = [0, 6, 9, 17]
    x = torch.randn(17, 1, 32, dtype=torch.float64, requires_grad=True)
    packed, _ = module(x, None, packed_seq_params=thd(cu))
    docs = [module(x[a:e], None)[0] for a, e in zip(cu[:-1], cu[1:])]
    torch.testing.assert_close(packed, torch.cat(docs), rtol=1e-10, atol=1e-12)
    weight = torch.randn_like(packed)
    (grad_packed,) = torch.autograd.grad((packed * weight).sum(), x)
    (grad_docs,) = torch.autograd.grad((torch.cat(docs) * weight).sum(), x)
    torch.testing.assert_close(grad_packed, grad_docs, rtol=1e-10, atol=1e-12)
    # no document sees another: changing document 0 leaves documents 1 and 2 untouched
    x2 = x.detach().clone()
    x2[:6] += 1.0
    changed, _ = module(x2, None, packed_seq_params=thd(cu))
    torch.testing.assert_close(changed[6:], packed[6:], rtol=0, atol=0)
    assert not torch.allclose(changed[:6], packed[:6])


class AllKeysIndexer(torch.nn.Module):
    """Selects every key of the row for every query, across documents and into the future."""

    def __init__(self, config: GLMTransformerConfig, layer_number: int) -> None:
        super().__init__()

    def forward(self, hidden, q_latent, rotary_fn=None, cu_seqlens=None):
        s, b, _ = hidden.shape
        return SimpleNamespace(topk_indices=torch.arange(s).expand(b, s, s))


def test_documents_confined_whatever_the_indices(single_rank_parallel_state) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(dsa_indexer_loss_coeff=0.0)
    spec = glm_attention_spec(cfg)
    spec.submodules.indexer = AllKeysIndexer
    module = build_module(spec, config=cfg, layer_number=1).double()
    cu = [0, 5, 12]
    x = torch.randn(12, 1, 32, dtype=torch.float64)
    packed, _ = module(x, None, packed_seq_params=thd(cu))
    torch.testing.assert_close(packed, naive_mla(module, x, torch.arange(12).expand(1, 12, 12), cu),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(packed[5:], module(x[5:], None)[0], rtol=1e-10, atol=1e-12)


def test_index_share_skip_layer_reuses_source_indices(single_rank_parallel_state,
                                                      monkeypatch) -> None:
    cfg = tiny_config(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    used: list[torch.Tensor] = []
    real = TorchSparseMLA.forward

    def recording(self, query, key, topk, key_start, query_pos):
        used.append(topk)
        return real(self, query, key, topk, key_start, query_pos)

    monkeypatch.setattr(TorchSparseMLA, "forward", recording)
    torch.manual_seed(0)
    share = TopKShare()
    layers = [build(cfg, n, share) for n in (1, 2, 3)]
    assert [layer.indexer is not None for layer in layers] == [True, False, True]
    assert layers[1].source_layer == 1
    with pytest.raises(RuntimeError, match="source layer 1"):
        layers[1](torch.randn(7, 1, 32), None)
    x = torch.randn(7, 1, 32)
    for layer in layers:
        layer(x, None)
    assert used[1] is used[0] and not torch.equal(used[2], used[0])
    # per micro batch under THD: the slots live on each forward's PackedSeqParams
    mb_a, mb_b = thd([0, 3, 7]), thd([0, 7])
    layers[0](x, None, packed_seq_params=mb_a)
    layers[0](x + 1, None, packed_seq_params=mb_b)
    layers[1](x, None, packed_seq_params=mb_a)
    assert used[-1] is used[-3]
    with pytest.raises(ValueError, match="TopKShare"):
        build_module(glm_attention_spec(cfg).module, config=cfg, submodules=None, layer_number=2)


def test_indexer_loss_backward_scale_and_logging(single_rank_parallel_state) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(dsa_indexer_loss_coeff=0.5)
    model = torch.nn.ModuleDict({"attn": build(cfg)})
    # The layer leaves the shared config alone (recipes.config.megatron installs the callback).
    assert cfg.experimental_attention_variant_loss_scale_func is None
    x = torch.randn(9, 2, 32)

    def indexer_grads(scale: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        IndexerLossAutoScaler.set_loss_scale(torch.tensor(scale))
        out, _ = model["attn"](x, None)
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in model["attn"].indexer.parameters()]

    try:
        out1, grads1 = indexer_grads(1.0)
        out2, grads2 = indexer_grads(3.0)
    finally:
        IndexerLossAutoScaler.main_loss_backward_scale = None
    torch.testing.assert_close(out1, out2, rtol=0, atol=0)
    assert any(g.abs().sum() > 0 for g in grads1)
    for g1, g2 in zip(grads1, grads2):
        torch.testing.assert_close(g2, 3 * g1)
    losses = collect_indexer_losses(model)
    assert list(losses) == ["attn"] and losses["attn"] > 0
    assert collect_indexer_losses(model) == {}
    model.eval()
    with torch.no_grad():
        model["attn"](x, None)
    assert collect_indexer_losses(model) == {}


def test_indexer_off_without_loss(single_rank_parallel_state) -> None:
    torch.manual_seed(0)
    module = build(tiny_config(dsa_indexer_loss_coeff=None))
    out, _ = module(torch.randn(6, 1, 32), None)
    out.sum().backward()
    assert all(p.grad is None for p in module.indexer.parameters())
    assert module.linear_q_down_proj.weight.grad is not None


def test_rejects_unsupported_inputs(single_rank_parallel_state) -> None:
    module = build(tiny_config())
    x = torch.randn(4, 1, 32)
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        module(x, None, rotary_pos_emb=torch.zeros(4, 1, 1, 4))
    with pytest.raises(ValueError, match="batch size 1"):
        module(torch.randn(4, 2, 32), None, packed_seq_params=thd([0, 4]))



def test_in_transformer_block_with_index_share(single_rank_parallel_state) -> None:
    """Drop-in for megatron's TransformerLayer (the spec path of the recipes), IndexShare through
    the spec's shared TopKShare, per-layer indexer losses by module name."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from kpool_layers.spec import glm_decoder_block_spec

    cfg = tiny_config(dsa_indexer_topk_freq=2, dsa_indexer_loss_coeff=0.1, ffn_hidden_size=64)
    torch.manual_seed(0)
    block = TransformerBlock(cfg, glm_decoder_block_spec(cfg, glm_attention_spec(cfg)))
    attentions = [layer.self_attention for layer in block.layers]
    assert [a.indexer is not None for a in attentions] == [True, False, True]
    assert attentions[0].topk_share is attentions[1].topk_share is attentions[2].topk_share
    x = torch.randn(9, 1, 32, requires_grad=True)
    out = block(x, None, packed_seq_params=thd([0, 4, 9]))
    out.sum().backward()
    assert out.shape == x.shape and torch.isfinite(x.grad).all()
    assert list(collect_indexer_losses(block)) == ["layers.0.self_attention",
                                                   "layers.2.self_attention"]
