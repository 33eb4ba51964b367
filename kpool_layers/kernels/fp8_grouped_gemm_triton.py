"""FP8 (e4m3) grouped GEMM of the routed experts in one Triton kernel: every expert's rows times
that expert's weight, FP8 tensor-core dots with FP32 accumulation and the quantization scales
applied to each 128-wide K block's FP32 partial product (the DeepSeek-V3 / DeepGEMM blockwise
scheme).

Layouts (``T`` routed rows sorted by expert, ``E`` experts, ``N`` outputs and ``K`` inputs per
expert):

* ``x_q [T, K]`` float8_e4m3fn, rows of expert ``e`` contiguous and in expert order,
  ``tokens_per_expert [E]`` rows each (any integer dtype; empty experts allowed; on the host, as
  megatron's dispatchers give it, it is copied to the device, no device synchronisation);
  ``x_s`` its FP32 scales as :func:`kpool_layers.precision.fp8.quantize` gives them for ``operand=
  "activation"``: ``[T, ceil(K / 128)]`` (blockwise, 1x128 tiles) or ``[T, 1]`` (rowwise);
* ``w_q [E, N, K]`` float8_e4m3fn (``nn.Linear`` layout per expert), ``w_s`` the per-expert weight
  scales: ``[E, N / 128, ceil(K / 128)]`` (blockwise, 128x128 blocks; ``N`` a multiple of 128 so
  no block crosses experts) or ``[E, N, 1]`` (rowwise). Quantizing the stacked ``[E * N, K]``
  weight once gives exactly these (reshape its scales);
* result ``[T, N]`` BF16 whose rows of expert ``e`` are ``dequant(x_q_e) @ dequant(w_q[e]).T``.

Numerics: for each output tile and each 128-wide K block ``k``, ``P = dot(x_q[:, k], w_q[:, k].T)``
on FP8 tensor cores (products of e4m3 values are exact; Hopper's FP8 MMA accumulates with about 14
significant bits, DeepSeek-V3 report 3.3.2, so the sums are promoted to FP32 every 128-wide block),
then ``acc += P * x_s[row, k] * w_s[col block, k]`` in FP32; one rounding to BF16 at the store. With
ue8m0 (power-of-two) scales the scaling is exact, so the result equals the GEMM of the dequantized
operands up to accumulation error and the final BF16 rounding (bounds: tests/test_grouped_experts_fp8.py).
Rowwise runs the same loop with the row's scale for every K block.

Scheduling (no host synchronisation): the grid is ``(ceil(N / BLOCK_N), ceil(T / BLOCK_M) + E)``,
an upper bound on the number of row tiles when every expert's rows are tiled separately; each
program finds its expert from the cumulative tile counts of ``tokens_per_expert`` (computed in the
kernel) so that a row tile never mixes experts, and programs past the last tile return. Fixed
configuration (no autotuning, reproducible), :data:`TILES`: the output tile and pipeline depth
chosen on an H200 by ``scripts/bench/fp8_grouped_sweep.py`` (docs/benchmarks.md). The K step is
always the 128-wide scale block, and each output element sums its K blocks in the same order
whatever the tiles, so every configuration gives the same bits.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kpool_layers.precision import fp8_format
from kpool_layers.compat.device_copy import to_device

BLOCK_K = fp8_format.BLOCK


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Output tile ``block_m x block_n``, warps and software-pipeline stages of the kernel
    (shared memory per stage: ``(block_m + block_n) * 128`` bytes)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4


TILES = Tiles(block_m=64, block_n=128, num_warps=4, num_stages=3)
"""The kernel's configuration (module docstring)."""


@triton.jit
def _pick(values, idx, i):
    """``values[i]`` of a 1-D block indexed by ``idx``."""
    return tl.sum(tl.where(idx == i, values, 0), axis=0)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, counts_ptr, out_ptr, N, K, E,
    stride_xm, stride_xsm, stride_xsk, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_om,
    W_SCALE_ROWS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    row_end = tl.cumsum(counts, axis=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tile_end <= tile).to(tl.int32), axis=0)
    if expert >= E:  # past the last row tile
        return
    first_tile = _pick(tile_end - tiles, idx, expert)
    end = _pick(row_end, idx, expert)
    start = end - _pick(counts, idx, expert) + (tile - first_tile) * BLOCK_M
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xsm
    ws_cols = ws_ptr + expert * stride_wse + (cols // W_SCALE_ROWS) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        partial = tl.dot(a, b, out_dtype=tl.float32)
        sa = tl.load(xs_rows + kb * stride_xsk, mask=row_ok, other=0.0)
        sb = tl.load(ws_cols + kb * stride_wsk, mask=col_ok, other=0.0)
        acc += partial * sa[:, None] * sb[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(
    x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
    tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, tiles: Tiles | None = None,
) -> torch.Tensor:
    """``[T, N]`` in ``out_dtype``, rows of expert ``e`` = ``dequant(x_q_e) @ dequant(w_q[e]).T``
    (layouts and numerics: module docstring; the recipe is read from the scales' shapes; ``tiles``:
    the kernel configuration, the same bits for any; None: :data:`TILES`).

    ``out_dtype=torch.float32`` stores the FP32 accumulator unrounded (the CPU tests: Triton's
    interpreter converts FP32 to BF16 by truncation, the GPU rounds to nearest even)."""
    (t, k), (e, n, k_w) = x_q.shape, w_q.shape
    k_blocks = triton.cdiv(k, fp8_format.BLOCK)
    w_rows = n // w_s.shape[1] if w_s.dim() == 3 and w_s.shape[1] else 0
    layouts_ok = (
        k_w == k and tokens_per_expert.shape == (e,)
        and x_s.shape in ((t, k_blocks), (t, 1))
        and w_rows in (1, fp8_format.BLOCK) and w_s.shape == (e, n // w_rows, w_s.shape[2]) and n % w_rows == 0
        and w_s.shape[2] in (k_blocks, 1)
    )
    if not layouts_ok:
        raise ValueError(
            f"grouped_gemm: x_q {tuple(x_q.shape)} with scales {tuple(x_s.shape)} (expected [T, ceil(K / 128)] "
            f"or [T, 1]), w_q {tuple(w_q.shape)} with scales {tuple(w_s.shape)} (expected [E, N / 128, "
            f"ceil(K / 128)], N a multiple of 128, or [E, N, 1]), tokens_per_expert {tuple(tokens_per_expert.shape)}")
    out = torch.empty((t, n), dtype=out_dtype, device=x_q.device)
    if t == 0 or n == 0:
        return out
    x_q, w_q = x_q.contiguous(), w_q.contiguous()
    counts = to_device(tokens_per_expert, x_q.device)
    tiles = tiles or TILES
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(t, tiles.block_m) + e)
    _grouped_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, counts, out, n, k, e,
        x_q.stride(0), x_s.stride(0), x_s.stride(1) if x_s.shape[1] > 1 else 0,
        w_q.stride(0), w_q.stride(1), w_s.stride(0), w_s.stride(1), w_s.stride(2) if w_s.shape[2] > 1 else 0,
        out.stride(0),
        W_SCALE_ROWS=w_rows, E_POW2=triton.next_power_of_2(e),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
