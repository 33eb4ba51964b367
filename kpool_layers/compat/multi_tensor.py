"""torch ``foreach`` kernels for megatron-core's multi-tensor seam, where neither Transformer
Engine nor apex is installed.

megatron-core 0.19.2 takes three multi-tensor kernels from TE (or apex's ``amp_C``): an l2 norm
over a list of tensors, a scale of one list into another, and (TE only) a scale by a device tensor.
Its gradient clipping (``megatron.core.optimizer.clip_grads``) and its main-to-model parameter
copy (``megatron.core.optimizer.optimizer``) look them up as module globals at call time. Without
TE or apex they are ``megatron.core.utils.local_multi_tensor_*``: per-tensor loops that for the
glm5_proxy's 229 gradients launch one norm kernel per tensor and synchronise the host once per
tensor (``torch.tensor`` of a list of CUDA scalars), then scale each gradient with two kernels.

:func:`install` puts torch's multi-tensor ``foreach`` ops in that seam instead (the same
signatures, ``op(chunk_size, noop_flag, tensor_lists, *args)``):

* :func:`l2_norm` - ``torch._foreach_norm`` of the list, then the norm of the stacked norms: a
  ``[1]`` fp32 tensor on the tensors' device, no host synchronisation.
* :func:`scale` - ``dst = src * scale`` for a Python float.
* :func:`scale_by_tensor` - the same for a device scalar tensor. Installing it turns on megatron's
  own TE path: ``get_grad_norm_fp32`` returns the norm as a device tensor (no ``.item()``) and
  ``clip_grad_by_total_norm_fp32`` scales by ``min(1, clip / (norm + 1e-6))`` on the device.
  ``optimizer.step()`` then returns the gradient norm as a one-element tensor, as it does with TE.

The arithmetic is the local fallback's: fp32 norms of fp32 gradients and one product per element;
only the summation order of the per-tensor norms' reduction may differ on a GPU (on the CPU both
run the same per-tensor norm kernel, so the norm is bit-identical; tested). With TE or apex
installed, :func:`install` leaves megatron's kernels as they are.
"""

from __future__ import annotations

from typing import Optional

import megatron.core.optimizer.clip_grads as clip_grads
import megatron.core.optimizer.optimizer as megatron_optimizer
import megatron.core.utils as megatron_utils
import torch


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
            per_tensor: bool, *args: object) -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The l2 norm of all tensors of ``tensor_lists[0]`` together, as a ``[1]`` fp32 tensor on
    their device (and the per-tensor norms when ``per_tensor``), without a host sync."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1)
    return total, (norms if per_tensor else None)


def _scale_into(src: list[torch.Tensor], dst: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """``dst[i] = src[i] * factor`` (in place where ``dst`` is ``src``)."""
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
          factor: float) -> None:
    """``tensor_lists[1][i] = tensor_lists[0][i] * factor`` (a copy where ``factor`` is 1)."""
    src, dst = tensor_lists
    if factor == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        _scale_into(src, dst, factor)


def scale_by_tensor(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    factor: torch.Tensor) -> None:
    """``tensor_lists[1][i] = tensor_lists[0][i] * factor`` for a one-element device tensor."""
    src, dst = tensor_lists
    _scale_into(src, dst, factor.reshape(()))


def install() -> bool:
    """Put :func:`l2_norm`, :func:`scale` and :func:`scale_by_tensor` where megatron fell back to
    its local loops (process-wide, idempotent). Returns whether megatron uses them; False when
    TE or apex supplies the kernels."""
    if clip_grads.l2_norm_impl not in (megatron_utils.local_multi_tensor_l2_norm, l2_norm):
        return False
    clip_grads.l2_norm_impl = l2_norm
    clip_grads.multi_tensor_scale_impl = scale
    clip_grads.multi_tensor_scale_tensor_impl = scale_by_tensor
    if megatron_optimizer.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
        megatron_optimizer.multi_tensor_scale_impl = scale
    return True
