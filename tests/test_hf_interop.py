"""HF <-> megatron conversion against transformers' own glm_moe_dsa (the external oracle): logit
parity of the imported model (unpacked and packed, with and without IndexShare), bit-exact round
trip, block FP8, name checks, rope layout conversion, and ``train.py train.load``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from recipes.hf.config import hf_config_from_model, model_config_from_hf  # noqa: E402
from recipes.hf.io import dequantize_fp8, quantize_fp8  # noqa: E402
from recipes.hf.mapping import IndexerRope, build_mapping  # noqa: E402
from scripts.convert_checkpoint import export_hf, import_hf, meta_sharded_state_dict, model_group  # noqa: E402
from scripts.convert_checkpoint import _tensor_entries  # noqa: E402

SEQ = 32
# glm5_tiny's shape (so train.py model=glm5_tiny loads the import), 8 indexer heads (exact ReLU
# zero ties are then rare), topk 16 < SEQ.
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32,
            qk_nope_head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
            max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def save_tiny(path: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny GlmMoeDsaForCausalLM saved with save_pretrained (float32, nonzero router bias)."""
    cfg = transformers.GlmMoeDsaConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.GlmMoeDsaForCausalLM(cfg).float()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1, 0.1)
                module.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def our_model(model_cfg, ckpt: Path):
    from omegaconf import OmegaConf

    from recipes.checkpoint.store import load_weights
    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model
    from recipes.config.schema import Config
    from recipes.config.typed import to_config

    cfg = to_config(OmegaConf.merge(OmegaConf.structured(Config),
                                    {"model": model_cfg, "precision": {"dtype": "fp32"}}))
    tcfg = to_transformer_config(cfg)
    model = build_gpt_model(cfg, tcfg).float().eval()
    load_weights(ckpt, model)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("share", [{}, {"index_topk_freq": 2, "index_skip_topk_offset": 1}], ids=["dsa", "indexshare"])
def test_logits_match_transformers(tmp_path: Path, single_rank_parallel_state, share: dict) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    hf_dir = save_tiny(tmp_path / "hf", **share)
    model_cfg = import_hf(hf_dir, tmp_path / "ckpt")
    assert model_cfg.dsa_indexer_topk_freq == share.get("index_topk_freq", 1)
    ours = our_model(model_cfg, tmp_path / "ckpt")
    ref_model = transformers.GlmMoeDsaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (2, SEQ))
    with torch.no_grad():
        ref = ref_model(ids).logits
        got = ours(ids, torch.arange(SEQ)[None].expand(2, -1), None)
        assert rel_err(got, ref) < 1e-4
        # Packed: the two rows as two documents of one THD row == each row alone.
        cu = torch.tensor([0, SEQ, 2 * SEQ], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
        got_packed = ours(ids.reshape(1, -1), torch.arange(SEQ).repeat(2)[None], None,
                          packed_seq_params=packed)
        assert rel_err(got_packed.reshape(2, SEQ, -1), ref) < 1e-4


def test_round_trip_is_bit_exact_and_config_survives(tmp_path: Path, single_rank_parallel_state) -> None:
    hf_dir = save_tiny(tmp_path / "hf", index_topk_freq=2, index_skip_topk_offset=1)
    import_hf(hf_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "out", shard_bytes=200_000)
    original, exported = safetensors_of(hf_dir), safetensors_of(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(original)
    # transformers loads the export and it is the same model.
    reloaded = transformers.GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    src = json.loads((hf_dir / "config.json").read_text())
    for key in ("indexer_types", "mlp_layer_types", "index_topk", "rope_parameters", "routed_scaling_factor"):
        assert getattr(reloaded.config, key) == src[key], key


def test_fp8_export_dequantizes_back_on_import(tmp_path: Path, single_rank_parallel_state) -> None:
    w = torch.randn(300, 200) * 0.02
    q, scale_inv = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    assert rel_err(dequantize_fp8(q, scale_inv, torch.float32), w) < 0.05
    hf_dir = save_tiny(tmp_path / "hf")
    import_hf(hf_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "fp8", fp8=True)
    fp8 = safetensors_of(tmp_path / "fp8")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert fp8[name].dtype == torch.float8_e4m3fn and name + "_scale_inv" in fp8
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    import_hf(tmp_path / "fp8", tmp_path / "ckpt8", model=str(tmp_path / "ckpt" / "model.yaml"))
    export_hf(tmp_path / "ckpt8", tmp_path / "back")
    back, original = safetensors_of(tmp_path / "back"), safetensors_of(hf_dir)
    assert back[name].dtype == torch.bfloat16 and rel_err(back[name], original[name]) < 0.05
    assert torch.equal(back["model.norm.weight"].float(), original["model.norm.weight"])


def test_unknown_and_missing_tensors_are_named(tmp_path: Path, single_rank_parallel_state) -> None:
    hf_dir = save_tiny(tmp_path / "hf")
    tensors = safetensors_of(hf_dir)
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, hf_dir / "model.safetensors")
    with pytest.raises(KeyError) as err:
        import_hf(hf_dir, tmp_path / "ckpt")
    assert "model.layers.0.self_attn.bogus.weight" in str(err.value)
    assert "model.layers.2.mlp.experts.5.down_proj.weight" in str(err.value)


def test_mapping_covers_every_model_tensor_with_mtp_kpool_and_indexshare(single_rank_parallel_state) -> None:
    cfg = model_group("glm5_tiny")
    cfg.mtp_num_layers, cfg.dsa_indexer_kpool, cfg.dsa_indexer_kpool_always_select_tail = 1, 4, True
    cfg.dsa_indexer_topk_freq, cfg.dsa_indexer_skip_topk_offset = 2, 1
    sharded, _ = meta_sharded_state_dict(cfg)
    by_name = _tensor_entries(sharded, build_mapping(cfg))  # raises on any difference
    assert by_name["mtp.layers.0.eh_proj.weight"].hf == ("model.layers.4.eh_proj.weight",)
    gate = "decoder.layers.0.self_attention.indexer.index_kpool_compress_gate.weight"
    assert by_name[gate].hf == ("model.layers.0.self_attn.indexer.index_kpool_compress_gate",)
    assert not any(".layers.1.self_attention.indexer." in n for n in by_name)  # a shared layer


def test_indexer_rope_conversion_preserves_scores() -> None:
    from kpool_layers.mla.rope import Rotary

    heads, head_dim, rope = 2, 8, 4
    rotary = Rotary(dim=rope, base=10000.0, yarn=False)
    wq, wk = torch.randn(heads * head_dim, 5), torch.randn(head_dim, 5)
    x = torch.randn(6, 1, 5)

    def scores(wq: torch.Tensor, wk: torch.Tensor, interleaved: bool) -> torch.Tensor:
        fn = rotary.bind(torch.arange(6), mla_interleaved=interleaved)
        q = (x @ wq.T).view(6, 1, heads, head_dim)
        k = (x @ wk.T).view(6, 1, 1, head_dim)
        q = torch.cat([fn(q[..., :rope]), q[..., rope:]], -1)
        k = torch.cat([fn(k[..., :rope]), k[..., rope:]], -1)
        return torch.einsum("sbhd,tbd->hst", q, k[:, :, 0])

    conv_q, conv_k = IndexerRope(heads, head_dim, rope, False), IndexerRope(1, head_dim, rope, False)
    wq2, wk2 = conv_q.to_megatron([wq]), conv_k.to_megatron([wk])
    assert not torch.equal(wq2, wq)
    torch.testing.assert_close(scores(wq2, wk2, False), scores(wq, wk, True))
    assert torch.equal(conv_q.to_hf(wq2)[0], wq) and torch.equal(conv_k.to_hf(wk2)[0], wk)


def test_hf_config_round_trip_and_unsupported_keys() -> None:
    cfg = model_group("glm5_2")
    hf = hf_config_from_model(cfg, "bfloat16")
    derived = model_config_from_hf({**hf, "rms_norm_eps": cfg.layernorm_epsilon}, "glm5_2")
    for key, value in derived.items():
        if key not in ("mla_latent_norm_epsilon", "dsa_indexer_rotate_activation"):
            assert value == getattr(cfg, key) or float(value) == float(getattr(cfg, key)), key
    with pytest.raises(ValueError, match="n_group"):
        model_config_from_hf({**hf, "n_group": 8, "topk_group": 4}, "x")
    with pytest.raises(ValueError, match="indexer_types"):
        model_config_from_hf({**hf, "indexer_types": ["full"] * cfg.num_layers}, "x")


@pytest.mark.dist
def test_train_loads_the_import(tmp_path: Path) -> None:
    from tests.train_runner import metrics, run_train, subprocess_env

    hf_dir = save_tiny(tmp_path / "hf", index_n_heads=4)  # exactly glm5_tiny's shapes
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "scripts" / "convert_checkpoint.py"), "import", "--hf", str(hf_dir),
                    "--model", "glm5_tiny", "--out", str(tmp_path / "ckpt")], check=True, cwd=root,
                   env=subprocess_env())
    common = ["model=glm5_tiny", "precision=fp32", "data.seq_length=32", "train.steps=1",
              "train.lr_warmup_steps=0", "logging.mode=disabled", "train.save_final=false",
              "train.micro_batch_size=2", "train.global_batch_size=2", f"train.load={tmp_path / 'ckpt'}"]
    out = run_train(tmp_path, "load", common)
    assert "loaded weights from" in out.stdout
    # The import holds full tensors; dist_checkpointing reshards it for TP = 2 on load.
    run_train(tmp_path, "load_tp2", common + ["parallelism=tp2"], nproc=2)
    tp1, tp2 = (metrics(tmp_path / run)[0]["loss"] for run in ("load", "load_tp2"))
    assert abs(tp1 - tp2) < 1e-5, (tp1, tp2)
