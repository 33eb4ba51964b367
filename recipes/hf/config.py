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
SKIP_MTP_HINT = ("--skip-mtp converts without the checkpoint's MTP layers (the model is then trained without "
                 "multi-token prediction; transformers' Glm5NextTextModel ignores those tensors as well)")
"""What import and verify say of a checkpoint's MTP layers that the model does not build."""
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
    allowed = {"indexed_attention", "full_attention"}
    if hf.get("model_type") == "glm5_next_text":
        allowed.add(model_facts.LINEAR_ATTENTION)
    _require(layer_types <= allowed, "layer_types", sorted(layer_types), ", ".join(sorted(allowed)))
    if hf.get("model_type") == "glm5_next_text":
        check_fields(hf, GLM5_NEXT_TEXT_FIELDS)


READ = "read"
"""A field the conversion reads (it becomes a ``model`` key or is checked against one)."""
METADATA = "metadata"
"""A field that does not change the model's tensors or its forward (bookkeeping, generation,
training-loss settings that are ``train``/``model`` choices here)."""

HC_FIELDS = tuple(HC_DEFAULTS)
"""glm5_next's mHC hyper-connection fields."""

GLM5_NEXT_TEXT_FIELDS: dict[str, str] = {
    **{key: READ for key in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
        "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
        "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
        "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
        "tie_word_embeddings", "mlp_layer_types", "attention_bias", "index_topk", "index_head_dim",
        "index_n_heads", "layer_types", "indexer_types", "swiglu_limit", "linear_head_dim",
        "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "index_kpool",
        "index_kpool_always_select_tail", "attention_dropout", "head_dim", "qk_head_dim",
        "index_topk_freq", "index_skip_topk_offset", "rope_parameters", "rope_theta",
        "num_nextn_predict_layers")},
    **{key: METADATA for key in (
        "architectures", "dtype", "torch_dtype", "transformers_version", "use_cache", "pad_token_id",
        "bos_token_id", "eos_token_id", "output_router_logits", "router_aux_loss_coef",
        "base_config_key", "_name_or_path", "output_hidden_states", "output_attentions",
        "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
        "problem_type", "tokenizer_class")},
    **{key: READ for key in HC_FIELDS},  # model.hc_* (kpool_layers/hyper_connections)
}
"""Every ``glm5_next_text`` config field and what the conversion does with it: :data:`READ` or
:data:`METADATA`. A field not listed is refused as unknown (:func:`check_fields`)."""


def check_fields(hf: dict[str, Any], table: dict[str, str]) -> None:
    """Raise naming every field of ``hf`` that ``table`` does not list (unsupported values of
    listed fields are refused where the conversion reads them)."""
    unknown = sorted(key for key in hf if key not in table)
    if unknown:
        raise ValueError(f"HF config fields {unknown} are unknown to the {hf.get('model_type')} "
                         f"conversion; known: {sorted(table)}")


def linear_attention_freq(layer_types: list[str]) -> Any:
    """megatron's ``linear_attention_freq`` for HF ``layer_types``: None (no KDA layer), the
    period N when layers N, 2N, ... are the DSA ones, else the 0/1 list."""
    pattern = [int(t == model_facts.LINEAR_ATTENTION) for t in layer_types]
    if not any(pattern):
        return None
    for n in range(2, len(pattern) + 1):
        if model_facts.linear_attention_pattern(len(pattern), n) == [bool(v) for v in pattern]:
            return n
    return pattern


def _hybrid(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The KDA keys and the per-layer indexer types of a glm5_next_text config with
    ``linear_attention`` layers."""
    defaults = {"linear_num_heads": 64, "linear_head_dim": 128, "linear_conv_kernel_dim": 4,
                "linear_lower_bound": -5.0}
    get = {key: hf.get(key, value) for key, value in defaults.items()}
    freq = linear_attention_freq(list(hf["layer_types"]))
    types = hf.get("indexer_types") or ["full"] * layers
    pattern = model_facts.LayerPattern(layers, indexer_types=tuple(types), linear_attention_freq=freq)
    problem = pattern.indexer_types_problem()
    _require(problem is None, "indexer_types", types, problem or "")
    bad = pattern.hf_shareable()
    _require(bad is None, "indexer_types", types,
             f"'shared' only right after a 'full' indexed_attention layer (transformers hands a "
             f"top-k to the next layer only; layer {bad} breaks it)")
    return {"linear_attention_freq": freq, "dsa_indexer_types": list(types),
            "linear_num_key_heads": int(get["linear_num_heads"]),
            "linear_num_value_heads": int(get["linear_num_heads"]),
            "linear_key_head_dim": int(get["linear_head_dim"]),
            "linear_value_head_dim": int(get["linear_head_dim"]),
            "linear_conv_kernel_dim": int(get["linear_conv_kernel_dim"]),
            "linear_gate_lower_bound": (None if get["linear_lower_bound"] is None
                                        else float(get["linear_lower_bound"]))}


def _mtp_layers(hf: dict[str, Any], skip_mtp: bool) -> int:
    """``model.mtp_num_layers``: the config's ``num_nextn_predict_layers``, 0 with ``skip_mtp``. A
    glm5_next_text model has no MTP module (transformers' neither: it ignores the checkpoint's
    ``model.layers.45.*``), so there its MTP layers convert only as skipped."""
    layers = int(hf.get("num_nextn_predict_layers") or 0)
    if hf["model_type"] == "glm5_next_text" and not skip_mtp:
        _require(layers == 0, "num_nextn_predict_layers", layers,
                 f"0 for glm5_next_text (its model has no MTP layer); {SKIP_MTP_HINT}")
    return 0 if skip_mtp else layers


def model_config_from_hf(hf: dict[str, Any], name: str, skip_mtp: bool = False) -> dict[str, Any]:
    """``model`` group values (``recipes.config.schema.ModelConfig`` fields) for an HF config dict;
    ``skip_mtp``: without the MTP layers the config names (``mtp_num_layers`` 0)."""
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
    hybrid = model_facts.LINEAR_ATTENTION in (hf.get("layer_types") or [])
    glm5_next = hf["model_type"] == "glm5_next_text"
    if glm5_next:
        _require(float(hf.get("attention_dropout", 0.0)) == 0.0, "attention_dropout",
                 hf.get("attention_dropout"), "0.0")
        _require(int(hf.get("num_key_value_heads", hf["num_attention_heads"])) == int(hf["num_attention_heads"]),
                 "num_key_value_heads", hf.get("num_key_value_heads"), "num_attention_heads (MLA)")
    # glm5_next clamps SwiGLU (default 10); glm_moe_dsa has no clamp.
    limit = hf.get("swiglu_limit", 10.0) if glm5_next else None
    return {
        **(_hybrid(hf, layers) if hybrid else {}),
        "activation_func_clamp_value": None if limit is None else float(limit),
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
        **(_index_share(hf, layers) if not hybrid else
           {"dsa_indexer_topk_freq": 1, "dsa_indexer_skip_topk_offset": 0}),
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
        "mtp_num_layers": _mtp_layers(hf, skip_mtp),
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
        "indexer_types": (indexer_types(m.num_layers, m.dsa_indexer_topk_freq, m.dsa_indexer_skip_topk_offset)
                          if m.dsa_indexer_types is None else list(m.dsa_indexer_types)),
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
    if (model_facts.LayerPattern.of(m).hybrid or m.activation_func_clamp_value is not None
            or m.hc_mult is not None):
        return glm5_next_text_config(m, out)
    return out


def glm5_next_text_config(m: Any, base: dict[str, Any]) -> dict[str, Any]:
    """A ``glm5_next_text`` ``config.json`` dict for a model with KDA layers, the SwiGLU clamp or
    mHC streams (transformers' glm5_next builds those; without a clamp its ``swiglu_limit`` is
    written as +inf, where transformers' clamp is the identity): ``base`` (the glm_moe_dsa fields) with glm5_next's
    names; checked against :data:`GLM5_NEXT_TEXT_FIELDS`."""
    pattern = model_facts.LayerPattern.of(m)
    _require(m.qk_pos_emb_head_dim == 0, "model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim,
             "0 (transformers' glm5_next is NoPE)")
    _require(m.mla_latent_norm_epsilon in (None, m.layernorm_epsilon), "model.mla_latent_norm_epsilon",
             m.mla_latent_norm_epsilon, "null (glm5_next's latent norms use rms_norm_eps)")
    _require(not m.mtp_num_layers, "model.mtp_num_layers", m.mtp_num_layers, "0 (glm5_next has no MTP)")
    bad = pattern.hf_shareable()
    _require(bad is None, "model.dsa_indexer_types", m.dsa_indexer_types,
             f"'shared' only right after a 'full' DSA layer (transformers hands a top-k to the next "
             f"layer only; layer {bad} breaks it)")
    experts, dense = m.num_moe_experts, m.moe_first_k_dense_layers
    moe_freq = model_facts.moe_layer_freq(m.num_layers, experts, dense)
    out = {key: value for key, value in base.items()
           if key not in ("first_k_dense_replace", "num_nextn_predict_layers", "rope_parameters",
                          "index_topk_freq", "index_skip_topk_offset")}
    out.update({
        "architectures": ["Glm5NextTextModel"], "model_type": "glm5_next_text",
        "layer_types": pattern.layer_types(),
        "indexer_types": ["full" if pattern.computes_topk(n) or pattern.is_linear_attention(n) else "shared"
                          for n in range(1, m.num_layers + 1)] if m.dsa_indexer_types is None
        else list(m.dsa_indexer_types),
        "mlp_layer_types": ["sparse" if model_facts.is_moe(n, experts, moe_freq) else "dense"
                            for n in range(1, m.num_layers + 1)],
        "swiglu_limit": (float("inf") if m.activation_func_clamp_value is None
                         else m.activation_func_clamp_value),
        "linear_num_heads": m.linear_num_key_heads, "linear_head_dim": m.linear_key_head_dim,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "linear_lower_bound": m.linear_gate_lower_bound,
        "index_kpool": m.dsa_indexer_kpool,
        "index_kpool_always_select_tail": bool(m.dsa_indexer_kpool_always_select_tail),
        "pad_token_id": None,
    })
    if m.hc_mult is not None:
        out.update({"hc_mult": m.hc_mult, "hc_sinkhorn_iters": m.hc_sinkhorn_iters, "hc_eps": m.hc_eps})
    check_fields(out, GLM5_NEXT_TEXT_FIELDS)
    return out
