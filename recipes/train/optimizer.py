"""The run's optimizer: megatron-core's (distributed) mixed-precision Adam over the DDP model, with
torch's fused AdamW kernel where megatron falls back to torch's optimizer.

megatron-core 0.19.2 takes ``FusedAdam`` from Transformer Engine or apex; with neither installed it
builds ``torch.optim.AdamW`` with torch's defaults, which on a GPU is the ``foreach`` implementation:
a dozen multi-tensor launches per parameter chunk and one read-modify-write of the fp32 state per
elementwise op. torch's own ``fused=True`` AdamW does the same update in one pass per tensor
group. :func:`build_optimizer` switches megatron's fallback to it, at the build, where torch has a
fused kernel for the parameters' device (CUDA and CPU): the same algorithm, hyper-parameters and
state layout (``exp_avg``, ``exp_avg_sq`` per main parameter), with each parameter's ``step`` a
scalar tensor on the parameter's device (torch's rule for fused; :func:`adam_step` makes them so).
With TE or apex installed, megatron's ``FusedAdam`` is kept as it is. The gradient norm and
clipping around the step get torch's multi-tensor kernels the same way (:mod:`kpool_layers.compat.multi_tensor`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from kpool_layers.compat import multi_tensor
from recipes.config.schema import ParallelismConfig, TrainConfig


def inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers megatron's (chained) optimizer wraps."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def fusable(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner`` is torch's Adam(W) over floating parameters on devices torch has a fused
    Adam kernel for (megatron's fallback without TE/apex; their ``FusedAdam`` is not a torch
    ``Adam``)."""
    if not isinstance(inner, torch.optim.Adam):
        return False
    devices = set(_get_fused_kernels_supported_devices())
    params = [p for group in inner.param_groups for p in group["params"]]
    return all(p.device.type in devices and p.is_floating_point() for p in params)


def use_fused_adam(optimizer: MegatronOptimizer) -> bool:
    """Switch every torch Adam(W) inside ``optimizer`` that :func:`fusable` accepts to torch's
    fused kernel (before its first step: no state exists yet). Returns whether any was switched."""
    switched = False
    for inner in inner_optimizers(optimizer):
        if not fusable(inner):
            continue
        if inner.state:
            raise RuntimeError("use_fused_adam runs at the build, before the optimizer has state")
        for group in [inner.defaults, *inner.param_groups]:
            group["foreach"] = False
            group["fused"] = True
        switched = True
    return switched


def adam_step(value: float, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """A parameter's own torch-Adam ``step`` tensor holding ``value``: fp32 on the parameter's
    device for the fused / capturable kernels, on the CPU otherwise (torch's placement rule)."""
    on_param = group.get("fused") or group.get("capturable")
    return torch.tensor(float(value), dtype=torch.float32, device=param.device if on_param else "cpu")


def build_optimizer(ddp: DistributedDataParallel, train: TrainConfig, par: ParallelismConfig, *,
                    bf16: bool, params_dtype: torch.dtype) -> MegatronOptimizer:
    """megatron's Adam optimizer for ``ddp``'s parameters from ``train.*`` (lr, betas, eps,
    weight decay, gradient clipping), distributed where ``parallelism.use_distributed_optimizer``
    says; its torch fallback fused (:func:`use_fused_adam`) and its gradient norm and clipping on
    torch's multi-tensor kernels (:func:`kpool_layers.compat.multi_tensor.install`)."""
    multi_tensor.install()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
            clip_grad=train.clip_grad, bf16=bf16, params_dtype=params_dtype,
            use_distributed_optimizer=par.use_distributed_optimizer,
        ),
        [ddp],
    )
    use_fused_adam(optimizer)
    return optimizer
