"""kpool_layers.mla.rope against megatron-core's RotaryEmbedding / YarnRotaryEmbedding and its unfused
``_apply_rotary_pos_emb_bshd`` / ``_apply_rotary_pos_emb_thd`` (run on CPU through the shim)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_get_concentration_factor,
    _yarn_get_mscale,
)

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.mla.rope import Rotary, apply_rotary, document_positions, yarn_get_mscale

_SINGLE_CP_RANK = SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _config(**overrides: object) -> GLMTransformerConfig:
    fields = dict(num_layers=1, hidden_size=32, num_attention_heads=2, q_lora_rank=16,
                  kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=16, v_head_dim=8,
                  rope_type="rope", add_bias_linear=False)
    fields.update(overrides)
    return GLMTransformerConfig(**fields)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_angles_match_megatron(percent: float) -> None:
    rotary = Rotary.from_config(_config(rotary_percent=percent, rotary_base=500.0))
    ref = RotaryEmbedding(16, rotary_percent=percent, rotary_base=500,
                          use_cpu_initialization=True).get_emb(37)
    assert rotary.dim == int(16 * percent)
    assert torch.equal(rotary.angles(torch.arange(37)), ref)


def test_interleaved_angle_table_matches_megatron() -> None:
    rotary = Rotary(dim=8, base=10000.0, yarn=False, rotary_interleaved=True)
    ref = RotaryEmbedding(8, 1.0, rotary_interleaved=True, use_cpu_initialization=True).get_emb(9)
    assert torch.equal(rotary.angles(torch.arange(9)), ref)


def test_yarn_angles_and_concentration_match_megatron() -> None:
    config = _config(rope_type="yarn", rotary_scaling_factor=40.0, rotary_base=10000.0,
                     original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                     mscale=0.707, mscale_all_dim=1.0)
    rotary = Rotary.from_config(config)
    ref = YarnRotaryEmbedding(16, rotary_base=10000.0, use_cpu_initialization=True,
                              scaling_factor=40.0, original_max_position_embeddings=64,
                              beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0)
    ref_angles, ref_mscale = ref.get_emb(300)
    assert torch.equal(rotary.angles(torch.arange(300)), ref_angles)
    assert rotary.concentration == pytest.approx(ref_mscale, rel=1e-15)
    assert rotary.concentration != pytest.approx(1.0)
    yarn_inv = rotary.inv_freq(torch.device("cpu"))
    plain_inv = Rotary(dim=16, base=10000.0, yarn=False).inv_freq(torch.device("cpu"))
    assert yarn_inv[0] == plain_inv[0] and yarn_inv[-1] == pytest.approx(plain_inv[-1] / 40)


@pytest.mark.parametrize("scale,mscale", [(40.0, 1.0), (40.0, 0.0), (0.5, 1.0), (4.0, 0.7)])
def test_yarn_mscale_matches_megatron(scale: float, mscale: float) -> None:
    assert yarn_get_mscale(scale, mscale) == _yarn_get_mscale(scale, mscale)
    assert yarn_get_mscale(scale, mscale) / yarn_get_mscale(scale, 1.0) == pytest.approx(
        _yarn_get_concentration_factor(scale, mscale, 1.0))


@pytest.mark.parametrize(
    "rotary_interleaved,mla_interleaved,dtype",
    [(*flags, dtype) for flags in itertools.product([False, True], repeat=2)
     for dtype in (torch.float32, torch.bfloat16)],
)
def test_apply_matches_megatron_bshd(rotary_interleaved: bool, mla_interleaved: bool,
                                     dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rotary = Rotary(dim=8, base=100.0, yarn=False, rotary_interleaved=rotary_interleaved)
    t = torch.randn(11, 2, 3, 12, dtype=dtype)  # 4 pass-through channels
    angles = rotary.angles(torch.arange(11))
    ours = apply_rotary(t, angles, mla_interleaved=mla_interleaved,
                        rotary_interleaved=rotary_interleaved, mscale=1.3)
    ref = rope_utils._apply_rotary_pos_emb_bshd(t, angles, rotary_interleaved=rotary_interleaved,
                                                mla_rotary_interleaved=mla_interleaved, mscale=1.3)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours[1:, ..., :8], t[1:, ..., :8])
    assert torch.equal(ours[..., 8:], t[..., 8:])


def test_rotation_preserves_relative_dot_products() -> None:
    torch.manual_seed(0)
    rotary = Rotary(dim=8, base=100.0, yarn=False)
    q, k = torch.randn(2, 1, 1, 1, 8, dtype=torch.float64).unbind(0)
    rotate = rotary.bind(torch.tensor([3, 1, 10, 8]), mla_interleaved=True)
    rq = rotate(q.expand(4, 1, 1, 8))
    rk = rotate(k.expand(4, 1, 1, 8))
    # (3 - 1) and (10 - 8): same offset, same score
    assert torch.allclose((rq[0] * rk[1]).sum(), (rq[2] * rk[3]).sum(), rtol=1e-5)
    assert not torch.allclose((rq[0] * rk[1]).sum(), (rq[0] * rk[2]).sum(), rtol=1e-3)


def test_document_positions() -> None:
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    positions, starts = document_positions(11, cu, torch.device("cpu"))
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1]
    assert starts.tolist() == [0, 0, 0, 3, 3, 5, 5, 5, 5, 9, 9]
    positions, starts = document_positions(4, None, torch.device("cpu"))
    assert positions.tolist() == [0, 1, 2, 3] and starts.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("mla_interleaved", [False, True])
def test_packed_document_rotary_matches_megatron_thd(mla_interleaved: bool) -> None:
    torch.manual_seed(0)
    config = _config(rope_type="yarn", rotary_scaling_factor=4.0,
                     original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.5)
    rotary = Rotary.from_config(config)
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    t = torch.randn(13, 1, 3, 16)
    positions, _ = document_positions(13, cu, t.device)
    ours = rotary.bind(positions, mla_interleaved=mla_interleaved)(t)
    # megatron's table covers max_seqlen (6) positions; each document restarts at 0
    ref = rope_utils._apply_rotary_pos_emb_thd(
        t[:, 0], cu, rotary.angles(torch.arange(6)), mla_rotary_interleaved=mla_interleaved,
        mscale=rotary.concentration, cp_group=_SINGLE_CP_RANK)
    assert torch.equal(ours[:, 0], ref)
    doc2 = rotary.bind(torch.arange(6), mla_interleaved=mla_interleaved)(t[7:13])
    assert torch.equal(ours[7:13], doc2)


def test_nope_and_bad_configs_build_no_rotary() -> None:
    with pytest.raises(ValueError, match="NoPE"):
        Rotary.from_config(_config(qk_pos_emb_head_dim=0))
    with pytest.raises(ValueError, match="rope_type"):
        Rotary.from_config(_config(rope_type="alibi"))
