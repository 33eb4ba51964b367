"""The two passes of a vocab-parallel cross entropy over logits rows, one Triton kernel each.

``row_stats(logits, labels, vocab_start)``: ``logits [T, V]`` (this rank's vocabulary slice
``[vocab_start, vocab_start + V)``, any float dtype, last dimension contiguous), ``labels [T]``
int64 (global vocabulary ids) -> FP32 ``[T]`` each: the row's maximum ``m``, ``sum_v exp(x_v - m)``
and the label's logit where this rank holds the label (0 elsewhere). One program per row reads the
row once in blocks of ``BLOCK`` values, keeping a running maximum and a rescaled running sum per
lane (online softmax), and reduces the lanes at the end.

``logit_grads(logits, labels, vocab_start, lse, grad_loss)``: ``(softmax - onehot) * grad_loss`` per
row, with ``softmax = exp(x - lse)`` (``lse [T]`` FP32: the log of the sum over the whole
vocabulary, all ranks), written over ``logits`` in its dtype (the logits are not needed once
their gradient exists; this saves a ``[T, V]`` buffer). ``grad_loss [T]`` FP32.

All arithmetic is FP32: logits are widened on load and only the gradient is rounded to the
logits' dtype (round to nearest even on the GPU; Triton's interpreter truncates FP32 -> BF16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Logits per row and loop iteration (fewer for a smaller vocabulary slice)."""

NUM_WARPS = 8


@triton.jit
def _row_stats_kernel(logits, row_stride, labels, vocab_start, V, row_max, row_sumexp, row_target,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        empty = m_new == float("-inf")  # nothing but -inf seen in this lane yet
        s = tl.where(empty, 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    row_m = tl.max(m, axis=0)
    lane_scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - row_m))
    tl.store(row_max + row, row_m)
    tl.store(row_sumexp + row, tl.sum(s * lane_scale, axis=0))
    local = tl.load(labels + row) - vocab_start
    held = (local >= 0) & (local < V)
    target = tl.load(base + tl.where(held, local, 0), mask=held, other=0.0).to(tl.float32)
    tl.store(row_target + row, tl.where(held, target, 0.0))


@triton.jit
def _logit_grads_kernel(logits, row_stride, labels, vocab_start, V, lse, grad_loss,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    row_lse = tl.load(lse + row)
    g = tl.load(grad_loss + row)
    local = tl.load(labels + row) - vocab_start
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        x = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32)
        p = tl.exp(x - row_lse)
        p = tl.where(idx == local, p - 1.0, p)
        tl.store(base + idx, (p * g).to(logits.dtype.element_ty), mask=inside)


def _block(v: int) -> int:
    return min(BLOCK, triton.next_power_of_2(max(v, 16)))


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, V] with a contiguous last dimension, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if labels.shape != logits.shape[:1] or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 [{logits.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")


def row_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row maximum, sum of exp(x - maximum), the label's logit where held here else 0), FP32
    ``[T]`` each (module docstring)."""
    _check(logits, labels)
    t, v = logits.shape
    out = torch.empty(3, t, dtype=torch.float32, device=logits.device)
    if t:
        _row_stats_kernel[(t,)](logits, logits.stride(0), labels.contiguous(), vocab_start, v,
                                out[0], out[1], out[2], BLOCK=_block(v), num_warps=NUM_WARPS)
    return out[0], out[1], out[2]


def logit_grads(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                grad_loss: torch.Tensor) -> torch.Tensor:
    """``(exp(logits - lse) - onehot(labels)) * grad_loss`` written over ``logits``, which it
    returns (module docstring)."""
    _check(logits, labels)
    t, v = logits.shape
    if t:
        _logit_grads_kernel[(t,)](logits, logits.stride(0), labels.contiguous(), vocab_start, v,
                                  lse.float().contiguous(), grad_loss.float().contiguous(),
                                  BLOCK=_block(v), num_warps=NUM_WARPS)
    return logits
