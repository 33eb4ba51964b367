"""Applies the precision policy of a built GLM-5.x model (``model.config.precision``, made from the
``precision`` group by ``recipes.megatron_config``) and reports what it did.

* :func:`profile_policy` - the policy of a profile of ``conf/precision`` (the profiles' only
  definition).
* :func:`linear_role` - the :class:`~kpool_layers.precision.Role` of every linear by module name.
* :func:`setup_precision` - routes the linears (:func:`kpool_layers.precision.apply_precision`),
  switches the indexers' serving-quantized scoring on, returns the precision map.
* :func:`precision_rows` / :func:`report_precision` - the map (one row per linear: ``module``,
  ``role``, ``quantized``, ``dtype``, ``backend``, ``note``), printed, saved as
  ``<run dir>/precision_map.json`` and put in the wandb config.

Two roles are not routed through a wrapped forward, and the map says so in ``note``:

* ``mla.kv_up``: the absorbed MLA uses ``linear_kv_up_proj.weight`` directly (split per head into
  ``W_uk`` / ``W_uv`` for batched matmuls, ``kpool_layers.attention``); its forward never runs,
  so it always computes in the model dtype, never FP8, whatever the policy says.
* ``indexer.weights`` with ``kpool > 1``: the KPool contract computes the head weights with an
  FP32 GEMM inside the indexer (docs/kpool.md), so it is FP32 whatever the policy says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer.moe.router import TopKRouter
from omegaconf import OmegaConf

from kpool_layers.core_attention import SparseMLACore
from kpool_layers.indexer import DSAIndexer
from kpool_layers.precision import PrecisionPolicy, Role, apply_precision, resolve_backend
from recipes.schema import PrecisionConfig

PROFILES_DIR = Path(__file__).resolve().parent / "conf" / "precision"
"""The precision profiles, one ``<name>.yaml`` each (``precision=<name>``)."""

_LINEAR_TYPES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, TopKRouter, torch.nn.Linear)

# (pattern on the module name with wrapper prefixes removed, role); the first match wins.
_RULES: tuple[tuple[re.Pattern[str], Role], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"(^|\.)embedding\.word_embeddings$", Role.EMBEDDING),
        (r"(^|\.)output_layer$", Role.OUTPUT),
        (r"\.self_attention\.linear_q_down_proj$", Role.MLA_Q_DOWN),
        (r"\.self_attention\.linear_q_up_proj$", Role.MLA_Q_UP),
        (r"\.self_attention\.linear_kv_down_proj$", Role.MLA_KV_DOWN),
        (r"\.self_attention\.linear_kv_up_proj$", Role.MLA_KV_UP),
        (r"\.self_attention\.linear_proj$", Role.MLA_OUT),
        (r"\.indexer\.linear_wq_b$", Role.INDEXER_Q),
        (r"\.indexer\.linear_wk$", Role.INDEXER_K),
        (r"\.indexer\.linear_weights_proj$", Role.INDEXER_WEIGHTS),
        (r"\.indexer\.index_kpool_compress_gate$", Role.INDEXER_KPOOL_GATE),
        (r"\.mlp\.router$", Role.MOE_ROUTER),
        (r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1$", Role.MOE_EXPERT_FC1),
        (r"\.mlp\.experts\.local_experts\.\d+\.linear_fc2$", Role.MOE_EXPERT_FC2),
        (r"\.mlp\.shared_experts\.linear_fc1$", Role.MOE_SHARED_FC1),
        (r"\.mlp\.shared_experts\.linear_fc2$", Role.MOE_SHARED_FC2),
        (r"\.mlp\.linear_fc1$", Role.MLP_FC1),
        (r"\.mlp\.linear_fc2$", Role.MLP_FC2),
    )
)

KV_UP_NOTE = "absorbed: weight used directly (W_uk/W_uv batched matmuls) in the model dtype, never FP8"
KPOOL_WEIGHTS_NOTE = "KPool contract: FP32 GEMM inside the indexer"
NO_ROLE_NOTE = "no precision role: left as built"


def profile_policy(name: str) -> PrecisionPolicy:
    """The policy of profile ``name``: ``conf/precision/<name>.yaml`` over the schema defaults."""
    profile = OmegaConf.load(PROFILES_DIR / f"{name}.yaml")
    return PrecisionPolicy.from_config(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), profile))


def _strip(name: str) -> str:
    """Module name without DDP / Float16Module ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def linear_role(name: str) -> Optional[Role]:
    """Role of the module called ``name`` in a (possibly wrapped) GPTModel, or None."""
    bare = _strip(name)
    for pattern, role in _RULES:
        if pattern.search(bare):
            return role
    return None


def _parent(modules: dict[str, torch.nn.Module], name: str) -> Optional[torch.nn.Module]:
    return modules.get(name.rsplit(".", 1)[0]) if "." in name else None


def _not_routed_note(modules: dict[str, torch.nn.Module], name: str, role: Role) -> Optional[str]:
    """Why a role's linear is not routed (see the module docstring), or None if it is."""
    if role is Role.MLA_KV_UP:
        return KV_UP_NOTE
    parent = _parent(modules, name)
    if role is Role.INDEXER_WEIGHTS and isinstance(parent, DSAIndexer) and parent.kpool > 1:
        return KPOOL_WEIGHTS_NOTE
    return None


def _routing_role_of(model: torch.nn.Module):  # noqa: ANN202 - kpool_layers.precision.RoleOf
    modules = dict(model.named_modules())

    def role_of(name: str, module: torch.nn.Module) -> Optional[str]:
        role = linear_role(name)
        if role is None or _not_routed_note(modules, name, role) is not None:
            return None
        return role.value

    return role_of


def _weight_dtype(module: torch.nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else torch.bfloat16


def precision_rows(model: torch.nn.Module, policy: PrecisionPolicy, backend: str) -> list[dict[str, Any]]:
    """The precision map: one row per linear-like module of ``model`` (parallel linears,
    ``nn.Linear``, embedding, router) with ``module`` (wrapper prefixes removed), ``role`` (or
    None), ``quantized``, ``dtype`` (e.g. ``"bfloat16"``), ``backend`` (``backend`` for quantized
    rows, else ``"none"``) and ``note`` (why a role is not routed, else None)."""
    modules = dict(model.named_modules())
    rows = []
    for name, module in modules.items():
        if not isinstance(module, _LINEAR_TYPES):
            continue
        role = linear_role(name)
        own = _weight_dtype(module)
        if role is None:
            quantized, dtype, note = False, own, NO_ROLE_NOTE
        else:
            note = _not_routed_note(modules, name, role)
            if note == KV_UP_NOTE:
                quantized, dtype = False, own
            elif note == KPOOL_WEIGHTS_NOTE:
                quantized, dtype = False, torch.float32
            else:
                quantized, dtype = policy.quantized(role), policy.compute_dtype(role, own)
        rows.append({
            "module": _strip(name),
            "role": role.value if role else None,
            "quantized": quantized,
            "dtype": str(dtype).removeprefix("torch."),
            "backend": backend if quantized else "none",
            "note": note,
        })
    return rows


def kernel_rows(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Rows of the DSA kernels (``model.dsa_kernels``) for the printed map beside
    :func:`precision_rows`' linears: every layer's sparse MLA core attention (role
    ``kernel.sparse_mla``) and indexer top-k (``kernel.indexer_topk``), ``backend`` = the kernel
    backend, ``note`` = its determinism (docs/kernels.md)."""
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMLACore):
            facts = module.facts
            cuda = torch.cuda.is_available()
            deterministic = facts.deterministic_cuda if cuda else facts.deterministic_cpu
            note = "deterministic" if deterministic else f"not deterministic: {facts.nondeterministic_part}"
            dtype = str(module.config.params_dtype).removeprefix("torch.")
            rows.append({"module": _strip(name), "role": "kernel.sparse_mla", "quantized": False,
                         "dtype": dtype, "backend": facts.name, "note": note})
        elif isinstance(module, DSAIndexer):
            rows.append({"module": _strip(name), "role": "kernel.indexer_topk", "quantized": False,
                         "dtype": "float32", "backend": module.config.dsa_kernels,
                         "note": "deterministic"})
    return rows


def setup_precision(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Apply the policy of a built (dtype-cast) model, ``model.config.precision``: route every
    routable linear through it; returns :func:`precision_rows`. The indexers' other numerics (key
    LayerNorm precision, serving-quantized scoring) are fixed at their construction from the
    config (:func:`kpool_layers.indexer.training_numerics`)."""
    policy: PrecisionPolicy = model.config.precision
    apply_precision(model, policy, _routing_role_of(model))
    return precision_rows(model, policy, resolve_backend(policy))


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Console lines of the map, one per role (layers collapsed) with the module count."""
    groups: dict[tuple, int] = {}
    for r in rows:
        key = (r["role"] or re.sub(r"\.\d+\.", ".N.", r["module"]), r["quantized"], r["dtype"],
               r["backend"], r["note"])
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (role, quantized, dtype, backend, note), n in groups.items():
        kind = (f"kernel {backend}" if str(role).startswith("kernel.")
                else f"FP8 ({backend})" if quantized else "unquantized")
        lines.append(f"  {role:<20} x{n:<6} {kind:<16} {dtype}" + (f"  [{note}]" if note else ""))
    return lines


def report_precision(rows: list[dict[str, Any]], policy: PrecisionPolicy, run_dir: Path, logger: Any) -> None:
    """Print the map of ``policy``, write ``run_dir/precision_map.json`` and add it to the wandb
    config (``logger``: :class:`recipes.metrics.MetricsLogger`; a no-op on non-logging ranks)."""
    if not logger.enabled:
        return
    print(f"precision {policy.name}: backend {resolve_backend(policy)}", flush=True)
    for line in format_rows(rows):
        print(line, flush=True)
    (run_dir / "precision_map.json").write_text(json.dumps(rows, indent=1))
    logger.update_config({"precision_map": rows})
