"""The routed tokens' permutation into expert-major rows and its inverse, both directions without
atomics: every sum over a token's ``K`` expert rows runs in one fixed order (``k`` ascending, FP32,
rounded once to the rows' dtype).

megatron-core 0.19.2 permutes with ``index_select`` (whose backward is ``index_add`` into zeros)
and combines with ``scatter_add`` into zeros (``index_add`` under deterministic algorithms): both add
a token's ``K`` rows in the tokens' dtype (BF16 roundings after every addition) with atomics, whose
order, and with ``K > 2`` the result's bits, changes from run to run. With dropless top-``K``
routing every token owns exactly ``K`` rows, so each of these sums is a gather instead:

* :func:`expert_order`: ``routing_map [T, E]`` -> :class:`Permutation`: ``row_tokens [T * K]`` (the
  token of every row: rows grouped by expert, experts ascending, tokens ascending within one -
  megatron's order) and ``token_rows [T, K]`` (the rows of every token, ascending; the inverse);
* :func:`permute_rows`: ``x [T, H]`` -> ``x[row_tokens]`` ``[T * K, H]``; backward ``d x[t] = sum_k
  g[token_rows[t, k]]``;
* :func:`combine_rows`: ``y [T * K, H]`` -> ``out[t] = sum_k y[token_rows[t, k]]`` ``[T, H]``;
  backward ``d y = g[row_tokens]``.

The sums run in :func:`row_sum`: the kernel route :data:`ROW_SUM` (``triton``,
:mod:`kpool_layers.kernels.row_sum_triton`, on CUDA; else :func:`torch_row_sum`, the same additions
in the same order, bit for bit). Neither synchronises with the host, so both run inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kpool_layers.kernel_routes import KernelBackend, Route, needs_cuda, needs_package, register


@dataclass(frozen=True)
class Permutation:
    """A dropless top-``K`` routing's expert-major row order (module docstring): ``row_tokens [T *
    K]`` int64, ``token_rows [T, K]`` int64, ``flat [T * K]`` int64 (every row's entry ``e * T + t``
    of the transposed routing map, to gather per-row values such as the probabilities)."""

    row_tokens: torch.Tensor
    token_rows: torch.Tensor
    flat: torch.Tensor


def expert_order(routing_map: torch.Tensor, topk: int) -> Permutation:
    """``routing_map [T, E]`` bool with exactly ``topk`` experts per token -> its
    :class:`Permutation` (rows by expert, tokens ascending within an expert; each token's rows
    ascending). Two stable sorts, no host synchronisation."""
    t = routing_map.shape[0]
    flat = routing_map.t().reshape(-1).argsort(descending=True, stable=True)[: t * topk]
    row_tokens = flat % t
    token_rows = row_tokens.argsort(stable=True).view(t, topk)
    return Permutation(row_tokens=row_tokens, token_rows=token_rows, flat=flat)


def torch_row_sum(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows [R, H]``, ``index [T, K]`` -> ``[T, H]``: ``sum_k rows[index[:, k]]`` in FP32 (FP64
    rows: in FP64), ``k`` ascending, rounded once to ``rows``' dtype (the order
    :mod:`kpool_layers.kernels.row_sum_triton` adds in)."""
    acc = rows.index_select(0, index[:, 0]).to(torch.promote_types(rows.dtype, torch.float32))
    for k in range(1, index.shape[1]):
        acc += rows.index_select(0, index[:, k])
    return acc.to(rows.dtype)


def _triton_row_sum() -> ModuleType:
    from kpool_layers.kernels import row_sum_triton

    return row_sum_triton


ROW_SUM = register(Route("moe_row_sum", (
    KernelBackend("triton", _triton_row_sum, "one Triton kernel per sum (gather, FP32 in a fixed order)",
                  declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: None, "index_select and FP32 adds, the same order"),
), summary="the routed experts' combine and the backward of their permutation"))
"""``moe_row_sum``: where :func:`row_sum` runs on CUDA tensors."""


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Row dtypes the Triton kernel sums (others take :func:`torch_row_sum`)."""


def row_sum(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """:func:`torch_row_sum`'s result, by the Triton kernel for CUDA tensors of :data:`KERNEL_DTYPES`
    where :data:`ROW_SUM` resolved to ``triton``."""
    if rows.is_cuda and rows.dtype in KERNEL_DTYPES and ROW_SUM.default().backend == "triton":
        return ROW_SUM.default().kernel.gather_row_sum(rows, index)
    return torch_row_sum(rows, index)


class _PermuteRows(torch.autograd.Function):
    """``x [T, H]`` -> ``x[row_tokens]``; backward the fixed-order sum over ``token_rows``."""

    @staticmethod
    def forward(ctx, x, row_tokens, token_rows):  # noqa: ANN001, ANN205
        ctx.save_for_backward(token_rows)
        return x.index_select(0, row_tokens)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (token_rows,) = ctx.saved_tensors
        return row_sum(grad, token_rows), None, None


class _CombineRows(torch.autograd.Function):
    """``y [T * K, H]`` -> fixed-order sums over ``token_rows``; backward ``g[row_tokens]``."""

    @staticmethod
    def forward(ctx, y, row_tokens, token_rows):  # noqa: ANN001, ANN205
        ctx.save_for_backward(row_tokens)
        return row_sum(y, token_rows)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (row_tokens,) = ctx.saved_tensors
        return grad.index_select(0, row_tokens), None, None


def permute_rows(x: torch.Tensor, order: Permutation) -> torch.Tensor:
    """``x [T, H]`` -> expert-major rows ``[T * K, H]`` (module docstring)."""
    return _PermuteRows.apply(x, order.row_tokens, order.token_rows)


def combine_rows(y: torch.Tensor, order: Permutation) -> torch.Tensor:
    """Expert-major rows ``y [T * K, H]`` -> ``[T, H]``, each token's rows summed (module docstring)."""
    return _CombineRows.apply(y, order.row_tokens, order.token_rows)
