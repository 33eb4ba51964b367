"""Tile helpers shared by the Triton sparse-MLA kernels (:mod:`.sparse_mla_triton`, gathered key
rows, and :mod:`.sparse_mla_dense_triton`, contiguous key blocks): a query row's valid slots,
channel tiles of gathered rows (either orientation), row loads split into the value and tail (rope)
channels, the scores over both, and the backward's
``delta = rowsum(dO * O)``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""``log2(e)``: the kernels' softmax runs in base 2 (``exp2``)."""


@triton.jit
def load_tile(rows, row_mask, cols, width):
    """``[R, C]`` tile ``rows[r] + cols[c]`` (row pointers plus channel offsets), 0 where
    ``row_mask`` is False or ``cols >= width``."""
    return tl.load(rows[:, None] + cols[None, :],
                   mask=row_mask[:, None] & (cols[None, :] < width), other=0.0)


@triton.jit
def load_tile_t(rows, row_mask, cols, width):
    """The transposed tile, ``[C, R]``: ``rows[r] + cols[c]`` at ``[c, r]``, masked like
    :func:`load_tile`."""
    return tl.load(rows[None, :] + cols[:, None],
                   mask=row_mask[None, :] & (cols[:, None] < width), other=0.0)


@triton.jit
def load_value_rows(base, rows_offset, row_mask, V: tl.constexpr, BV: tl.constexpr):
    """Rows ``base + rows_offset[r] + c`` for channels ``c < V``, ``[R, BV]``, masked as 0."""
    cv = tl.arange(0, BV)
    return tl.load(base + rows_offset[:, None] + cv[None, :],
                   mask=row_mask[:, None] & (cv[None, :] < V), other=0.0)


@triton.jit
def load_rows(base, rows_offset, row_mask, V: tl.constexpr, T: tl.constexpr,
              BV: tl.constexpr, BT: tl.constexpr):
    """Rows ``base + rows_offset[r] + c`` split into the value part ``[R, BV]`` and the tail part
    ``[R, BT]`` (channels ``V .. V+T-1``; a zero dummy when ``T == 0``), masked rows as 0."""
    head = load_value_rows(base, rows_offset, row_mask, V, BV)
    if T > 0:
        ct = tl.arange(0, BT)
        tail = tl.load(base + rows_offset[:, None] + V + ct[None, :],
                       mask=row_mask[:, None] & (ct[None, :] < T), other=0.0)
    else:
        tail = tl.zeros((rows_offset.shape[0], BT), base.dtype.element_ty)
    return head, tail


@triton.jit
def scores(q, qt, k, kt, T: tl.constexpr, PREC: tl.constexpr):
    """``q k^T`` over the value and tail channels, fp32 ``[rows of q, rows of k]``."""
    sc = tl.dot(q, tl.trans(k), input_precision=PREC)
    if T > 0:
        sc += tl.dot(qt, tl.trans(kt), input_precision=PREC)
    return sc


@triton.jit
def visible_range(KSTART, QPOS, i, HAS_KSTART: tl.constexpr, HAS_QPOS: tl.constexpr):
    """int64 ``(lowest, highest)`` keys query row ``i`` may see, both inclusive: ``KSTART[i]`` (0
    when absent) and ``QPOS[i]`` (``i`` when absent: causal)."""
    if HAS_KSTART:
        lowest = tl.load(KSTART + i).to(tl.int64)
    else:
        lowest = i.to(tl.int64) * 0
    if HAS_QPOS:
        highest = tl.load(QPOS + i).to(tl.int64)
    else:
        highest = i.to(tl.int64)
    return lowest, highest


@triton.jit
def selected_slots(IDX, KSTART, QPOS, bi, i, slots, W, si_b, si_s, HAS_KSTART: tl.constexpr,
                   HAS_QPOS: tl.constexpr):
    """Key positions (int64, 0 where invalid) and validity of ``slots`` of query row ``(bi, i)``:
    inside :func:`visible_range`."""
    keys = tl.load(IDX + bi * si_b + i * si_s + slots, mask=slots < W, other=-1).to(tl.int64)
    lowest, highest = visible_range(KSTART, QPOS, i, HAS_KSTART, HAS_QPOS)
    valid = (keys >= lowest) & (keys <= highest) & (slots < W)
    return tl.where(valid, keys, 0), valid


@triton.jit
def _delta_kernel(DO, O, DELTA, ROWS, V, BR: tl.constexpr, BV: tl.constexpr):
    """``DELTA[r] = sum_c DO[r, c] * O[r, c]`` in fp32 over rows ``r`` of contiguous ``[ROWS, V]``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cv = tl.arange(0, BV)
    mask = (rows < ROWS)[:, None] & (cv < V)[None, :]
    offs = rows.to(tl.int64)[:, None] * V + cv[None, :]
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(do * o, 1), mask=rows < ROWS)


def output_delta(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 ``delta [s_q, b, n] = rowsum(dO * O)`` over the value channels of the contiguous
    ``grad_out`` and ``out`` ``[s_q, b, n, v]`` (the softmax backward's correction term)."""
    s, b, n, v = out.shape
    rows = s * b * n
    delta = torch.empty(s, b, n, dtype=torch.float32, device=out.device)
    _delta_kernel[(triton.cdiv(rows, 16),)](grad_out, out, delta, rows, v, BR=16, BV=pow2(v),
                                            num_warps=4)
    return delta


def pow2(x: int) -> int:
    """The channel / head block for ``x``: the next power of two, at least 16 (``tl.dot``'s
    smallest tile)."""
    return max(16, triton.next_power_of_2(x))
