"""Role-tagged linears: each knows its precision :class:`~kpool_layers.precision.policy.Role` and the
numerics the model's policy gives that role, from the build on.

The layer specs pick them per role (:func:`role_spec` for ``build_module`` submodules, :func:`role_builder`
for megatron's callable builders such as ``MLPSubmodules``): the MLA projections
(``kpool_layers.mla.attention.glm_attention_spec``), the indexer projections
(``kpool_layers.dsa.indexer.DSAIndexerSubmodules``), the dense MLP, routed and shared experts and the
router (``kpool_layers.spec``). The numerics (:class:`~kpool_layers.precision.policy.LinearNumerics`) come
from ``config.precision`` (the run's :class:`~kpool_layers.precision.policy.PrecisionPolicy`) and the
parameter dtype when the linear is built; the precision map is read from the modules'
``role`` / ``numerics``.

* :class:`RoleColumnParallelLinear` / :class:`RoleRowParallelLinear` - megatron's tensor-parallel
  linears. A role whose numerics equal the base class' (same dtype, unquantized) runs megatron's
  ``forward`` unchanged. Otherwise ``forward`` is overridden: megatron's public autograd mappings
  (``megatron.core.tensor_parallel.mappings``) move the input and output across the TP group
  exactly as the base class does (sequence-parallel all-gather with reduce-scatter of its
  gradient, or the input-gradient all-reduce, for the column-parallel input; reduce or
  reduce-scatter of the row-parallel output; ``gather_output``, ``skip_bias_add``,
  ``input_is_parallel``, ``explicit_expert_comm`` honoured) around the role's GEMM. The seam is
  the modules' public ``forward(input_, ...) -> (output, bias)`` contract that every megatron
  caller (``MLP``, ``SequentialMLP``, ``GPTModel``) uses, plus the mapping functions exported by
  ``megatron.core.tensor_parallel``; nothing depends on the private ``_forward_impl`` keyword list
  or on ``LinearWithGradAccumulationAndAsyncCommunication``. Not supported with a replaced GEMM
  (refused at build): ``defer_embedding_wgrad_compute`` and ``gtp_remat_size > 1``; gradient
  accumulation fusion and the async dgrad/wgrad overlap are not used (the weight gradient lands
  in ``weight.grad``; megatron's DDP hook adds it into ``main_grad``). Roles that run megatron's
  ``forward`` get its fusion under DDP (:mod:`kpool_layers.compat.wgrad_accumulation`).
* :class:`RoleDuplicatedLinear` - a bias-free ``nn.Linear`` replicated on every TP rank (the
  indexer's projections), same role logic on ``nn.Linear``'s ``forward``.
* :class:`RoleTopKRouter` - megatron's ``TopKRouter`` tagged ``moe.router`` (it computes its
  gating GEMM in FP32 itself with ``moe_router_dtype='fp32'``, which the build checks).
* :func:`computed_by_owner` - marks a linear whose forward never runs (the owner uses its weight:
  the absorbed MLA ``kv_up``, the KPool indexer's head weights); the map shows why.
* :func:`assign_gpt_roles` - ``GPTModel`` builds its word embedding and output layer itself, from
  no spec: they are tagged by position (``model.embedding.word_embeddings``,
  ``model.output_layer``). Their roles never change megatron's computation (checked).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from kpool_layers.precision.policy import LinearNumerics, Role


def _tag(module: torch.nn.Module, role: Role | str, config: Any) -> None:
    """Give ``module`` its ``role`` and the numerics ``config.precision`` gives it (weight
    gradients into DDP's ``main_grad`` where ``config.gradient_accumulation_fusion``)."""
    module.role = Role(role)
    module.numerics = LinearNumerics(config.precision, module.role,
                                     accumulate_wgrad=bool(getattr(config, "gradient_accumulation_fusion", False)))


def _check_own_gemm(module: torch.nn.Module, config: Any) -> None:
    """Refuse megatron features the role GEMM does not carry out (see the module docstring)."""
    if not module.numerics.replaces_gemm(config.params_dtype):
        return
    if getattr(config, "defer_embedding_wgrad_compute", False) or getattr(module, "gtp_remat_size", 1) > 1:
        raise ValueError(f"{type(module).__name__} with role {module.role.value} computes its own GEMM, "
                         "which supports neither defer_embedding_wgrad_compute nor gtp_remat_size > 1")


class RoleColumnParallelLinear(ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` computing as its ``role`` says (module docstring)."""

    def __init__(self, *args: Any, role: Role | str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _tag(self, role, self.config)
        _check_own_gemm(self, self.config)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        own = self.weight if weight is None else weight
        if own is None or not self.numerics.replaces_gemm(own.dtype):
            return super().forward(input_, weight, runtime_gather_output)
        if self.sequence_parallel and not self.explicit_expert_comm:
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                          group=self.tp_group)
        elif not (self.explicit_expert_comm or self.disable_grad_reduce):
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = self.numerics(input_, own)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias.to(out.dtype)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RoleRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` computing as its ``role`` says (module docstring)."""

    def __init__(self, *args: Any, role: Role | str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _tag(self, role, self.config)
        _check_own_gemm(self, self.config)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.numerics.replaces_gemm(self.weight.dtype):
            return super().forward(input_)
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = self.numerics(input_, self.weight)
        if self.sequence_parallel and not self.explicit_expert_comm:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        elif not self.explicit_expert_comm:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class RoleDuplicatedLinear(torch.nn.Linear):
    """Linear replicated on every TP rank (``nn.Linear``: ``forward(x) -> y``), computing as its
    ``role`` says. Initialised with ``init_method`` (when ``config.perform_initialization``) from
    the default generator, seeded identically on all TP ranks; ``init_method=None``: zeros."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, role: Role | str,
                 init_method: Optional[Callable[[torch.Tensor], Any]], bias: bool = False) -> None:
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(input_size, output_size, bias=bias, device=device, dtype=config.params_dtype)
        with torch.no_grad():
            if init_method is None:
                self.weight.zero_()
            elif config.perform_initialization:
                init_method(self.weight)
        _tag(self, role, config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        if not self.numerics.replaces_gemm(self.weight.dtype):
            return super().forward(input)
        out = self.numerics(input, self.weight)
        return out + self.bias.to(out.dtype) if self.bias is not None else out


class RoleTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` tagged ``moe.router``; its FP32 role is megatron's own
    ``moe_router_dtype='fp32'`` gating GEMM (required unless the model is FP32)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _tag(self, Role.MOE_ROUTER, self.config)
        if self.numerics.replaces_gemm(self.config.params_dtype) and self.config.moe_router_dtype != "fp32":
            raise ValueError(f"the moe.router role computes in {self.numerics.dtype(self.config.params_dtype)}; "
                             "set moe_router_dtype='fp32' (megatron computes the gating GEMM)")


def computed_by_owner(linear: torch.nn.Module, note: str, dtype: Optional[torch.dtype] = None) -> None:
    """Mark a role-tagged ``linear`` whose forward never runs: its owner computes with the weight
    in ``dtype`` (None: the weight's); the precision map shows ``note``. A linear without a role
    (another spec's class) is left alone."""
    if isinstance(getattr(linear, "numerics", None), LinearNumerics):
        linear.numerics = linear.numerics.computed_by_owner(note, dtype)


def role_spec(module: type, role: Role) -> ModuleSpec:
    """A ``build_module`` submodule: ``module`` built with ``role``."""
    return ModuleSpec(module=module, params={"role": role})


def role_builder(module: type, role: Role) -> Callable[..., torch.nn.Module]:
    """A callable builder (megatron's ``MLPSubmodules`` linears): ``module`` built with ``role``."""
    return functools.partial(module, role=role)


def assign_gpt_roles(model: torch.nn.Module) -> None:
    """Tag the linears ``GPTModel`` builds itself, by position: ``embedding.word_embeddings``
    (``embedding``) and ``output_layer`` (``output``), where this pipeline stage has them. Their
    roles leave megatron's computation as it is (a policy that would change it raises)."""
    embedding = getattr(model, "embedding", None)
    for module, role in ((getattr(embedding, "word_embeddings", None), Role.EMBEDDING),
                         (getattr(model, "output_layer", None), Role.OUTPUT)):
        if module is None:
            continue
        _tag(module, role, model.config)
        if module.numerics.replaces_gemm(model.config.params_dtype):
            raise ValueError(f"role {role.value} would change GPTModel's own {type(module).__name__}")
