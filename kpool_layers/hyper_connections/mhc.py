"""mHC (manifold-constrained hyper-connections): GLM-5.3's residual streams (transformers'
``Glm5NextTextHyperConnection`` and ``Glm5NextTextHyperHead``, same math and order of operations).

The residual is ``N = hc_mult`` streams ``[..., N, h]`` (megatron's ``[s, b, N, h]``; any leading
token dims). Around each attention or MLP block ``F``::

    x     = streams flattened to [..., N h], float32, x * rsqrt(mean(x^2) + eps_norm)
    z     = x @ fn^T                                  [..., (2 + N) N]  (float32)
    pre   = sigmoid(scale_0 z_pre + base_pre) + hc_eps                   [..., N]
    post  = 2 sigmoid(scale_1 z_post + base_post)                        [..., N]
    comb  = Sinkhorn(softmax_rows(scale_2 z_comb + base_comb) + hc_eps)  [..., N, N]
    block input   = sum_n pre_n streams_n                                [..., h]
    new streams   = post (x) F(block input) + comb^T @ streams           [..., N, h]

Sinkhorn, in float32: normalise the columns, then ``hc_sinkhorn_iters - 1`` times the rows and
the columns (each division by ``sum + hc_eps``): ``comb`` is doubly stochastic up to the
iteration's convergence. The gates, ``z`` to ``pre``, ``post`` and ``comb`` (:func:`gates`), take the
kernel route :data:`GATES`: one Triton kernel forward and two backward on CUDA
(:mod:`kpool_layers.kernels.mhc_gates_triton`; ``N <= 8``), else :func:`torch_gates`, the torch ops
transformers runs (``6 hc_sinkhorn_iters + 12`` kernels forward, about twice that backward, per
block). The embeddings enter as ``N`` copies (:func:`expand_streams`); the last
layer's streams are collapsed by their unweighted mean (:func:`collapse_streams`) before the
final norm.

Parameters: ``fn [(2 + N) N, N h]``, ``base [(2 + N) N]`` and ``scale [3]``, in the model dtype,
used in float32 (transformers holds ``base``/``scale`` in float32). They act per token, so they are replicated over TP; under sequence
parallelism each TP rank sees other tokens, so they are tagged ``sequence_parallel`` and megatron's
``finalize_model_grads`` sums their gradients over the TP group.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from kpool_layers.config import GLMTransformerConfig
from kpool_layers.kernel_routes import KernelBackend, Route, needs_cuda, needs_package, register
from kpool_layers.precision.policy import LinearNumerics, Role


def expand_streams(hidden: Tensor, hc_mult: int) -> Tensor:
    """``[..., h]`` -> ``[..., N, h]``: ``N`` copies of the embeddings (contiguous)."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], hc_mult, hidden.shape[-1]).contiguous()


def collapse_streams(streams: Tensor) -> Tensor:
    """``[..., N, h]`` -> ``[..., h]``: the unweighted mean of the streams."""
    return streams.mean(dim=-2)


def torch_mix_streams(post: Tensor, comb: Tensor, block_output: Tensor, streams: Tensor) -> Tensor:
    """The streams after a block in torch ops (transformers' order): ``post (x) block_output +
    comb^T @ streams`` in the streams' dtype; ``post [..., N]``, ``comb [..., N, N]``,
    ``block_output [..., h]``, ``streams [..., N, h]`` -> ``[..., N, h]``."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams)


def _mix_triton() -> ModuleType:
    from kpool_layers.kernels import mhc_mix_triton

    return mhc_mix_triton


STREAM_MIX = register(Route("mhc_stream_mix", (
    KernelBackend("triton", _mix_triton, "post (x) block output + comb^T @ streams in one Triton kernel forward, "
                  "one backward (BF16/FP32 streams, N <= 8)", declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: torch_mix_streams, "torch ops: a broadcast multiply, a batched matmul, an add"),
), summary="mHC stream mixing after a block"))
"""``mhc_stream_mix``: the Triton kernel module (its ``supports`` and ``mix_streams`` looked up per
call) or :func:`torch_mix_streams`."""


def mix_streams(post: Tensor, comb: Tensor, block_output: Tensor, streams: Tensor) -> Tensor:
    """The streams after a block, ``post (x) block_output + comb^T @ streams`` (shapes and dtype as
    :func:`torch_mix_streams`), through :data:`STREAM_MIX`: the same roundings to the streams' dtype
    on either route, FP32 sums in another order on the kernel
    (:mod:`kpool_layers.kernels.mhc_mix_triton`); tensors the kernel does not take run the torch ops."""
    route = STREAM_MIX.default()
    if route.backend == "triton" and route.kernel.supports(post, comb, block_output, streams):
        return route.kernel.mix_streams(post, comb, block_output, streams)
    return torch_mix_streams(post, comb, block_output, streams)


def torch_norm_project(streams: Tensor, fn: Tensor, eps: float) -> Tensor:
    """``z [..., (2 + N) N]`` FP32 in torch ops (transformers' order): the streams ``[..., N, h]``
    flattened to FP32, ``x * rsqrt(mean(x^2) + eps)``, then ``x @ fn^T`` in FP32."""
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return torch.nn.functional.linear(flat, fn.float())


def torch_pre_sum(pre: Tensor, streams: Tensor) -> Tensor:
    """``sum_n pre_n streams_n`` in torch ops: FP32 products and sum, rounded to the streams'
    dtype; ``pre [..., N]`` FP32, ``streams [..., N, h]`` -> ``[..., h]``."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def _pre_triton() -> ModuleType:
    from kpool_layers.kernels import mhc_pre_triton

    return mhc_pre_triton


NORM_PROJECT = register(Route("mhc_norm_proj", (
    KernelBackend("triton", _pre_triton, "stream RMS norm + FP32 projection in one Triton kernel forward, two "
                  "backward (BF16/FP32 streams, N <= 8)", declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: torch_norm_project, "torch ops: an FP32 copy, four norm passes, an FP32 matmul"),
), summary="mHC stream norm and projection before a block"))
"""``mhc_norm_proj``: the Triton kernel module (its ``supports_norm_project`` and ``norm_project``
looked up per call) or :func:`torch_norm_project`."""

PRE_SUM = register(Route("mhc_pre_sum", (
    KernelBackend("triton", _pre_triton, "pre-weighted stream sum in one Triton kernel forward, one backward "
                  "(BF16/FP32 streams, N <= 8)", declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: torch_pre_sum, "torch ops: an FP32 broadcast product, a sum, a cast"),
), summary="mHC block input (pre-weighted stream sum)"))
"""``mhc_pre_sum``: the Triton kernel module (its ``supports_pre_sum`` and ``pre_sum`` looked up per
call) or :func:`torch_pre_sum`."""


def norm_project(streams: Tensor, fn: Tensor, eps: float) -> Tensor:
    """``z`` of :func:`torch_norm_project` through :data:`NORM_PROJECT`: FP32 products in another
    order on the kernel (:mod:`kpool_layers.kernels.mhc_pre_triton`); tensors the kernel does not
    take run the torch ops."""
    route = NORM_PROJECT.default()
    if route.backend == "triton" and route.kernel.supports_norm_project(streams, fn):
        return route.kernel.norm_project(streams, fn, eps)
    return torch_norm_project(streams, fn, eps)


def pre_sum(pre: Tensor, streams: Tensor) -> Tensor:
    """The block input ``sum_n pre_n streams_n`` of :func:`torch_pre_sum` through :data:`PRE_SUM`
    (the same rounding; FP32 sums in another order on the kernel)."""
    route = PRE_SUM.default()
    if route.backend == "triton" and route.kernel.supports_pre_sum(pre, streams):
        return route.kernel.pre_sum(pre, streams)
    return torch_pre_sum(pre, streams)


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """Columns normalised, then ``iters - 1`` row and column normalisations of ``[..., N, N]``
    (each a division by ``sum + eps``)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def torch_mixing_matrix(logits: Tensor, iters: int, eps: float) -> Tensor:
    """``comb [..., N, N]``: :func:`sinkhorn` of ``softmax(logits, rows) + eps`` in torch ops
    (transformers' order of operations), for ``logits [..., N, N]``."""
    return sinkhorn(torch.softmax(logits, dim=-1) + eps, iters, eps)


def torch_gates(z: Tensor, base: Tensor, scale: Tensor, n: int, iters: int,
                eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(pre [..., n], post [..., n], comb [..., n, n])`` FP32 from the projection ``z [..., (2 + n)
    n]`` in torch ops (transformers' order): ``y = z * scale[group] + base`` per column group
    ``[pre | post | comb]``, ``pre = sigmoid(y_pre) + eps``, ``post = 2 sigmoid(y_post)``, ``comb =``
    :func:`torch_mixing_matrix` of ``y_comb``; ``base [(2 + n) n]``, ``scale [3]`` used in FP32."""
    pre_w, post_w, comb_w = z.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.float().unbind(0)
    comb_w = comb_w.view(*comb_w.shape[:-1], n, n)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    return pre, post, torch_mixing_matrix(comb_w * comb_scale + comb_b.view(n, n), iters, eps)


def _triton() -> ModuleType:
    from kpool_layers.kernels import mhc_gates_triton

    return mhc_gates_triton


GATES = register(Route("mhc_gates", (
    KernelBackend("triton", _triton, "the gates' affine maps, sigmoids, row softmax and Sinkhorn in one Triton "
                  "kernel forward, two backward (FP32, N <= 8)", declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: torch_gates, "torch ops: an affine map and a sigmoid per gate, softmax, then "
                  "2 iters - 1 normalisations of 3 ops"),
), summary="mHC gates (pre, post, and the mixing matrix by row softmax + Sinkhorn)"))
"""``mhc_gates``: the Triton kernel module (its ``supports`` and ``gates`` looked up per call) or
:func:`torch_gates`."""


def gates(z: Tensor, base: Tensor, scale: Tensor, n: int, iters: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(pre, post, comb)`` of :func:`torch_gates` through :data:`GATES` (FP32 sums in another order
    on the kernel, :mod:`kpool_layers.kernels.mhc_gates_triton`); tensors the kernel does not take run
    the torch ops."""
    route = GATES.default()
    if route.backend == "triton" and route.kernel.supports(z, base, scale, n):
        return route.kernel.gates(z, base, scale, n, iters, eps)
    return torch_gates(z, base, scale, n, iters, eps)


class HyperConnection(MegatronModule):
    """One block's mHC weights (module docstring): ``forward(streams [..., N, h])`` ->
    ``(post [..., N] fp32, comb [..., N, N] fp32, block input [..., h] in the streams' dtype)``.

    Reads ``config.hc_mult``, ``hc_sinkhorn_iters`` and ``hc_eps`` (transformers' names); the
    stream norm's epsilon is ``config.layernorm_epsilon`` (transformers' ``rms_norm_eps``). The
    projection ``z = x @ fn^T`` is the precision role ``mhc.proj`` (:attr:`numerics`, from
    ``config.precision``: FP32, never FP8, as transformers computes it); ``base`` and ``scale``
    enter the FP32 arithmetic after it. All three parameters are held in the model dtype like
    every megatron parameter (the mixed-precision optimizer keeps their FP32 master copies):
    trainable FP32 parameters in a BF16 model break megatron-core 0.19.2's distributed-optimizer
    checkpoint (``sharded_param_state_dp_reshardable``). transformers keeps ``base``/``scale`` in
    FP32 (``_keep_in_fp32_modules_strict``), so a BF16 model's values are exactly representable
    there; an FP32 checkpoint's are rounded to BF16 when trained in BF16.
    """

    def __init__(self, config: GLMTransformerConfig, **_: Any) -> None:
        super().__init__(config=config)
        hc_mult, iters = config.hc_mult, config.hc_sinkhorn_iters
        if hc_mult is None or hc_mult < 1:
            raise ValueError(f"hc_mult={hc_mult} is not allowed; allowed: >= 1")
        if iters < 1:
            raise ValueError(f"hc_sinkhorn_iters={iters} is not allowed; allowed: >= 1")
        self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps = hc_mult, iters, config.hc_eps
        self.norm_eps = config.layernorm_epsilon
        self.numerics = LinearNumerics(config.precision, Role.MHC_PROJ)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        width = (2 + hc_mult) * hc_mult
        self.fn = torch.nn.Parameter(torch.empty(width, hc_mult * config.hidden_size,
                                                 dtype=config.params_dtype, device=device))
        self.base = torch.nn.Parameter(torch.zeros(width, dtype=config.params_dtype, device=device))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=config.params_dtype, device=device))
        for param in (self.fn, self.base, self.scale):
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        if config.perform_initialization:  # transformers' init: fn N(0, 0.02), base 0, scale 1
            with torch.no_grad():
                self.fn.normal_(0.0, 0.02)

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        z = norm_project(streams, self.fn, self.norm_eps)  # mhc.proj: FP32 in every profile
        pre, post, comb = gates(z, self.base, self.scale, self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps)
        return post, comb, pre_sum(pre, streams)
