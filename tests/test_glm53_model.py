"""The GLM-5.3 text model (KDA + DSA layers, per-layer indexer and MLP types, SwiGLU clamp) against
transformers' ``Glm5NextTextModel`` (the external oracle): logits of the imported model, the
parameter count, the HF field table, the config rules, and the layer-pattern facts.

Both sides run the mHC hyper-connections (``hc_mult`` streams around every KDA, DSA and MLP
block, kpool_layers/hyper_connections): the checkpoint carries every ``hc_*`` tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel  # noqa: E402

from kpool_layers import model_facts  # noqa: E402
from recipes.hf import config as hf_config  # noqa: E402
from scripts.convert_checkpoint import export_hf, import_hf  # noqa: E402
from tests.test_hc_model import perturb_hc  # noqa: E402
from tests.test_hf_interop import our_model, safetensors_of  # noqa: E402

SEQ = 40
VOCAB = 512
# Small GLM-5.3 text stacks: NoPE MLA, KPool indexer (8 heads: exact ReLU ties are rare), KDA heads
# of 16, experts top-2 + shared, SwiGLU limit 1.5 (hit by the activations of init std 0.2).
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, v_head_dim=16, qk_nope_head_dim=16,
            index_topk=16, index_head_dim=16, index_n_heads=8, linear_head_dim=16, linear_num_heads=4,
            linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, pad_token_id=None,
            swiglu_limit=1.5, initializer_range=0.2, max_position_embeddings=4096)


def hf_text_model(seed: int, **overrides: object) -> tuple[Glm5NextTextModel, torch.Tensor]:
    """A random fp32 ``Glm5NextTextModel`` (nonzero router bias, random norm weights, mHC weights
    far from their init so the streams mix: tests.test_hc_model.HC_INIT) and an
    lm_head weight."""
    cfg = transformers.Glm5NextTextConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = Glm5NextTextModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("k_norm.bias") or name.endswith("compress_ape"):
                p.normal_(0.0, 0.1)
            elif name.endswith("index_kpool_compress_gate"):
                p.normal_(0.0, 0.2)
            else:
                perturb_hc(name, p)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model, torch.randn(VOCAB, cfg.hidden_size) * 0.05


def save_checkpoint(path: Path, model: Glm5NextTextModel, lm_head: torch.Tensor) -> Path:
    """The checkpoint layout (``model.``-prefixed decoder, ``lm_head.weight``) in transformers'
    on-disk names (``save_pretrained``'s reverse conversion, ``hc_attn_fn`` ...)."""
    raw = path / "raw"
    model.save_pretrained(raw)
    tensors = {f"model.{k}": v for k, v in safetensors_of(raw).items()}
    tensors["lm_head.weight"] = lm_head
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    config = json.loads((raw / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config))
    return path


def logit_bound(logits: torch.Tensor, layers: int, width: int) -> float:
    """fp32 bound on |our logit - HF's|: each of the ``2 * layers`` blocks and the head computes
    dot products of at most ``width`` terms in another order (blocked GEMMs, chunked delta rule,
    absorbed vs. expanded MLA, the mHC projection of the N h flattened streams), each off by at
    most ``width * u`` relative (u = 2^-24); the streams carry every block's error to the logits
    at most doubled (``comb`` is doubly stochastic, ``post`` = 2 sigmoid <= 2), so twice the sum
    over ``2 * layers + 1`` of them, times the largest logit, bounds the difference (same top-k
    and expert picks: 8 indexer heads and random weights make exact score ties improbable)."""
    u = torch.finfo(torch.float32).eps / 2
    return 2 * (2 * layers + 1) * width * u * float(logits.abs().max())


PATTERNS = {
    # (layer_types, indexer_types, mlp_layer_types, kpool, hc_mult)
    "kkkd": (["linear_attention"] * 3 + ["indexed_attention"], None, ["dense"] + ["sparse"] * 3, 16, 4),
    "kddkd_shared": (["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                      "indexed_attention"], ["full", "full", "shared", "full", "full"],
                     ["dense", "dense", "sparse", "sparse", "sparse"], 4, 2),
    "dkdd_kpool1": (["indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"],
                    ["full", "full", "full", "shared"], ["dense", "sparse", "sparse", "sparse"], 1, 1),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_logits_match_transformers(tmp_path: Path, single_rank_parallel_state, name: str) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    layer_types, indexer_types, mlp_types, kpool, hc_mult = PATTERNS[name]
    hf, head = hf_text_model(0, num_hidden_layers=len(layer_types), layer_types=layer_types,
                             indexer_types=indexer_types, mlp_layer_types=mlp_types, index_kpool=kpool,
                             index_kpool_always_select_tail=kpool > 1, hc_mult=hc_mult)
    model_cfg = import_hf(save_checkpoint(tmp_path / "hf", hf, head), tmp_path / "ckpt")
    pattern = model_facts.LayerPattern.of(model_cfg)
    assert pattern.layer_types() == layer_types and model_cfg.hc_mult == hc_mult
    ours = our_model(model_cfg, tmp_path / "ckpt")
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        ref = hf(ids).last_hidden_state @ head.T
        got = ours(ids, torch.arange(SEQ)[None].expand(2, -1), None)
        bound = logit_bound(ref, len(layer_types), max(128, hc_mult * TINY["hidden_size"]))
        print(f"{name}: max |dlogit| {float((got - ref).abs().max()):.2e}, bound {bound:.2e}")
        torch.testing.assert_close(got, ref, rtol=0.0, atol=bound)
        # Packed: the two rows as two documents of one THD row == each row alone (KDA's conv and
        # recurrence restart at the boundary, DSA attends within the document).
        cu = torch.tensor([0, SEQ, 2 * SEQ], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=SEQ, max_seqlen_kv=SEQ)
        got_packed = ours(ids.reshape(1, -1), torch.arange(SEQ).repeat(2)[None], None,
                          packed_seq_params=packed)
        torch.testing.assert_close(got_packed.reshape(2, SEQ, -1), ref, rtol=0.0, atol=bound)


def test_export_round_trip_is_bit_exact(tmp_path: Path, single_rank_parallel_state) -> None:
    layer_types, indexer_types, mlp_types, kpool, _ = PATTERNS["kddkd_shared"]
    hf, head = hf_text_model(2, num_hidden_layers=5, layer_types=layer_types, indexer_types=indexer_types,
                             mlp_layer_types=mlp_types, index_kpool=kpool)
    src = save_checkpoint(tmp_path / "hf", hf, head)
    import_hf(src, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    original, exported = safetensors_of(src), safetensors_of(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    given = json.loads((src / "config.json").read_text())
    for key in ("model_type", "layer_types", "indexer_types", "mlp_layer_types", "swiglu_limit",
                "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound",
                "index_kpool", "index_kpool_always_select_tail", "index_topk", "hc_mult", "hc_sinkhorn_iters",
                "hc_eps"):
        assert written[key] == given[key], key


def test_multimodal_layout_imports_its_text_decoder(tmp_path: Path, single_rank_parallel_state) -> None:
    """A ``Glm5NextForConditionalGeneration``-layout checkpoint (``model.language_model.*`` and a
    ``glm5_next`` config with ``text_config``) imports as its text decoder: the export (text
    layout) is bit-exact to the text-layout checkpoint. Vision tensors are refused by name."""
    layer_types, indexer_types, mlp_types, kpool, hc_mult = PATTERNS["kkkd"]
    hf, head = hf_text_model(3, num_hidden_layers=4, layer_types=layer_types, indexer_types=indexer_types,
                             mlp_layer_types=mlp_types, index_kpool=kpool, hc_mult=hc_mult)
    text = save_checkpoint(tmp_path / "text", hf, head)
    tensors = safetensors_of(text)
    multimodal = {"model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k: v
                  for k, v in tensors.items()}
    config = {"model_type": "glm5_next", "text_config": json.loads((text / "config.json").read_text())}
    for name, extra in (("mm", {}), ("vision", {"model.visual.patch_embed.proj.weight": torch.zeros(4, 4)})):
        (tmp_path / name).mkdir()
        save_file({**multimodal, **extra}, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert import_hf(tmp_path / "mm", tmp_path / "ckpt").hc_mult == hc_mult
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = safetensors_of(tmp_path / "out")
    assert sorted(exported) == sorted(tensors)
    assert all(torch.equal(exported[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match=r"1 vision tensors \(\['model\.visual\.patch_embed\.proj\.weight'\]\)"):
        import_hf(tmp_path / "vision", tmp_path / "ckpt_vision")


def _text_config(**overrides: object) -> dict:
    cfg = transformers.Glm5NextTextConfig(**{**TINY, "num_hidden_layers": 4, **overrides})
    return cfg.to_dict()


def test_unknown_and_unsupported_fields_are_refused() -> None:
    hf = _text_config()
    assert hf_config.model_config_from_hf(hf, "x")["hc_mult"] == 4
    # absent hc fields take transformers' defaults (hc_mult 4, 20 Sinkhorn iterations, eps 1e-6)
    without_hc = {k: v for k, v in hf.items() if k not in hf_config.HC_FIELDS}
    got = hf_config.model_config_from_hf(without_hc, "x")
    assert (got["hc_mult"], got["hc_sinkhorn_iters"], got["hc_eps"]) == (4, 20, 1e-6)
    with pytest.raises(ValueError, match=r"\['my_new_field'\] are unknown"):
        hf_config.model_config_from_hf({**hf, "my_new_field": 1}, "x")
    for key, value in (("hidden_act", "gelu"), ("attention_bias", True), ("hc_mult", 0)):
        with pytest.raises(ValueError, match=key):
            hf_config.model_config_from_hf({**hf, key: value}, "x")


def test_unsupported_patterns_are_refused() -> None:
    types = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"]
    # a shared layer after a KDA layer: transformers' glm5_next raises at its forward.
    with pytest.raises(ValueError, match="indexer_types"):
        hf_config.model_config_from_hf(_text_config(layer_types=types,
                                                     indexer_types=["full", "full", "full", "shared"]), "x")
    with pytest.raises(ValueError, match="layer_types"):
        hf_config.model_config_from_hf({**_text_config(), "layer_types": ["mamba"] * 4}, "x")
    with pytest.raises(ValueError, match="mlp_layer_types"):
        hf_config.model_config_from_hf(_text_config(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]), "x")
    got = hf_config.model_config_from_hf(_text_config(layer_types=types), "x")
    assert got["linear_attention_freq"] == 2 and got["activation_func_clamp_value"] == 1.5


def test_layer_pattern_facts_follow_megatron_and_transformers() -> None:
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    for freq in (4, [1, 0, 0, 1, 1, 0, 1, 0]):
        cfg = TransformerConfig(num_layers=8, hidden_size=8, num_attention_heads=1,
                                linear_attention_freq=freq)
        assert model_facts.linear_attention_pattern(8, freq) == [bool(v) for v in get_linear_attention_pattern(cfg)]
    # GLM-5.3: transformers' default layer_types are megatron's linear_attention_freq = 4.
    default = transformers.Glm5NextTextConfig(pad_token_id=None).layer_types
    assert hf_config.linear_attention_freq(default) == 4
    assert default.count("linear_attention") == 34 and default.count("indexed_attention") == 11
    p = model_facts.LayerPattern(5, indexer_types=("full", "full", "shared", "full", "shared"),
                                 linear_attention_freq=[1, 0, 0, 1, 0])
    assert p.topk_layers() == [2] and p.topk_source_layer(3) == 2 and p.topk_source_layer(5) == 2
    assert p.shares_topk and p.hf_shareable() == 5


def _compose_raw(overrides: list[str]):  # noqa: ANN202
    """The composed DictConfig (as ``validate`` sees it), fp32."""
    from hydra import compose, initialize_config_dir

    from tests.test_model_facts import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides + ["precision=fp32"])


def _compose(overrides: list[str]):  # noqa: ANN202
    from recipes.config.typed import to_config

    return to_config(_compose_raw(overrides))


def test_analytic_param_count_matches_the_meta_build_of_the_hybrid(single_rank_parallel_state) -> None:
    from recipes.config.megatron import to_transformer_config
    from recipes.plan.dry_run import analytic_param_count
    from recipes.train.model import build_gpt_model, count_parameters, meta_init

    cfg = _compose(["model=glm5_3_flash_tiny"])
    tcfg = to_transformer_config(cfg)
    with meta_init(tcfg):
        model = build_gpt_model(cfg, tcfg)
    counted = count_parameters(model, tcfg)
    assert analytic_param_count(cfg.model) == (counted.total, counted.active_per_token)
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["KimiDeltaAttention", "GLMSparseMLA", "GLMSparseMLA", "KimiDeltaAttention", "GLMSparseMLA"]
    assert [layer.self_attention.indexer is not None for layer in model.decoder.layers if kinds[0] != type(
        layer.self_attention).__name__] == [True, False, True]


def test_glm5_3_flash_parameter_count_equals_transformers() -> None:
    """``model=glm5_3_flash`` against ``Glm5NextTextModel()`` (defaults: 4 mHC streams) on the
    meta device plus its lm_head, the mHC tensors (``attn_hc`` / ``ffn_hc``) included."""
    from recipes.plan.dry_run import analytic_param_count

    with torch.device("meta"):
        hf = Glm5NextTextModel(transformers.Glm5NextTextConfig(pad_token_id=None))
    assert hf.config.hc_mult == 4
    hc = sum(p.numel() for name, p in hf.named_parameters() if "_hc." in name)
    hf_total = sum(p.numel() for p in hf.parameters()) + hf.config.vocab_size * hf.config.hidden_size
    m = _compose(["model=glm5_3_flash"]).model
    assert m.hc_mult == 4 and hc == 45 * 2 * ((2 + 4) * 4 * (4 * m.hidden_size + 1) + 3)
    assert analytic_param_count(m)[0] == hf_total
    assert model_facts.LayerPattern.of(m).layer_types() == hf.config.layer_types
    # FLOP model: sparse attention and indexer on the 11 DSA layers, the delta rule on the 34 KDA
    # layers at 64 heads x (6 D^2 + 10 C D), D = 128, C = 64, the stream mixing of the 90 mHC
    # blocks at 2 (N^2 h + N h), N = 4 (3x for forward + backward).
    from dataclasses import replace

    from recipes.plan.dry_run import flop_model

    flops = flop_model(_compose(["model=glm5_3_flash"]))
    assert (flops.num_layers, flops.index_layers, flops.kda_layers) == (11, 11, 34)
    kda = 3 * 34 * 64 * (6 * 128 * 128 + 10 * 64 * 128)
    assert flops.per_token(4096) - replace(flops, kda_layers=0).per_token(4096) == kda
    mixing = 3 * 90 * 2 * (4 * 4 + 4) * 4096
    assert flops.per_token(4096) - replace(flops, hc_streams=0).per_token(4096) == mixing
    # memory plan: each layer's two blocks keep their 4 x h bf16 input streams for backward, and
    # under full recompute a layer keeps its streams as the checkpointed input
    from recipes.plan import memory_plan

    m = _compose(["model=glm5_3_flash"]).model
    no_hc = replace(m, hc_mult=None)
    for layer in (1, 4):  # KDA, DSA
        assert memory_plan._layer_bytes(m, layer, 2) - memory_plan._layer_bytes(no_hc, layer, 2) == 4 * 4 * 4096 / 2
    full = _compose(["model=glm5_3_flash", "train.recompute_granularity=full", "train.recompute_method=uniform",
                     "train.recompute_num_layers=1"]).train
    kept, _ = memory_plan._recomputed(full, [1.0, 1.0], [0.5, 0.5], [False, True], 4096 / 2, 4)
    assert kept == [2 * 4 * 4096 / 2] * 2


def test_config_rules_name_the_key() -> None:
    from omegaconf import OmegaConf

    from recipes.config.rules import validate
    from recipes.config.schema import ConfigError

    cases = {
        "model.linear_attention_freq": ["model.linear_attention_freq=[1,0]"],
        "model.dsa_indexer_types": ["model.dsa_indexer_types=[full,shared,full,full,full]"],
        # 4 KDA heads split over TP * CP = 8
        "parallelism.context_parallel_size": ["parallelism.context_parallel_size=8", "data.seq_length=64"],
        "model.mtp_num_layers": ["model.mtp_num_layers=1"],
        "model.linear_num_value_heads": ["model.linear_num_value_heads=2"],
        "model.dsa_indexer_topk_freq": ["model.dsa_indexer_topk_freq=2", "model.dsa_indexer_types=null"],
        "parallelism.pipeline_model_parallel_size": [  # stage 2 would start on the shared layer 3
            "parallelism=pp2", "parallelism.num_layers_in_first_pipeline_stage=2",
            "parallelism.num_layers_in_last_pipeline_stage=3"],
    }
    for key, overrides in cases.items():
        cfg = _compose_raw(["model=glm5_3_flash_tiny", *overrides])
        world = 8 if key == "parallelism.context_parallel_size" else (
            2 if any(o.startswith("parallelism") for o in overrides) else 1)
        with pytest.raises(ConfigError) as err:
            validate(cfg, world)
        assert err.value.key == key, (key, str(err.value))
    with pytest.raises(ConfigError, match=r"one of \[1, 2\] .* at tensor_model_parallel_size=2"):
        validate(_compose_raw(["model=glm5_3_flash_tiny", "parallelism.tensor_model_parallel_size=2",
                               "parallelism.context_parallel_size=4", "data.seq_length=64"]), 8)
    validate(_compose_raw(["model=glm5_3_flash_tiny"]), 1)
    validate(_compose_raw(["model=glm5_3_flash_tiny", "parallelism=cp2", "data.seq_length=64"]), 2)
    assert OmegaConf.is_config(_compose_raw(["model=glm5_3_flash"]))
