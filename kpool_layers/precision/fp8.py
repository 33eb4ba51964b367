"""FP8 (e4m3) quantization numerics as pure torch functions: scales, tile/block quantization for
the training recipes, and the serving engines' KPool index path.

Every function works on any device (``torch.float8_e4m3fn`` casts run on CPU), so the emulation is
bit-exact on CPU and GPU alike.

Numerics, step by step, with sources
------------------------------------
1. **Scale** of a group of values with absolute maximum ``amax`` (:func:`compute_scale`)::

       a = max(amax, 1e-4)                        # guard all-zero groups
       ue8m0: s = 2 ** ceil(log2(a / 448))        # power-of-two scale (8-bit exponent, no mantissa)
       amax:  s = a / 448                         # plain FP32 scale

   Sources: DeepSeek-V3.2-Exp ``inference/kernel.py`` ``act_quant`` (``amax`` clamped to 1e-4;
   ``scale_fmt="ue8m0"`` rounds the scale up to a power of two); DeepGEMM
   ``per_token_cast_to_fp8`` / ``ceil_to_ue8m0``; vLLM/SGLang ``indexer_k_quant_and_cache``
   (``quant_block_size=128``, ``scale_fmt="ue8m0"``). Rounding the scale *up* guarantees
   ``amax / s <= 448``.
2. **Cast** (:func:`cast_e4m3`): ``q = e4m3(clamp(x / s, -448, 448))`` computed in FP32, round to
   nearest even (torch's ``float8_e4m3fn`` conversion). ``float8_e4m3fn`` has no infinity and
   the conversion of out-of-range values has differed across torch releases and devices (NaN in
   older ones, saturation in torch 2.14 on CPU), so the explicit clamp (as in DeepGEMM and the
   DeepSeek kernels) makes the result independent of them; with an ``amax`` scale ``x / s`` can
   land just above 448.
3. **Dequantize**: ``x' = float32(q) * s``.
4. **Training recipes** (:func:`quantize` with ``operand``):

   ============ =========================== =====================================
   recipe       activation ``x [..., K]``    weight ``w [N, K]``
   ============ =========================== =====================================
   blockwise    1x128 tiles along K          128x128 blocks
   rowwise      one scale per row (over K)   one scale per output row (over K)
   tensorwise   one scale for the tensor     one scale for the tensor
   ============ =========================== =====================================

   Blockwise is DeepSeek-V3's recipe (DeepSeek-V3 technical report, section 3.3.2 "fine-grained
   quantization"; Transformer Engine ``Float8BlockScaling``: FP32 scale per 1x128 tile / 128x128
   block, e4m3 for everything). Tensorwise is Transformer Engine ``Float8CurrentScaling``
   (current amax, no history); rowwise is torch ``_scaled_mm``'s RowWise scaling. Partial
   tiles at the edges use the amax of their own elements (zero padding never raises amax).
5. **Serving KPool index path** (:func:`serving_index_quant`): for each 128-channel vector (pooled
   key or one index-query head)::

       v = bf16(x)
       v = bf16(float32(v) @ H_128 * 128 ** -0.5)     # Hadamard in FP32, rounded to BF16
       v = dequant(e4m3(v / s)) with s from step 1 over the 128 channels (ue8m0 default)

   Sources: DeepSeek-V3.2-Exp ``inference/model.py`` ``Indexer.forward`` (``rotate_activation``
   then ``act_quant(.., block_size=128, scale_fmt)`` for q and k, ``fp8_index`` scoring); the
   GLM-5.x KPool index path in SGLang/vLLM (the pooled key goes through the same rotation and
   per-128 quantization before the index cache) and the matching upstream Megatron-LM KPool
   change. :func:`serving_index_scores` then computes
   ``sum_h w[q, h] * relu(q'[q, h] . k'[k])`` in FP32; the kernels compute
   ``relu(q_fp8 . k_fp8) * (w * s_q) * s_k`` instead, which is equal up to summation order
   (exactly so per product when the scales are powers of two).

   On CUDA tensors that need no gradient (fp32 / bf16 / fp16) the whole path is one Triton kernel
   (:mod:`kpool_layers.kernels.serving_quant_triton`, the same bits; the kernel route
   :data:`SERVING_QUANT`) instead of about 18 aten ops and the Hadamard kernel; elsewhere the torch code of :func:`serving_index_quant` runs, which is
   the reference the kernel is tested against (``tests/test_serving_quant_triton.py``).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from kpool_layers.kernel_routes import KernelBackend, Route, needs_cuda, needs_package, register

from kpool_layers.precision.fp8_format import (AMAX_EPS, BLOCK, E4M3_MAX, SCALE_FORMATS, Operand, Recipe,
                                                ScaleFormat, tile_shape)
from kpool_layers.precision.hadamard import hadamard_transform


def compute_scale(amax: torch.Tensor, scale_format: ScaleFormat = "ue8m0") -> torch.Tensor:
    """Dequantization scale(s) for groups with absolute maxima ``amax`` (any shape) -> FP32, same
    shape. ``ue8m0``: ``2 ** ceil(log2(max(amax, 1e-4) / 448))``; ``amax``: ``max(amax, 1e-4) / 448``."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format={scale_format!r} is not supported; allowed: {list(SCALE_FORMATS)}")
    # A tensor divisor keeps the division IEEE-exact on CUDA too (torch multiplies by the
    # reciprocal of a Python-scalar divisor there), so CPU, CUDA and the fused kernel agree bit for bit.
    ratio = amax.float().clamp(min=AMAX_EPS) / torch.full((), E4M3_MAX, device=amax.device)
    if scale_format == "amax":
        return ratio
    return torch.exp2(torch.ceil(torch.log2(ratio)))


def cast_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn(clamp(x / scale, -448, 448))`` computed in FP32; ``scale`` broadcasts to ``x``."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _tiled(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """``x [M, K]`` zero-padded and viewed as ``[M / tr, tr, K / tc, tc]`` (ceil divisions)."""
    tr, tc = tile
    m, k = x.shape
    pm, pk = -m % tr, -k % tc
    if pm or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pm))
    return x.view((m + pm) // tr, tr, (k + pk) // tc, tc)


def quantize(
    x: torch.Tensor, recipe: Recipe, operand: Operand, scale_format: ScaleFormat = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to e4m3 under a training recipe.

    ``x`` is ``[..., K]`` for ``operand="activation"`` (leading dims flattened into rows M) and
    ``[N, K]`` for ``operand="weight"``. Returns ``(q, scale)``: ``q`` float8_e4m3fn with ``x``'s
    shape and ``scale`` FP32 ``[ceil(M / tr), ceil(K / tc)]`` for tiles ``tr x tc``:
    blockwise 1x128 (activation) / 128x128 (weight), rowwise 1xK, tensorwise MxK (scale ``[1, 1]``).
    """
    if operand == "weight" and x.dim() != 2:
        raise ValueError(f"weight operand must be 2-D [N, K], got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    tile = tile_shape(recipe, operand, rows, k)
    if x.numel() == 0:  # no rows or no columns (an empty micro batch's transpose): no tiles
        grid = (-(-rows // tile[0]), -(-k // tile[1]))
        return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device), x.new_ones(grid, dtype=torch.float32)
    x2 = x.reshape(rows, k)
    tiles = _tiled(x2.float(), tile)
    scale = compute_scale(tiles.abs().amax(dim=(1, 3)), scale_format)
    q = cast_e4m3(tiles, scale[:, None, :, None])
    q = q.view(tiles.shape[0] * tile[0], tiles.shape[2] * tile[1])[: x2.shape[0], :k]
    return q.reshape(x.shape), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, recipe: Recipe, operand: Operand, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``float32(q) * scale`` per tile (FP32), rounded once to
    ``out_dtype`` -> ``q``'s shape. The fused kernel
    (:mod:`kpool_layers.kernels.fp8_dequant_triton`) returns the same bits."""
    k = q.shape[-1]
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=out_dtype, device=q.device)
    q2 = q.reshape(-1, k)
    tile = tile_shape(recipe, operand, q2.shape[0], k)
    tiles = _tiled(q2.float(), tile) * scale[:, None, :, None]
    out = tiles.view(tiles.shape[0] * tile[0], tiles.shape[2] * tile[1])[: q2.shape[0], :k]
    return out.to(out_dtype).reshape(q.shape)


def emulate(
    x: torch.Tensor, recipe: Recipe, operand: Operand, scale_format: ScaleFormat = "ue8m0"
) -> torch.Tensor:
    """Quantize-dequantize ``x`` under a training recipe; FP32 result with ``x``'s shape."""
    q, scale = quantize(x, recipe, operand, scale_format)
    return dequantize(q, scale, recipe, operand)


def quantize_vectors(
    x: torch.Tensor, scale_format: ScaleFormat = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 128-channel vector: ``x [..., 128 * j]`` -> ``(q float8 [..., 128 * j],
    scale fp32 [..., j])``; the indexer cache layout (one scale per 128 channels of a token)."""
    if x.shape[-1] % BLOCK != 0:
        raise ValueError(f"last dim must be a multiple of {BLOCK}, got {x.shape[-1]}")
    groups = x.float().unflatten(-1, (-1, BLOCK))
    scale = compute_scale(groups.abs().amax(dim=-1), scale_format)
    return cast_e4m3(groups, scale[..., None]).flatten(-2), scale


def _serving_triton() -> ModuleType:
    from kpool_layers.kernels import serving_quant_triton

    return serving_quant_triton


SERVING_QUANT = register(Route("serving_quant", (
    KernelBackend("triton", _serving_triton, "one Triton kernel: BF16, Hadamard, e4m3 per vector (no gradient)",
                  declines=(needs_cuda, needs_package("triton"))),
    KernelBackend("torch", lambda: None, "the torch code of serving_index_quant (about 18 aten ops)"),
), summary="serving KPool index q/k quantization (Hadamard + e4m3 per 128 channels)"))
"""``serving_quant``: the Triton kernel module (``supports`` / ``serving_index_quant_triton``
looked up per call, for CUDA tensors without a gradient) or the torch code below."""


def serving_index_quant(x: torch.Tensor, scale_format: ScaleFormat = "ue8m0") -> torch.Tensor:
    """The serving engines' index q/k path for ``x [..., d]`` (pooled keys, or index-query heads):
    BF16 -> Hadamard (FP32, scale d**-0.5) -> BF16 -> e4m3 with one scale per d-vector.
    Returns the dequantized values ``[..., d]``: BF16 for ``ue8m0`` scales (exact: an e4m3 value,
    4 significant bits, times a power of two fits BF16's 8 bits and FP32's exponent range; halves
    the bytes and keeps the fused top-k kernels on BF16 tensor cores), FP32 for ``amax`` scales.

    Served GLM-5.x models have ``d = 128`` (the index cache's quantization block). Smaller
    power-of-two ``d`` (CPU test models) run the same steps over their ``d`` channels."""
    d = x.shape[-1]
    if d > BLOCK or d < 1 or d & (d - 1):
        raise ValueError(
            f"serving_index_quant needs a power-of-two channel count <= {BLOCK} "
            f"({BLOCK} on served models), got {d}"
        )
    route = SERVING_QUANT.default()
    if route.backend == "triton" and x.is_cuda and not x.requires_grad and route.kernel.supports(x):
        return route.kernel.serving_index_quant_triton(x, scale_format)
    v = x.to(torch.bfloat16).float()
    v = hadamard_transform(v, d**-0.5).to(torch.bfloat16)
    scale = compute_scale(v.float().abs().amax(dim=-1, keepdim=True), scale_format)
    dequantized = cast_e4m3(v, scale).float() * scale
    return dequantized.to(torch.bfloat16) if scale_format == "ue8m0" else dequantized


def serving_index_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    relu: bool = True,
    scale_format: ScaleFormat = "ue8m0",
) -> torch.Tensor:
    """Index scores as served: ``q [sq, h, d]``, ``k [sk, d]`` (pooled keys, d = 128 served), ``weights
    [sq, h]`` (the FP32 weights-projection output, already including any head/softmax scaling)
    -> FP32 ``[sq, sk]`` = ``sum_h weights[:, h] * act(q'[:, h] . k')`` with ``q' k'`` from
    :func:`serving_index_quant` and ``act`` = ReLU (or identity when ``relu=False``). No masking."""
    if q.dim() != 3 or k.dim() != 2 or weights.shape != q.shape[:2]:
        raise ValueError(
            f"expected q [sq, h, d], k [sk, d], weights [sq, h]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(weights.shape)}"
        )
    qd = serving_index_quant(q, scale_format).float()
    kd = serving_index_quant(k, scale_format).float()
    logits = torch.einsum("qhd,kd->qhk", qd, kd)
    if relu:
        logits = logits.relu()
    return torch.einsum("qhk,qh->qk", logits, weights.float())

