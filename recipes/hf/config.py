"""Hugging Face ``config.json`` <-> our ``model`` config group (``recipes.config.schema.ModelConfig``).

:func:`model_config_from_hf` derives the ``model`` group from a ``glm_moe_dsa`` (GLM-5 / 5.1 / 5.2)
or ``glm5_next_text`` (GLM-5.3-Flash text stack, KPool indexer) config, so any GLM-5.x-shaped
checkpoint converts without a ``conf/model`` file. :func:`hf_config_from_model` is the inverse used
by ``export``. Features our model does not implement (expert groups, unnormalised top-k, biases,
other activations, a top-k share pattern megatron cannot express) raise :class:`ValueError`
naming the HF key, instead of converting to a different model.

Facts of the HF reference implementation (transformers 5.24) that are not config keys:
the indexer applies interleaved rope to its first ``qk_rope_head_dim`` channels (glm_moe_dsa;
glm5_next's indexer has no rope), scores with ReLU, and normalises its key with a LayerNorm of
eps 1e-6; neither applies a Hadamard rotation to the index queries and keys (glm5_next pools the
unrotated keys; our rotation acts after pooling, so it changes the scores only by rounding);
glm_moe_dsa's MLA latent norms use eps 1e-6 whatever ``rms_norm_eps``; the router is sigmoid +
``e_score_correction_bias`` with FP32 logits.
"""

from __future__ import annotations

from typing import Any

from kpool_layers import model_facts

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "glm5_next_text")
HC_DEFAULTS = {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6}
"""transformers' ``Glm5NextTextConfig`` mHC fields and their defaults (a glm5_next_text config
always has hyper-connections; glm_moe_dsa has none)."""
INDEXER_K_NORM_EPS = 1e-6
MLA_LATENT_NORM_EPS = 1e-6


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"HF config {key}={value!r} is not supported; allowed: {allowed}")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: ``text_config`` of a multimodal ``glm5_next`` config, else ``hf``."""
    if hf.get("model_type") == "glm5_next":
        return hf["text_config"]
    return hf


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    params = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    kind = params.get("rope_type", "default")
    out: dict[str, Any] = {"rotary_base": float(params["rope_theta"])}
    if kind == "default":
        return {**out, "rope_type": "rope"}
    _require(kind == "yarn", "rope_parameters.rope_type", kind, "default, yarn")
    return {**out, "rope_type": "yarn", "rotary_scaling_factor": float(params["factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            "beta_fast": float(params.get("beta_fast", 32.0)), "beta_slow": float(params.get("beta_slow", 1.0)),
            "mscale": float(params.get("mscale", 1.0)), "mscale_all_dim": float(params.get("mscale_all_dim", 0.0))}


def indexer_types(num_layers: int, topk_freq: int, skip_topk_offset: int) -> list[str]:
    """HF's ``indexer_types``: ``full`` for layers computing their top-k, ``shared`` for the rest."""
    return ["full" if model_facts.computes_topk(n, topk_freq, skip_topk_offset) else "shared"
            for n in range(1, num_layers + 1)]


def _index_share(hf: dict[str, Any], num_layers: int) -> dict[str, int]:
    """``dsa_indexer_topk_freq`` / ``skip_topk_offset`` reproducing HF's ``indexer_types``."""
    freq = max(int(hf.get("index_topk_freq", 1)), 1)
    offset = int(hf.get("index_skip_topk_offset", 0 if freq == 1 else 2))
    types = hf.get("indexer_types")
    if types is not None:
        ours = indexer_types(num_layers, freq, offset)
        _require(list(types) == ours, "indexer_types", types,
                 f"the pattern of index_topk_freq={freq}, index_skip_topk_offset={offset}: {ours}")
    return {"dsa_indexer_topk_freq": freq, "dsa_indexer_skip_topk_offset": offset if freq > 1 else 0}


def _hyper_connections(hf: dict[str, Any]) -> dict[str, Any]:
    """``model.hc_*`` for a glm5_next_text config (its ``hc_*`` fields, transformers' defaults
    where absent); none for glm_moe_dsa, which must carry no ``hc_*`` field."""
    present = sorted(k for k in hf if k.startswith("hc_"))
    if hf["model_type"] != "glm5_next_text":
        _require(not present, present[0] if present else "hc_*", hf.get(present[0]) if present else None,
                 f"no hc_* field in a {hf['model_type']} config (it has no hyper-connections)")
        return {}
    unknown = [k for k in present if k not in HC_DEFAULTS]
    _require(not unknown, unknown[0] if unknown else "hc_*", hf.get(unknown[0]) if unknown else None,
             f"the mHC fields {', '.join(HC_DEFAULTS)} only")
    hc = {k: hf.get(k, default) for k, default in HC_DEFAULTS.items()}
    for key in ("hc_mult", "hc_sinkhorn_iters"):
        _require(isinstance(hc[key], int) and hc[key] >= 1, key, hc[key], "an integer >= 1")
    _require(isinstance(hc["hc_eps"], (int, float)) and 0 <= hc["hc_eps"] < 1, "hc_eps", hc["hc_eps"],
             "a number in [0, 1)")
    return {"hc_mult": hc["hc_mult"], "hc_sinkhorn_iters": hc["hc_sinkhorn_iters"], "hc_eps": float(hc["hc_eps"])}


def _check_supported(hf: dict[str, Any]) -> None:
    _require(hf.get("model_type") in SUPPORTED_MODEL_TYPES, "model_type", hf.get("model_type"),
             ", ".join(SUPPORTED_MODEL_TYPES))
    _require(hf.get("n_group", 1) == 1 and hf.get("topk_group", 1) == 1, "n_group/topk_group",
             (hf.get("n_group"), hf.get("topk_group")), "1/1 (no group-limited routing)")
    _require(hf.get("norm_topk_prob", True), "norm_topk_prob", hf.get("norm_topk_prob"), "true")
    _require(not hf.get("attention_bias", False), "attention_bias", hf.get("attention_bias"), "false")
    _require(not hf.get("mlp_bias", False), "mlp_bias", hf.get("mlp_bias"), "false")
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"), "silu")
    layer_types = set(hf.get("layer_types") or ["indexed_attention"])
    _require(layer_types <= {"indexed_attention", "full_attention"}, "layer_types", sorted(layer_types),
             "indexed/full attention only (no linear-attention layers)")


def model_config_from_hf(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """``model`` group values (``recipes.config.schema.ModelConfig`` fields) for an HF config dict."""
    hf = text_config(hf)
    _check_supported(hf)
    layers = int(hf["num_hidden_layers"])
    mlp_types = hf.get("mlp_layer_types")
    # glm5_next has no first_k_dense_replace: its leading dense layers are in mlp_layer_types.
    dense = hf.get("first_k_dense_replace")
    dense = int(dense) if dense is not None else list(mlp_types or []).count("dense")
    if mlp_types is not None:
        experts = int(hf["n_routed_experts"])
        moe_freq = model_facts.moe_layer_freq(layers, experts, dense)
        expected = ["sparse" if model_facts.is_moe(n, experts, moe_freq) else "dense"
                    for n in range(1, layers + 1)]
        _require(list(mlp_types) == expected, "mlp_layer_types", mlp_types,
                 f"first_k_dense_replace={dense} dense layers, then MoE: {expected}")
    kpool = int(hf.get("index_kpool", 1))
    rope_dim = int(hf["qk_rope_head_dim"])
    return {
        "name": name,
        "num_layers": layers,
        "hidden_size": int(hf["hidden_size"]),
        "num_attention_heads": int(hf["num_attention_heads"]),
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf["max_position_embeddings"]),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf["rms_norm_eps"]),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "q_lora_rank": int(hf["q_lora_rank"]),
        "kv_lora_rank": int(hf["kv_lora_rank"]),
        "qk_head_dim": int(hf["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": rope_dim,
        "v_head_dim": int(hf["v_head_dim"]),
        **_rope(hf),
        # glm_moe_dsa builds q_a_layernorm / kv_a_layernorm with eps 1e-6; glm5_next with rms_norm_eps.
        "mla_latent_norm_epsilon": MLA_LATENT_NORM_EPS if hf["model_type"] == "glm_moe_dsa" else None,
        "dsa_indexer_n_heads": int(hf["index_n_heads"]),
        "dsa_indexer_head_dim": int(hf["index_head_dim"]),
        "dsa_indexer_topk": int(hf["index_topk"]),
        **_index_share(hf, layers),
        "dsa_indexer_rope_interleaved": hf["model_type"] == "glm_moe_dsa",
        "dsa_indexer_scoring_relu": True,
        # transformers never rotates; upstream Megatron-LM and the serving engines rotate q and the
        # scored keys (for KPool the pooled keys, after pooling). The Hadamard is orthonormal, so
        # the scores are transformers' up to rounding for every kpool (docs/hf_interop.md).
        "dsa_indexer_rotate_activation": True,
        "dsa_indexer_k_norm_epsilon": INDEXER_K_NORM_EPS,
        "dsa_indexer_kpool": kpool,
        "dsa_indexer_kpool_always_select_tail": bool(hf.get("index_kpool_always_select_tail", False)) and kpool > 1,
        "num_moe_experts": int(hf["n_routed_experts"]),
        "moe_first_k_dense_layers": dense,
        "moe_router_topk": int(hf["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
        "moe_shared_expert_intermediate_size": int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts", 1)),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "mtp_num_layers": int(hf.get("num_nextn_predict_layers", 0)),
        **_hyper_connections(hf),
    }


def hf_config_from_model(model: Any, dtype: str) -> dict[str, Any]:
    """A ``glm_moe_dsa`` ``config.json`` dict for our ``model`` group (``export``); a
    ``glm5_next_text`` one when ``model.hc_mult`` is set (mHC streams).

    KPool models (``dsa_indexer_kpool > 1``) are written as ``glm_moe_dsa`` plus the
    ``index_kpool`` / ``index_kpool_always_select_tail`` keys that glm5_next's indexer reads.
    """
    m = model
    _require(m.normalization == "RMSNorm", "model.normalization", m.normalization, "RMSNorm")
    _require(m.moe_router_score_function == "sigmoid", "model.moe_router_score_function",
             m.moe_router_score_function, "sigmoid")
    if m.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": m.rotary_base, "factor": m.rotary_scaling_factor,
                "original_max_position_embeddings": m.original_max_position_embeddings,
                "beta_fast": m.beta_fast, "beta_slow": m.beta_slow, "mscale": m.mscale,
                "mscale_all_dim": m.mscale_all_dim}
    else:
        rope = {"rope_type": "default", "rope_theta": m.rotary_base}
    shared = m.moe_shared_expert_intermediate_size or 0
    out = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "dtype": dtype,
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "intermediate_size": m.ffn_hidden_size,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.layernorm_epsilon,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_head_dim,
        "qk_rope_head_dim": m.qk_pos_emb_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_parameters": rope,
        "index_n_heads": m.dsa_indexer_n_heads,
        "index_head_dim": m.dsa_indexer_head_dim,
        "index_topk": m.dsa_indexer_topk,
        "index_topk_freq": m.dsa_indexer_topk_freq,
        "index_skip_topk_offset": m.dsa_indexer_skip_topk_offset,
        "indexer_types": indexer_types(m.num_layers, m.dsa_indexer_topk_freq, m.dsa_indexer_skip_topk_offset),
        "n_routed_experts": m.num_moe_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "n_shared_experts": shared // m.moe_ffn_hidden_size if shared else 0,
        "first_k_dense_replace": m.moe_first_k_dense_layers,
        "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "num_nextn_predict_layers": m.mtp_num_layers,
    }
    if m.dsa_indexer_kpool > 1:
        out["index_kpool"] = m.dsa_indexer_kpool
        out["index_kpool_always_select_tail"] = m.dsa_indexer_kpool_always_select_tail
    return out if m.hc_mult is None else _glm5_next_text(out, m)


def _glm5_next_text(out: dict[str, Any], m: Any) -> dict[str, Any]:
    """``out`` (a glm_moe_dsa config dict) as the ``glm5_next_text`` config of a model with mHC
    streams (``model.hc_mult``): transformers' only model with hyper-connections, NoPE MLA whose
    latent norms use ``rms_norm_eps``, per-layer ``layer_types`` / ``mlp_layer_types``."""
    _require(m.qk_pos_emb_head_dim == 0, "model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim,
             "0 with model.hc_mult set (glm5_next_text, the HF model with hyper-connections, is NoPE)")
    _require(m.mla_latent_norm_epsilon in (None, m.layernorm_epsilon), "model.mla_latent_norm_epsilon",
             m.mla_latent_norm_epsilon, f"null or model.layernorm_epsilon={m.layernorm_epsilon} with "
             "model.hc_mult set (glm5_next_text's latent norms use rms_norm_eps)")
    moe_freq = model_facts.moe_layer_freq(m.num_layers, m.num_moe_experts, m.moe_first_k_dense_layers)
    drop = ("architectures", "first_k_dense_replace", "rope_parameters", "num_nextn_predict_layers")
    return {**{k: v for k, v in out.items() if k not in drop},
            "model_type": "glm5_next_text",
            "layer_types": ["indexed_attention"] * m.num_layers,
            "mlp_layer_types": ["sparse" if model_facts.is_moe(n, m.num_moe_experts, moe_freq) else "dense"
                                for n in range(1, m.num_layers + 1)],
            "index_kpool": m.dsa_indexer_kpool,
            "index_kpool_always_select_tail": m.dsa_indexer_kpool_always_select_tail,
            # This model has no SwiGLU clamp; transformers' clamp at +inf is the identity.
            "swiglu_limit": float("inf"),
            "hc_mult": m.hc_mult, "hc_sinkhorn_iters": m.hc_sinkhorn_iters, "hc_eps": m.hc_eps}
