"""Stop (or skip a few) steps whose loss or gradients are not finite, before the update is applied.

Like megatron's ``check_for_nan_in_loss_and_grad``: a step whose global loss or any gradient is
NaN/inf is not applied (no optimizer or scheduler step); up to ``train.nonfinite_skip`` such steps
are skipped over the run, the next one raises :class:`NonFiniteError` naming the step. Nothing is
saved after it, so the last checkpoint holds the last good state. A save first checks the weights
after the update (:func:`check_weights_finite`): an update that made them NaN/inf from a finite
loss and gradients (e.g. a huge ``train.lr``) is never saved.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class NonFiniteError(FloatingPointError):
    """Training produced a non-finite loss or gradient."""


def grads_finite(ddp: Any) -> bool:
    """Whether every gradient in megatron DDP's buffers is finite on every rank (collective; one
    host sync). With the distributed optimizer a rank's buffer holds its reduced shard and its own
    unreduced gradients elsewhere, so a non-finite value anywhere shows up on some rank."""
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    device = buffers[0].grad_data.device if buffers else torch.device("cpu")
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    for b in buffers:
        bad |= (~torch.isfinite(b.grad_data).all()).to(torch.int32)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


class NonFiniteGuard:
    """Counts skipped steps and raises once more than ``skip`` occurred."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.skipped = 0

    def apply_step(self, step: int, loss: float, ddp: Any, save_hint: str) -> bool:
        """Whether step ``step`` may be applied; raises :class:`NonFiniteError` past the budget."""
        finite_loss = math.isfinite(loss)
        finite_grads = grads_finite(ddp)
        if finite_loss and finite_grads:
            return True
        what = f"loss {loss}" if not finite_loss else "gradient norm (non-finite gradients)"
        self.skipped += 1
        if self.skipped > self.skip:
            raise NonFiniteError(
                f"non-finite {what} at step {step} ({self.skipped} non-finite step(s), "
                f"train.nonfinite_skip={self.skip}); this state is not saved, {save_hint}. Lower "
                "train.lr, check the data, or raise train.nonfinite_skip to skip such steps")
        return False


def check_weights_finite(module: torch.nn.Module, step: int, keeps: str, what: str = "") -> None:
    """Raise :class:`NonFiniteError` naming ``step`` and the first non-finite parameter when any
    parameter of ``module`` holds NaN/inf on any rank (collective; one fused max-abs norm per
    dtype group, ``torch._foreach_norm(ord=inf)``, and one host sync). Max-abs is NaN/inf exactly
    when the tensor holds a NaN/inf, and never overflows for a finite tensor. ``keeps``: what the
    checkpoint root still holds, for the message (the refused state is never saved); ``what``:
    whose weights, for the message (default: those after the update of ``step``)."""
    named = [(n, p) for n, p in module.named_parameters() if p.numel()]
    device = named[0][1].device if named else torch.device("cpu")
    bad_mask = torch.zeros(len(named), dtype=torch.bool, device=device)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, p) in enumerate(named):
        by_dtype.setdefault(p.dtype, []).append(i)
    for idx in by_dtype.values():
        norms = torch._foreach_norm([named[i][1].detach() for i in idx], float("inf"))
        bad_mask[idx] = ~torch.isfinite(torch.stack(norms).float())
    total = bad_mask.sum().to(torch.int64).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    if total.item():
        local = [named[i][0] for i in bad_mask.nonzero().flatten().tolist()]
        where = f"; this rank's first: {local[0]} ({len(local)} of {len(named)} here)" if local else ""
        raise NonFiniteError(
            f"{what or f'the weights after the update of step {step}'} are not finite ({total.item()} parameter "
            f"tensor(s) with NaN/inf over all ranks{where}): this state is not saved and `latest` "
            f"is not moved; {keeps}. Lower train.lr or check the data")


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
