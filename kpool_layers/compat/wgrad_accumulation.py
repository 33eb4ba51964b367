"""Weight gradients accumulated straight into megatron's ``main_grad``: megatron-core's
gradient-accumulation fusion without apex.

Under megatron's DDP every parameter has a ``main_grad`` (a view of the fp32 gradient buffer).
Without gradient-accumulation fusion a linear's backward writes its weight gradient into a fresh
``weight.grad`` in the parameter dtype (bf16) and DDP's hook adds it into ``main_grad``: one more
kernel and one more pass over the gradient per weight per micro-batch. With
``TransformerConfig.gradient_accumulation_fusion`` megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` backward instead calls apex's ``fused_weight_gradient_mlp_cuda`` to
compute ``main_grad += grad_output^T @ input`` in one GEMM (fp32 accumulation, beta = 1) and
hands DDP a placeholder gradient; megatron refuses the flag when that apex extension is missing.

:func:`install` gives megatron this module's two functions under apex's name, where apex is not
installed (process-wide, idempotent; the kernel route :data:`WGRAD`: ``apex`` where megatron found
its extension, else ``kpool``), so the flag works with or without apex:

* :func:`wgrad_gemm_accum_fp32` - ``main_grad`` fp32 (:func:`~kpool_layers.kernels.accumulate.accumulate_matmul`):
  one cuBLAS ``addmm`` with fp32 output from bf16/fp16 operands on CUDA (the product is never
  rounded to bf16, as with apex; the unfused path rounds it once), exact fp32 products added into
  ``main_grad`` elsewhere (bit-identical to the unfused path for fp32 weights).
* :func:`wgrad_gemm_accum_fp16` - ``main_grad`` in bf16/fp16: ``addmm`` in that dtype.

``to_transformer_config(cfg, ddp=True)`` (the trainer) turns the flag on; models used without
megatron's DDP (no ``main_grad``) keep it off. The role linears that compute their own GEMM (FP8,
:class:`kpool_layers.precision.policy.LinearNumerics`) follow the same flag through
:func:`accumulate_into_main_grad`, megatron's protocol with DDP's hook.

Layouts: ``total_input [tokens, in_features]``, ``grad_output [tokens, out_features]`` (2-D, as
megatron's ``prepare_input_tensors_for_wgrad_compute`` makes them), ``main_grad
[out_features, in_features]``.
"""

from __future__ import annotations

import types
from typing import Optional

import megatron.core.tensor_parallel.layers as megatron_layers
import torch

from kpool_layers.kernel_routes import KernelBackend, Machine, Route, register
from kpool_layers.kernels.accumulate import accumulate_matmul


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` into an fp32 ``main_grad`` (module docstring)."""
    accumulate_matmul(main_grad, grad_output.t(), total_input)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` in ``main_grad``'s 16-bit dtype."""
    torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)


FUSED_WGRAD = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                                    wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)
"""This module's stand-in for apex's ``fused_weight_gradient_mlp_cuda`` extension."""


def _needs_apex(machine: Machine) -> Optional[str]:
    """Declines unless megatron imported apex's extension (not this module's stand-in)."""
    found = getattr(megatron_layers, "fused_weight_gradient_mlp_cuda", None)
    if megatron_layers._grad_accum_fusion_available and found not in (None, FUSED_WGRAD):
        return None
    return "apex's fused_weight_gradient_mlp_cuda extension not installed"


WGRAD = register(Route("wgrad", (
    KernelBackend("apex", lambda: megatron_layers.fused_weight_gradient_mlp_cuda,
                  "apex's fused_weight_gradient_mlp_cuda", declines=(_needs_apex,)),
    KernelBackend("kpool", lambda: FUSED_WGRAD, "this module's addmm into main_grad (accumulate_matmul)"),
), summary="megatron's gradient-accumulation fusion (main_grad += dy^T x)"))
"""``wgrad``: the extension megatron's linears call; resolved at every :func:`install` (apex may
appear in between, as it does in tests)."""


def install() -> None:
    """Give megatron's linears :data:`FUSED_WGRAD` where apex's extension is missing (idempotent;
    apex's is kept where installed)."""
    if WGRAD.resolve().backend == "kpool":
        megatron_layers.fused_weight_gradient_mlp_cuda = FUSED_WGRAD
        megatron_layers._grad_accum_fusion_available = True


def accumulate_into_main_grad(weight: torch.Tensor, total_input: torch.Tensor,
                              grad_output: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad += grad_output^T @ total_input`` as megatron's fused linears do it (an
    fp32 ``main_grad`` through :func:`wgrad_gemm_accum_fp32`, a 16-bit one in its dtype), marked
    ``grad_added_to_main_grad`` so that DDP's hook does not add again. Returns the placeholder
    gradient those linears hand autograd (uninitialised, ``weight``'s shape and dtype; DDP's hook
    drops it, and its arrival is what marks the weight's gradient ready)."""
    fused = wgrad_gemm_accum_fp32 if weight.main_grad.dtype == torch.float32 else wgrad_gemm_accum_fp16
    fused(total_input, grad_output, weight.main_grad)
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


def add_into_main_grad(weight: torch.Tensor, grad_weight: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad += grad_weight`` for a weight gradient already computed by its own GEMM
    (the FP8 wgrad, ``[out_features, in_features]``), added in ``main_grad``'s dtype and marked
    as :func:`accumulate_into_main_grad` does; returns the same placeholder gradient."""
    weight.main_grad.add_(grad_weight)
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)
