"""The precision map of a built GLM-5.x model, read from its modules' roles, and the profiles.

The policy (``model.config.precision``, made from the ``precision`` group by
``recipes.config.megatron``) is applied at the build: the layer specs build every linear as a
role-tagged class that holds its role's numerics (``kpool_layers.precision.linears``). Here:

* :func:`profile_policy` - the policy of a profile of ``conf/precision`` (the profiles' only
  definition).
* :func:`route_rows` - one row per kernel route (:mod:`kpool_layers.kernel_routes`): the chosen
  backend and why the preferred ones declined; :func:`kernel_rows` appends them to the DSA rows.
* :func:`precision_map` / :func:`precision_rows` / :func:`report_precision` - the map (one row per
  linear: ``module``, ``role``, ``quantized``, ``dtype``, ``backend``, ``backward``, ``note``) from each module's
  ``role`` and ``numerics``, printed, saved as ``<run dir>/precision_map.json`` and put in the
  wandb config.

Two roles are not computed by their linear's forward, and the map says so in ``note`` (the owning
module marks them at its build):

* ``mla.kv_up`` (``kpool_layers.mla.attention.KV_UP_NOTE``): the absorbed MLA uses
  ``linear_kv_up_proj.weight`` directly (split per head into ``W_uk`` / ``W_uv`` for batched
  matmuls); its forward never runs, so it always computes in the model dtype, never FP8, whatever
  the policy says.
* ``indexer.weights`` with ``kpool > 1`` (``kpool_layers.dsa.indexer.KPOOL_WEIGHTS_NOTE``): the KPool
  contract computes the head weights with an FP32 GEMM inside the indexer (docs/kpool.md), so it
  is FP32 whatever the policy says.
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

from kpool_layers import kernel_routes
from kpool_layers.compat.wgrad_accumulation import WGRAD
from kpool_layers.dsa.backends import DSA
from kpool_layers.dsa.core_attention import SparseMLACore
from kpool_layers.loss import LOSS
from kpool_layers.moe.grouped_gemm import GROUPED_FP8, GROUPED_MM
from kpool_layers.moe.permute import ROW_SUM
from kpool_layers.mla.rope import ROPE
from kpool_layers.precision.fp8 import SERVING_QUANT
from kpool_layers.precision.hadamard import HADAMARD
from kpool_layers.precision.policy import FP8_DEQUANT, FP8_GEMM, FP8_QUANT
from kpool_layers.moe.experts import GroupedExperts
from kpool_layers.hyper_connections.mhc import GATES, NORM_PROJECT, PRE_SUM, STREAM_MIX, HyperConnection
from kpool_layers.dsa.indexer import DSAIndexer
from kpool_layers.linear_attention.backends import LINEAR_ATTENTION
from kpool_layers.precision.policy import LinearNumerics, PrecisionPolicy, resolve_backend
from recipes.config.schema import PrecisionConfig

PROFILES_DIR = Path(__file__).resolve().parents[1] / "conf" / "precision"
"""The precision profiles, one ``<name>.yaml`` each (``precision=<name>``)."""

_LINEAR_TYPES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, TopKRouter, torch.nn.Linear)

NO_ROLE_NOTE = "no precision role: left as built"

KERNEL_ROUTES: tuple[kernel_routes.Route, ...] = (DSA, FP8_GEMM, FP8_QUANT, FP8_DEQUANT, SERVING_QUANT, HADAMARD,
                                                  GROUPED_FP8, GROUPED_MM, ROW_SUM, ROPE, LOSS, WGRAD,
                                                  LINEAR_ATTENTION, GATES, STREAM_MIX, NORM_PROJECT, PRE_SUM)
"""Every kernel route the map lists (imported here, so each is registered before it is listed)."""


def profile_policy(name: str) -> PrecisionPolicy:
    """The policy of profile ``name``: ``conf/precision/<name>.yaml`` over the schema defaults."""
    profile = OmegaConf.load(PROFILES_DIR / f"{name}.yaml")
    return PrecisionPolicy.from_config(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), profile))


def _strip(name: str) -> str:
    """Module name without DDP / Float16Module ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _row(module: str, numerics: Optional[LinearNumerics], weight_dtype: torch.dtype, backend: str) -> dict[str, Any]:
    """The map's row of the GEMM of a weight of ``weight_dtype`` with ``numerics`` (None: no role)."""
    quantized = numerics is not None and numerics.quantized
    return {
        "module": _strip(module),
        "role": numerics.role.value if numerics else None,
        "quantized": quantized,
        "dtype": str(numerics.dtype(weight_dtype) if numerics else weight_dtype).removeprefix("torch."),
        "backend": backend if quantized else "none",
        "backward": numerics.backward(weight_dtype) if numerics else str(weight_dtype).removeprefix("torch."),
        "note": numerics.note if numerics else NO_ROLE_NOTE,
    }


def precision_rows(model: torch.nn.Module, backend: str) -> list[dict[str, Any]]:
    """The precision map: one row per linear-like module of ``model`` (parallel linears,
    ``nn.Linear``, embedding, router), per stacked weight of grouped experts
    (``<experts>.weight1`` / ``.weight2``) and per mHC projection (``<attn_hc|ffn_hc>.fn``) with ``module`` (wrapper prefixes removed), ``role`` (or
    None), ``quantized``, ``dtype`` (e.g. ``"bfloat16"``), ``backend`` (``backend`` for quantized
    rows, else ``"none"``), ``backward`` (what the backward GEMMs compute in: ``"fp8"`` for FP8
    dgrad / wgrad, else their dtype, straight-through for FP8 rows) and ``note`` (why the linear's forward does not compute its role, else
    None), from the module's ``role`` and ``numerics``."""
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            rows += [_row(f"{name}.{weight}", numerics, getattr(module, weight).dtype, backend)
                     for weight, numerics in module.numerics.items()]
        elif isinstance(module, HyperConnection):  # its projection fn, role mhc.proj
            rows.append(_row(f"{name}.fn", module.numerics, module.fn.dtype, backend))
        elif isinstance(module, _LINEAR_TYPES):
            rows.append(_row(name, getattr(module, "numerics", None), module.weight.dtype, backend))
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
    return rows + route_rows()


def route_rows() -> list[dict[str, Any]]:
    """One row per kernel route (:mod:`kpool_layers.kernel_routes`, every key), role
    ``route.<key>``: ``backend`` = the chosen backend, ``note`` = why each preferred backend
    declined (or that the config asked for it), plus ``allowed`` (the table, in order) and
    ``declined`` (backend -> reason)."""
    rows = []
    missing = {route.key for route in KERNEL_ROUTES} ^ set(kernel_routes.ROUTES)
    if missing:
        raise RuntimeError(f"kernel routes not in KERNEL_ROUTES or not registered: {sorted(missing)}")
    for r in kernel_routes.resolutions():
        reasons = "; ".join(f"{name}: {why}" for name, why in r["declined"].items())
        note = f"asked for by {r['config_key']}" if r["forced"] else f"declined {reasons}" if reasons else "first choice"
        rows.append({"module": f"kernel_routes.{r['key']}", "role": f"route.{r['key']}", "quantized": False,
                     "dtype": "any", "backend": r["backend"], "note": note, "allowed": r["allowed"],
                     "declined": r["declined"]})
    return rows


def precision_map(model: torch.nn.Module) -> list[dict[str, Any]]:
    """:func:`precision_rows` of a built model under its policy (``model.config.precision``), with
    the backend resolved here."""
    return precision_rows(model, resolve_backend(model.config.precision))


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Console lines of the map, one per role (layers collapsed) with the module count."""
    groups: dict[tuple, int] = {}
    for r in rows:
        key = (r["role"] or re.sub(r"\.\d+\.", ".N.", r["module"]), r["quantized"], r["dtype"],
               r["backend"], r.get("backward"), r["note"])
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (role, quantized, dtype, backend, backward, note), n in groups.items():
        kind = (f"kernel {backend}" if str(role).startswith(("kernel.", "route."))
                else f"FP8 ({backend})" if quantized else "unquantized")
        bwd = f"  bwd {backward}" if quantized else ""
        lines.append(f"  {role:<20} x{n:<6} {kind:<16} {dtype}{bwd}" + (f"  [{note}]" if note else ""))
    return lines


def summary_line(rows: list[dict[str, Any]]) -> str:
    """The map in one line: how many linears run FP8 (of all) and the DSA kernels' backends."""
    linears = [r for r in rows if not str(r["role"]).startswith("kernel.")]
    kernels = sorted({f"{r['role'].removeprefix('kernel.')} {r['backend']}" for r in rows
                      if str(r["role"]).startswith("kernel.")})
    fp8 = sum(bool(r["quantized"]) for r in linears)
    text = f"{fp8}/{len(linears)} linears FP8"
    return text + (f", kernels {', '.join(kernels)}" if kernels else "")


def report_precision(rows: list[dict[str, Any]], policy: PrecisionPolicy, run_dir: Path, logger: Any,
                     full: bool = False) -> None:
    """Print the map of ``policy`` in one line (``full``: also one line per role,
    ``logging.print_precision_map``), write ``run_dir/precision_map.json`` and add it to the wandb
    config (``logger``: :class:`recipes.observe.metrics.MetricsLogger`; a no-op on non-logging ranks)."""
    if not logger.enabled:
        return
    path = run_dir / "precision_map.json"
    print(f"precision {policy.name}: backend {resolve_backend(policy)}, {summary_line(rows)}; map in {path}"
          + ("" if full else " (logging.print_precision_map=true prints it)"), flush=True)
    if full:
        for line in format_rows(rows):
            print(line, flush=True)
    path.write_text(json.dumps(rows, indent=1))
    logger.update_config({"precision_map": rows})
