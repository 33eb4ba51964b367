"""Which kernels compute DSA's sparse MLA attention and the indexer's scores + top-k.

One model key, ``dsa_kernels``, picks a backend for both; the choice is made once, before the
model is built, and the layer specs (:func:`kpool_layers.mla.attention.glm_attention_spec`) put the
backend's modules into their submodules:

============  =========================================================  ==========================
backend       sparse MLA (``core_attention``)                            indexer scores + top-k
============  =========================================================  ==========================
``torch``     chunked PyTorch (:mod:`kpool_layers.dsa.sparse_attention`)     chunked PyTorch (``topk``)
``tilelang``  megatron-core's TileLang ``SparseMLA``                     megatron-core's TileLang
                                                                         indexer logits + topk
``triton``    ours (:mod:`kpool_layers.kernels.sparse_mla_triton`)       ours (``indexer_topk_triton``)
============  =========================================================  ==========================

``auto`` is ``triton`` on CUDA devices of compute capability >= 9.0 and ``torch`` elsewhere: the
kernel route :data:`DSA` (:mod:`kpool_layers.kernel_routes`) holds the table, tried in the order
triton, torch (``tilelang`` only when asked for). :func:`check_backend` says, before the build,
whether a backend can run here for a model's shapes (raising :class:`KernelUnavailable` naming the reason and the fix), and :data:`MANIFEST` what each
backend guarantees (docs/kernels.md is the long form).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from kpool_layers.dsa.topk import chunked_range_topk
from kpool_layers.kernel_routes import (KernelBackend, KernelUnavailable, Machine, Route, needs_capability, needs_cuda,
                                        register)


class Backend(str, Enum):
    """Values of ``model.dsa_kernels`` (the schema's field type)."""

    auto = "auto"
    torch = "torch"
    tilelang = "tilelang"
    triton = "triton"


BACKENDS = tuple(b.value for b in Backend)
"""The same values as strings."""

TILELANG_EXTRA = "pip install -e '.[tilelang]'"


@dataclass(frozen=True)
class KernelFacts:
    """What a backend guarantees: bit-identical reruns of the forward, the query gradient and the
    latent-key gradient (per device kind), and the dtypes it takes."""

    name: str
    deterministic_cpu: bool
    deterministic_cuda: bool
    nondeterministic_part: Optional[str]
    dtypes: tuple[torch.dtype, ...]


MANIFEST: dict[str, KernelFacts] = {
    "torch": KernelFacts(
        "torch", deterministic_cpu=True, deterministic_cuda=False,
        nondeterministic_part="sparse MLA latent-key gradient (index_add_ scatter on CUDA)",
        dtypes=(torch.float64, torch.float32, torch.bfloat16, torch.float16)),
    "tilelang": KernelFacts(
        "tilelang", deterministic_cpu=False, deterministic_cuda=False,
        nondeterministic_part="sparse MLA latent-key gradient (TileLang float atomics)",
        dtypes=(torch.bfloat16,)),
    "triton": KernelFacts(
        "triton", deterministic_cpu=True, deterministic_cuda=True, nondeterministic_part=None,
        dtypes=(torch.float32, torch.bfloat16, torch.float16)),
}


@dataclass(frozen=True)
class KernelShapes:
    """The model facts a backend's support depends on (per TP rank where it matters)."""

    dtype: torch.dtype
    kv_lora_rank: int
    qk_pos_emb_head_dim: int
    dsa_indexer_head_dim: int


def _cuda_capability() -> Optional[tuple[int, int]]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def resolve(requested: str, capability: Optional[tuple[int, int]] = None, *,
            on_device: Optional[bool] = None) -> str:
    """The backend ``requested`` stands for: ``auto`` -> ``triton`` on CUDA compute capability
    >= 9.0, else ``torch`` (:data:`DSA`'s automatic resolution, recorded there); any other value
    unchanged. ``capability`` defaults to this machine's (None without CUDA); ``on_device=False``
    (a dry run planning for GPUs from a CPU box) resolves ``auto`` for a Hopper GPU."""
    if requested not in BACKENDS:
        raise KernelUnavailable(f"dsa_kernels={requested!r}; allowed: {list(BACKENDS)}")
    if requested != "auto":
        return requested
    if on_device is False:
        machine = Machine.planned_gpu()
    elif capability is not None:
        machine = Machine(cuda=True, capability=capability)
    else:
        machine = Machine.here()
    return DSA.resolve(machine=machine).backend


def _tilelang_shapes_error(shapes: KernelShapes) -> Optional[str]:
    if shapes.dtype != torch.bfloat16:
        return f"bf16 parameters (got {shapes.dtype}; set precision=bf16, fp8 or serving_match)"
    if shapes.kv_lora_rank != 512 or shapes.qk_pos_emb_head_dim not in (0, 64):
        return (f"kv_lora_rank 512 with qk_pos_emb_head_dim 64 or 0 (got {shapes.kv_lora_rank} "
                f"and {shapes.qk_pos_emb_head_dim}): its SparseMLA is specialised for 576/512")
    return None


def _triton_shapes_error(shapes: KernelShapes) -> Optional[str]:
    if shapes.dtype not in MANIFEST["triton"].dtypes:
        return f"fp32, bf16 or fp16 (got {shapes.dtype})"
    if shapes.kv_lora_rank % 16 or shapes.qk_pos_emb_head_dim % 16:
        return (f"kv_lora_rank and qk_pos_emb_head_dim multiples of 16 (got {shapes.kv_lora_rank} "
                f"and {shapes.qk_pos_emb_head_dim})")
    if shapes.dsa_indexer_head_dim % 16:
        return f"dsa_indexer_head_dim a multiple of 16 (got {shapes.dsa_indexer_head_dim})"
    return None


def check_backend(backend: str, shapes: KernelShapes, *, deterministic: bool,
                  on_device: bool = True) -> None:
    """Raise :class:`KernelUnavailable` unless resolved ``backend`` can run the model: its package
    imports, a CUDA device is there (``on_device=False`` skips the machine checks, for a dry run
    planning for another machine), the shapes are supported, and it is deterministic where
    ``deterministic`` asks for it."""
    if backend == "torch":
        if deterministic and on_device and torch.cuda.is_available():
            raise KernelUnavailable(
                "dsa_kernels=torch is not deterministic on CUDA ("
                f"{MANIFEST['torch'].nondeterministic_part}); use dsa_kernels=triton")
        return
    facts = MANIFEST[backend]
    if deterministic:
        raise_if = not (facts.deterministic_cuda if on_device else facts.deterministic_cpu)
        if raise_if:
            raise KernelUnavailable(
                f"dsa_kernels={backend} is not deterministic ({facts.nondeterministic_part}); "
                "use dsa_kernels=triton with deterministic training")
    if on_device:
        capability = _cuda_capability()
        if capability is None:
            raise KernelUnavailable(f"dsa_kernels={backend} needs a CUDA GPU (none here); "
                                    "use dsa_kernels=torch (or auto) on CPU")
        if backend == "tilelang" and capability < (9, 0):
            raise KernelUnavailable(f"dsa_kernels=tilelang needs compute capability >= 9.0, "
                                    f"got {capability}; use dsa_kernels=triton or torch")
        if backend == "tilelang" and importlib.util.find_spec("tilelang") is None:
            raise KernelUnavailable(f"dsa_kernels=tilelang needs the tilelang package: "
                                    f"{TILELANG_EXTRA}")
    error = (_tilelang_shapes_error if backend == "tilelang" else _triton_shapes_error)(shapes)
    if error is not None:
        raise KernelUnavailable(f"dsa_kernels={backend} needs {error}")


RangeTopK = Callable[..., Tensor]
"""``(q [t, h, d], keys [n, d], weights [t, h], lo [t], hi [t], *, topk, relu) -> int64 [t, topk]``:
:func:`kpool_layers.dsa.topk.chunked_range_topk`'s contract (ascending key indices, then -1 for the
empty slots)."""


def _torch_topk(chunk_size: int) -> RangeTopK:
    return partial(chunked_range_topk, chunk_size=chunk_size)


def _tilelang_topk(chunk_size: int) -> RangeTopK:
    from kpool_layers.kernels.tilelang_dsa import range_topk_tilelang

    return partial(range_topk_tilelang, chunk_size=chunk_size)


def _triton_topk(chunk_size: int) -> RangeTopK:
    from kpool_layers.kernels.indexer_topk_triton import range_topk_triton

    return range_topk_triton


DSA = register(Route("dsa", (
    KernelBackend("triton", lambda: _triton_topk, "our Triton sparse MLA + indexer top-k (deterministic)",
                  declines=(needs_cuda,), auto_declines=(needs_capability(9, 0),)),
    KernelBackend("tilelang", lambda: _tilelang_topk, "megatron-core's TileLang SparseMLA + indexer top-k",
                  declines=(needs_cuda,), automatic=False),
    KernelBackend("torch", lambda: _torch_topk, "chunked PyTorch sparse MLA + indexer top-k"),
), summary="DSA sparse MLA core attention and indexer scores + top-k", config_key="model.dsa_kernels"))
"""The ``dsa_kernels`` route: each backend's ``load`` gives its top-k factory ``(chunk_size) ->
RangeTopK``; its core attention class is ``kpool_layers.dsa.core_attention.CORE_ATTENTION[name]``.
The full checks of a choice (package, capability, shapes, determinism) are :func:`check_backend`'s,
run by the config rules before the build."""


def range_topk_kernel(backend: str, chunk_size: int) -> RangeTopK:
    """The indexer's scores + top-k for resolved ``backend``; ``chunk_size`` queries at a time where
    the backend works in query chunks (torch, tilelang)."""
    if backend not in DSA.names:
        raise KernelUnavailable(f"dsa_kernels={backend!r}; allowed here: torch, tilelang, triton "
                                "(resolve 'auto' first)")
    return DSA.backend(backend).load()(chunk_size)
