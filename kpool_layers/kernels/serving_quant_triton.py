"""The serving engines' index q/k path (:func:`kpool_layers.precision.fp8.serving_index_quant`) in one Triton
kernel, with the same bits as the torch reference (about 18 aten ops plus the Hadamard kernel).

``serving_index_quant_triton(x, scale_format)``: ``x [..., d]`` (CUDA, or CPU under
``TRITON_INTERPRET=1``), fp32 / bf16 / fp16, ``d`` a power of two in ``[1, 128]``, any leading shape
(flattened into rows ``M``; a non-contiguous input is copied to a contiguous one first). Returns
``x``'s shape, BF16 for ``ue8m0`` scales and FP32 for ``amax`` scales, as the reference does.

A program loads ``ROWS = max(1, 4096 // d)`` rows as ``[ROWS, d]`` in FP32 (exact widening) and
runs the reference's steps on each row, op by op:

1. ``v = bf16(x)``: round to nearest even (nothing to round for bf16 input);
2. the butterfly of :func:`kpool_layers.precision.hadamard.hadamard_butterfly` in FP32 (``h = 1, 2, .., d/2``:
   pairs ``(a, b) -> (a + b, a - b)``, FP32 adds; the stages of
   :mod:`kpool_layers.kernels.hadamard_triton`), then ``* fp32(d ** -0.5)`` in FP32 (torch casts the
   Python scalar to FP32) and ``v = bf16(...)``, round to nearest even;
3. ``amax = max |v|`` over the row and the scale ``s`` of :func:`kpool_layers.precision.fp8.compute_scale` by
   :func:`kpool_layers.kernels.fp8_quant_triton._scale` (IEEE division; libdevice ``log2f`` /
   ``exp2f`` on the GPU as torch's CUDA ops, numpy's under the interpreter);
4. ``y = clamp(v / s, -448, 448)`` (IEEE division) and ``q = e4m3(y)`` by :func:`_e4m3`, round to
   nearest even onto the ``float8_e4m3fn`` grid in FP32 arithmetic (below);
5. ``q * s`` as an FP32 product, rounded to BF16 for ``ue8m0`` (exact there) or stored as FP32.

A row with an inf or NaN after step 2 (an inf or NaN input, or an overflow in the rotation) is NaN
throughout in the reference: its ``amax`` and so its scale are inf or NaN, and ``inf / inf`` or
``0 * inf`` follow. The kernel writes NaN for such rows directly (a GPU ``max`` may drop a NaN).

``_e4m3`` equals torch's ``y.to(torch.float8_e4m3fn).float()`` for every clamped ``y``
(``|y| <= 448``, not NaN). ``float8_e4m3fn`` has 3 mantissa bits, normal numbers down to ``2**-6``
and subnormals ``k * 2**-9`` (``k = 1..7``); torch's conversion (c10's ``fp8e4m3fn_from_fp32_value``)
rounds to nearest even in both ranges, and the clamp keeps it clear of its NaN/saturation branch
(448 is the largest finite value, so nothing within ``+-448`` rounds past it). The kernel:

* ``|y| >= 2**-6``: the FP32 bits of ``|y|`` plus ``0x7FFFF`` plus the lowest kept mantissa bit
  (bit 20), then the 20 low bits cleared: round to nearest even to 3 mantissa bits; a carry into
  the exponent gives the next binade's first value, as it should;
* ``|y| < 2**-6``: ``t = |y| * 2**9`` (exact) is below 8, and ``(t + 1.5 * 2**23) - 1.5 * 2**23``
  rounds it to an integer, nearest even (the sum lies in ``[2**23, 2**24)``, whose FP32 spacing is
  1; the subtraction is exact), then ``* 2**-9`` (exact): ``k * 2**-9`` with ``k`` in ``0..8``
  (``k = 8`` is ``2**-6``, the smallest normal value, as in torch);
* the sign bit of ``y`` is put back on the result (so ``-0.0`` and values rounding to zero from
  below keep their sign, as e4m3's zero does).

All of it is integer bit operations and exact or correctly rounded FP32 adds and multiplies, which
the GPU and Triton's interpreter (numpy) compute alike; a float8 conversion is not used because the
interpreter's rounds half away from zero and flushes subnormals. Launched with
``enable_fp_fusion=False`` so that no multiply and add are contracted into an FMA. Under the
interpreter FP32 -> BF16 casts truncate, so there (``EMULATE_BF16``) the bf16 roundings are the
integer ones of :mod:`kpool_layers.kernels.hadamard_triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_layers.precision import fp8_format
from kpool_layers.kernels.fp8_quant_triton import _scale
from kpool_layers.kernels.hadamard_triton import (
    _INTERPRETED,
    _KIND,
    BLOCK_ELEMENTS,
    _fp32,
    as_rows,
    fits,
    _narrow,
    _round,
    _stage,
    _widen,
)

MAX_D = fp8_format.BLOCK
"""Largest channel count (the serving index path's quantization block)."""


@triton.jit
def _e4m3(y):
    """FP32 values ``|y| <= 448`` rounded to nearest even onto the ``float8_e4m3fn`` grid, as FP32."""
    u = y.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    mag = u ^ sign
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    a = mag.to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    r = tl.where(a >= 0.015625, normal, subnormal)
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _serving_quant_kernel(
    x_ptr, out_ptr, M, scale,
    D: tl.constexpr, LOG_D: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr,
    UE8M0: tl.constexpr, EMULATE_BF16: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    v = _widen(tl.load(x_ptr + offs, mask=mask, other=0.0), KIND, EMULATE_BF16)
    v = _round(v, 1, EMULATE_BF16)  # KIND 1: bf16
    for i in tl.static_range(LOG_D):  # KIND 0: FP32 adds, nothing rounded
        v = _stage(v, ROWS, D, 1 << i, 0, EMULATE_BF16, False)
    v = _round(v * scale, 1, EMULATE_BF16)
    s = _scale(tl.max(tl.abs(v), axis=1), UE8M0, LIBDEVICE)[:, None]
    out = _e4m3(tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)) * s
    finite = tl.min((tl.abs(v) <= 3.4028234663852886e38).to(tl.int32), axis=1) == 1
    out = tl.where(finite[:, None], out, float("nan"))  # an inf or NaN makes the row's scale NaN or inf
    if UE8M0:
        tl.store(out_ptr + offs, _narrow(out, 1, EMULATE_BF16), mask=mask)
    else:
        tl.store(out_ptr + offs, out, mask=mask)


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`serving_index_quant_triton` takes ``x`` (device, dtype, last dimension)."""
    return fits(x, 1, MAX_D)


def serving_index_quant_triton(x: torch.Tensor, scale_format: fp8_format.ScaleFormat = "ue8m0") -> torch.Tensor:
    """:func:`kpool_layers.precision.fp8.serving_index_quant` ``(x, scale_format)`` in one kernel: the same
    values, dtype and shape (module docstring)."""
    if scale_format not in fp8_format.SCALE_FORMATS:
        raise ValueError(f"scale_format={scale_format!r} is not supported; allowed: {list(fp8_format.SCALE_FORMATS)}")
    x2 = as_rows(x, "serving_index_quant_triton", 1, MAX_D)
    d = x2.shape[1]
    ue8m0 = scale_format == "ue8m0"
    out = torch.empty(x2.shape, dtype=torch.bfloat16 if ue8m0 else torch.float32, device=x.device)
    m = x2.shape[0]
    if m:
        rows = max(1, BLOCK_ELEMENTS // d)
        _serving_quant_kernel[(triton.cdiv(m, rows),)](
            x2, out, m, _fp32(d**-0.5), D=d, LOG_D=d.bit_length() - 1, ROWS=rows, KIND=_KIND[x.dtype],
            UE8M0=ue8m0, EMULATE_BF16=_INTERPRETED, LIBDEVICE=not _INTERPRETED,
            num_warps=4, enable_fp_fusion=False)
    return out.view(x.shape)
