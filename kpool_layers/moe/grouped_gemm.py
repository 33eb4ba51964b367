"""Grouped GEMMs of the routed experts: rows grouped by expert times that expert's weight, in the
model dtype (:func:`grouped_linear`) or as the linear of a precision role (:func:`expert_linear`:
FP8 experts).

Layouts (``E`` experts, ``T`` rows sorted by expert, ``tokens_per_expert [E]`` rows each, in
order; an expert may have none): ``x [T, K]``, ``w [E, N, K]`` (``nn.Linear`` layout per expert)
-> ``[T, N]`` whose rows of expert ``e`` are ``x_e @ w[e].T``.

FP8 (:func:`expert_linear` under a policy that quantizes the role) computes exactly what the
role-tagged per-expert linears of ``SequentialMLP`` compute (:func:`kpool_layers.precision.policy.quantized_matmul`
per expert: both operands e4m3 under ``precision.recipe``, straight-through backward in the input
dtype from the dequantized operands):

* ``torch`` backend on CUDA, ``blockwise`` or ``rowwise``, where the kernel route
  :data:`GROUPED_FP8` resolved to ``triton`` (:mod:`kpool_layers.kernel_routes`): the rows of all
  experts are quantized at once and the stacked weight at once (one fused Triton kernel each,
  :mod:`kpool_layers.kernels.fp8_quant_triton`), then one FP8 grouped GEMM
  (:mod:`kpool_layers.kernels.fp8_grouped_gemm_triton`). Both recipes scale activations per row
  (1x128 tiles along K, or the whole row), so this equals quantizing each expert's rows; blockwise
  weight blocks (128x128) stay inside one expert when ``N`` is a multiple of 128 (otherwise the
  per-expert loop below runs). The backward is ``grouped_mm`` (``torch.nn.functional.grouped_mm``)
  in the input dtype on the operands dequantized straight into it (one fused Triton kernel each,
  :mod:`kpool_layers.kernels.fp8_dequant_triton`);
* otherwise (CPU, the ``emulate`` backend): a loop of the per-expert role GEMM, the very
  computation of ``SequentialMLP``'s linears.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from kpool_layers.compat.device_copy import to_device
from kpool_layers.kernel_routes import KernelBackend, Route, needs_cuda, needs_package, register
from kpool_layers.precision import fp8_format
from kpool_layers.precision.fp8_format import Recipe
from kpool_layers.precision.policy import FP8_DEQUANT, FP8_QUANT, LinearNumerics, PrecisionPolicy, Role
from kpool_layers.precision.weight_cache import derived_weight, quantized_weight

_GROUPED_MM: Callable[..., torch.Tensor] = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
"""``grouped_mm(a [T, K], b [E, K, N], offs=int32 [E]) -> [T, N]`` (public name from torch 2.10)."""

FP8_RECIPES: tuple[Recipe, ...] = (Recipe.blockwise, Recipe.rowwise)
"""``precision.recipe`` values of FP8 grouped experts: activation scales per row, so all experts'
rows quantize at once (tensorwise would need one activation scale per expert)."""


def supports_policy(policy: PrecisionPolicy) -> bool:
    """Whether grouped experts compute the expert roles of ``policy``: unquantized, or FP8 with a
    recipe of :data:`FP8_RECIPES`."""
    quantized = policy.quantized(Role.MOE_EXPERT_FC1) or policy.quantized(Role.MOE_EXPERT_FC2)
    return not quantized or policy.recipe in FP8_RECIPES


def _offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """End row of every expert, int32 on ``device`` (``grouped_mm``'s ``offs``; megatron's
    dispatchers give the counts on the host: copied without a host synchronization)."""
    return to_device(tokens_per_expert, device).to(torch.int32).cumsum(0, dtype=torch.int32)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, kernel: bool) -> torch.Tensor:
    """``x [T, K]``, ``w [E, N, K]`` -> ``[T, N]``, rows of expert ``e`` = ``x_e @ w[e].T``.

    ``kernel``: one ``grouped_mm`` (``w`` passed transposed, column-major, as the kernel accepts;
    row strides of ``x``/``w`` must be multiples of 16 bytes); else a loop over the experts (any
    device and dtype; reads ``tokens_per_expert`` on the host). An expert without tokens
    contributes no rows, and a zero gradient to its weights."""
    if kernel:
        return _GROUPED_MM(x, w.transpose(1, 2), offs=_offsets(tokens_per_expert, x.device))
    counts = tokens_per_expert.tolist()
    return torch.cat([x_e @ w_e.t() for x_e, w_e in zip(torch.split(x, counts), w.unbind(0))])


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, tokens_per_expert: torch.Tensor, kernel: bool) -> torch.Tensor:
    """Weight gradient of :func:`grouped_linear`: ``g [T, N]``, ``x [T, K]`` -> contiguous
    ``[E, N, K]`` (the weight's layout, which autograd keeps as the gradient without a copy) with
    ``[e] = g_e.T @ x_e`` (zero for an expert without rows); ``kernel`` as there."""
    if kernel:  # the 2-D x 2-D grouped_mm over the token groups: g.T [N, T] column-major, x [T, K]
        return _GROUPED_MM(g.t(), x, offs=_offsets(tokens_per_expert, x.device))
    counts = tokens_per_expert.tolist()
    return torch.stack([g_e.t() @ x_e for g_e, x_e in zip(torch.split(g, counts), torch.split(x, counts))])


GROUPED_MM = register(Route("grouped_mm", (
    KernelBackend("grouped_mm", lambda: _GROUPED_MM, "torch's grouped_mm, one GEMM over all experts (BF16)",
                  declines=(needs_cuda,)),
    KernelBackend("loop", lambda: None, "a loop of per-expert GEMMs"),
), summary="model-dtype routed-expert GEMMs (forward, and the FP8 experts' backward)"))
"""``grouped_mm``: whether grouped experts may run ``grouped_mm`` (each call still needs a CUDA
BF16 input with 16-byte aligned rows, ``GroupedExperts._kernel``) or loop over the experts."""


def _grouped_triton() -> ModuleType:
    from kpool_layers.kernels import fp8_grouped_gemm_triton

    return fp8_grouped_gemm_triton


GROUPED_FP8 = register(Route("grouped_gemm", (
    KernelBackend("triton", _grouped_triton, "one FP8 grouped GEMM over all experts (Triton)",
                  declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("loop", lambda: None, "a loop of the per-expert role GEMM (SequentialMLP's computation)"),
), summary="FP8 routed-expert GEMMs (blockwise / rowwise, precision.backend=torch)"))
"""``grouped_gemm``: the Triton FP8 grouped-GEMM module (``grouped_gemm`` looked up per call) or
the per-expert loop of :func:`expert_linear`."""


class _GroupedQuantizedLinear(torch.autograd.Function):
    """:func:`grouped_linear` of e4m3-quantized operands on CUDA (module docstring), the
    ``triton`` backends of :data:`GROUPED_FP8`, ``FP8_QUANT`` and ``FP8_DEQUANT`` (:func:`fused_fp8`
    chose them); backward
    straight-through as :class:`kpool_layers.precision.policy._QuantizedMatmul`: ``dx_e = dy_e @ Q(w_e)``,
    ``dw_e = dy_e.T @ Q(x_e)`` in ``x``'s dtype from the saved e4m3 operands and scales; the stacked
    weight's forms are kept across a step's micro-batches as there
    (:mod:`kpool_layers.precision.weight_cache`)."""

    @staticmethod
    def forward(ctx, x, w, tokens_per_expert, recipe, scale_format, kernel):  # noqa: ANN001, ANN205
        e, n, k = w.shape
        quantize = FP8_QUANT.backend("triton").load().quantize
        xq, xs = quantize(x, recipe, "activation", scale_format)
        qw = quantized_weight(w, recipe, scale_format,
                              lambda: quantize(w.reshape(e * n, k), recipe, "weight", scale_format))
        wq, ws = qw.q, qw.scale
        y = GROUPED_FP8.backend("triton").load().grouped_gemm(xq, xs, wq.view(e, n, k), ws.view(e, -1, ws.shape[-1]),
                                                 tokens_per_expert)
        ctx.save_for_backward(xq, xs, wq, ws)  # freed once the backward ran; the node keeps a weight
        ctx.kept_weight = qw if qw.derived is not None else None  # only for its kept dequantized copy
        ctx.tokens_per_expert, ctx.recipe, ctx.kernel = tokens_per_expert, recipe, kernel
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        xq, xs, wq, ws = ctx.saved_tensors
        dequantize = FP8_DEQUANT.backend("triton").load().dequantize
        g = grad_out.to(ctx.x_dtype).contiguous()
        counts, e = ctx.tokens_per_expert, len(ctx.tokens_per_expert)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_deq = derived_weight(ctx.kept_weight, ctx.x_dtype, lambda: dequantize(
                wq, ws, ctx.recipe, "weight", ctx.x_dtype))
            grad_x = grouped_linear(g, w_deq.view(e, -1, wq.shape[-1]).transpose(1, 2), counts, ctx.kernel)
        if ctx.needs_input_grad[1]:
            x_deq = dequantize(xq, xs, ctx.recipe, "activation", ctx.x_dtype)
            grad_w = grouped_wgrad(g, x_deq, counts, ctx.kernel).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


def fused_fp8(numerics: LinearNumerics, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`expert_linear` runs the FP8 grouped GEMM for ``x [T, K]``, ``w [E, N, K]``
    (module docstring) rather than the per-expert loop."""
    return (numerics.quantized and numerics.backend == "torch" and x.is_cuda
            and GROUPED_FP8.default().backend == "triton" and numerics.policy.recipe in FP8_RECIPES
            and (numerics.policy.recipe != Recipe.blockwise or w.shape[1] % fp8_format.BLOCK == 0))


def expert_linear(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, numerics: LinearNumerics, kernel: bool
) -> torch.Tensor:
    """:func:`grouped_linear` computed as the linear of ``numerics``' role: plain when the role
    keeps the weight's GEMM, else FP8 (module docstring) or the per-expert role GEMM. ``kernel``:
    whether ``grouped_mm`` runs the model-dtype GEMMs (forward, or the FP8 backward)."""
    if not numerics.replaces_gemm(w.dtype):
        return grouped_linear(x, w, tokens_per_expert, kernel)
    if fused_fp8(numerics, x, w):
        dtype = numerics.dtype(w.dtype)
        policy = numerics.policy
        return _GroupedQuantizedLinear.apply(x.to(dtype), w.to(dtype), tokens_per_expert, policy.recipe.value,
                                             policy.scale_format.value, kernel)
    counts = tokens_per_expert.tolist()
    return torch.cat([numerics(x_e, w_e) for x_e, w_e in zip(torch.split(x, counts), w.unbind(0))])
