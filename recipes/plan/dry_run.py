"""``train.dry_run=true``: build the full model on the ``meta`` device (no memory), print its
parameter count (total and active per token), a per-rank memory estimate for the chosen
parallelism (with the overrides of a layout that fits where it does not, :mod:`recipes.plan.fit`)
and the precision map, then exit. Also the analytic parameter/FLOP model for what
runs before or without a meta build (MFU, the checkpoint-size preflight): its layer facts come
from :mod:`kpool_layers.model_facts`, and the tests check it against the meta build.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps
from omegaconf import DictConfig

from kpool_layers import model_facts
from recipes.plan import fit, memory_plan
from recipes.config.megatron import to_transformer_config
from recipes.observe.metrics import FlopModel
from recipes.config.schema import Config, ConfigError, ModelConfig
from recipes.config.rules import all_problems


def analytic_param_count(m: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of a GLM-5.x model from its ``model`` config.

    Matches megatron's built ``GPTModel`` exactly (tests check it against a meta build). MTP
    layers copy the last decoder layer's MLP kind and number their attention from 1 again.
    """
    h, n = m.hidden_size, m.num_attention_heads
    rope = m.qk_pos_emb_head_dim
    attn = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * (m.qk_head_dim + rope)
            + h * (m.kv_lora_rank + rope) + m.kv_lora_rank
            + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim) + n * m.v_head_dim * h)
    ih, idim = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim
    indexer = m.q_lora_rank * ih * idim + h * idim + 2 * idim + h * ih
    if m.dsa_indexer_kpool > 1:
        indexer += h * idim + m.dsa_indexer_kpool * idim
    dense_mlp = 3 * h * m.ffn_hidden_size
    experts = m.num_moe_experts or 0
    routed = experts * 3 * h * m.moe_ffn_hidden_size
    shared = 3 * h * (m.moe_shared_expert_intermediate_size or 0)
    router = h * experts  # the expert bias is a buffer, not a parameter

    moe_freq = model_facts.moe_layer_freq(m.num_layers, experts, m.moe_first_k_dense_layers)
    pattern = model_facts.LayerPattern.of(m)
    heads_kda, d_kda = m.linear_num_key_heads, m.linear_key_head_dim
    width = heads_kda * d_kda
    # q/k/v, forget-gate and output-gate low-rank pairs, beta, output; conv taps, dt_bias, A_log, o_norm
    kda = (3 * h * width + 2 * (h * d_kda + d_kda * width) + h * heads_kda + width * h
           + 3 * width * m.linear_conv_kernel_dim + width + heads_kda + d_kda)

    streams = m.hc_mult or 0  # mHC: fn [(2 + N) N, N h], base [(2 + N) N], scale [3] per block
    hyper = 2 * ((2 + streams) * streams * (streams * h + 1) + 3) if streams else 0

    def layer(number: int, moe: bool) -> tuple[int, int]:
        base = 2 * h + (kda if pattern.is_linear_attention(number) else attn) + hyper
        if pattern.computes_topk(number):
            base += indexer
        if not moe:
            return base + dense_mlp, base + dense_mlp
        active_routed = routed * m.moe_router_topk // experts
        return base + router + shared + routed, base + router + shared + active_routed

    total = active = 0
    for number in range(1, m.num_layers + 1):
        t, a = layer(number, model_facts.is_moe(number, experts, moe_freq))
        total, active = total + t, active + a
    embed = m.vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1) + h
    total, active = total + embed, active + embed
    for _ in range(m.mtp_num_layers):
        t, a = layer(1, model_facts.is_moe(m.num_layers, experts, moe_freq))
        extra = 3 * h + 2 * h * h  # enorm, hnorm, final norm, eh_proj
        total, active = total + t + extra, active + a + extra
    return total, active


def flop_model(cfg: Config) -> FlopModel:
    """FLOPs per token of ``cfg.model`` (see :class:`recipes.observe.metrics.FlopModel`)."""
    m = cfg.model
    _, active = analytic_param_count(m)
    pattern = model_facts.LayerPattern.of(m)
    kda_layers = sum(pattern.is_linear_attention(n) for n in range(1, m.num_layers + 1))
    return FlopModel(
        active_params=active - m.vocab_size * m.hidden_size,  # the input embedding is a lookup
        num_layers=m.num_layers - kda_layers, heads=m.num_attention_heads,
        qk_dim=m.kv_lora_rank + m.qk_pos_emb_head_dim, v_dim=m.kv_lora_rank,
        topk=m.dsa_indexer_topk + (m.dsa_indexer_kpool - 1 if m.dsa_indexer_kpool_always_select_tail else 0),
        index_heads=m.dsa_indexer_n_heads, index_dim=m.dsa_indexer_head_dim // m.dsa_indexer_kpool,
        index_layers=len(pattern.topk_layers()),
        kda_layers=kda_layers, kda_heads=m.linear_num_key_heads, kda_head_dim=m.linear_key_head_dim,
        hc_streams=m.hc_mult or 0, hc_blocks=2 * m.num_layers if m.hc_mult else 0, hidden_size=m.hidden_size,
    )


def memory_estimate_gib(cfg: Config, total: int, expert: int) -> dict[str, float]:
    """Per-rank weights + grads + Adam state (GiB) under ``cfg.parallelism``.

    bf16 weights (2 B) + fp32 main grads (4 B) + fp32 master/m/v (12 B, sharded over data
    parallel ranks by the distributed optimizer); experts split over EP, the rest over TP, both
    over PP. Activations are not included.
    """
    r = memory_plan.RankSizes.of(cfg)
    dense_rank = (total - expert) / (r.tp * r.pp)
    expert_rank = expert / (r.ep * r.etp * r.pp)
    weights = (dense_rank + expert_rank) * r.weight_bytes
    grads = (dense_rank + expert_rank) * 4
    optim = dense_rank * r.adam_bytes_dense + expert_rank * r.adam_bytes_expert
    gib = 2**30
    return {"weights": weights / gib, "grads": grads / gib, "optimizer": optim / gib,
            "total": (weights + grads + optim) / gib}


def dry_run(cfg: Config) -> None:
    """Meta-device build at TP = PP = EP = 1 and the report; collective-free beyond group init."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from recipes.train.model import build_gpt_model, count_parameters, meta_init

    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(cfg.train.seed)
    tcfg = to_transformer_config(cfg)
    for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "expert_model_parallel_size", "context_parallel_size"):
        setattr(tcfg, field, 1)
    tcfg.expert_tensor_parallel_size = 1
    tcfg.num_layers_in_first_pipeline_stage = tcfg.num_layers_in_last_pipeline_stage = None
    tcfg.sequence_parallel = False
    with meta_init(tcfg):
        model = build_gpt_model(cfg, tcfg)
    counted = count_parameters(model, tcfg)
    expert = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    mem = memory_estimate_gib(cfg, counted.total, expert)
    if dist.get_rank() != 0:
        return
    p = cfg.parallelism
    print(f"model {cfg.model.name}: {counted.total:,} parameters "
          f"({counted.total / 1e9:.2f} B; MTP {counted.mtp:,}; embeddings+output {counted.embedding:,})")
    print(f"active per token: {counted.active_per_token:,} ({counted.active_per_token / 1e9:.2f} B)")
    print(f"per-rank memory at TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
          f"EP={p.expert_model_parallel_size} on {p.nodes}x{p.gpus_per_node} GPUs: "
          + ", ".join(f"{k} {v:.1f} GiB" for k, v in mem.items()) + " (activations excluded)")
    groups = memory_plan.parameter_groups(model)
    for line in memory_plan.report(cfg, model) + fit.report(cfg, groups):
        print(line)
    print_precision_map(model)


def check_all(cfg: DictConfig, world_size: int) -> None:
    """Every config rule at once for the planned machine (on the composed config, as
    :func:`recipes.config.rules.validate`); raises one :class:`ConfigError` that lists all broken rules."""
    problems = all_problems(cfg, world_size)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        first = problems[0]
        listing = "\n".join(f"  - {err}" for err in problems)
        raise ConfigError(first.key, first.value, first.allowed,
                          f"{len(problems)} config problems for {world_size} GPUs:\n{listing}")


def print_precision_map(model: Any) -> None:
    """The precision map of the meta-built model under its policy (``model.config.precision``;
    backend as configured: the dry run plans for another machine)."""
    from recipes.observe.precision_map import format_rows, precision_rows

    policy = model.config.precision
    backend = policy.backend if policy.fp8 else "none"
    print(f"precision map ({policy.name}, backend {backend}; role xN  compute  dtype):")
    for line in format_rows(precision_rows(model, backend)):
        print(line)
