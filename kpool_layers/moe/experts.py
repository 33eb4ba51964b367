"""Routed experts as grouped GEMMs for megatron's ``MoELayer`` on the local backend (no TE).

:class:`GroupedExperts` is a drop-in for megatron's ``SequentialMLP`` (same constructor and
``forward`` interface, used with megatron's router and token dispatcher, EP and expert-TP as
megatron shards them; the SwiGLU clamp ``activation_func_clamp_value`` as megatron's unfused GLU
applies it: gate ``<= limit``, up in ``[-limit, limit]``) whose local experts run as two grouped GEMMs instead of one MLP each
(:mod:`kpool_layers.moe.grouped_gemm`): ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on
releases without the public name) on CUDA, a per-expert loop of ``x_e @ w_e.T`` elsewhere (CPU
tests), same results up to summation order.

Precision: the two GEMMs are the roles ``moe.expert_fc1`` / ``moe.expert_fc2`` of the run's policy
(``config.precision``; :attr:`GroupedExperts.numerics`). Under ``precision.fp8`` they compute what
``SequentialMLP``'s role-tagged per-expert linears compute: on CUDA with the ``torch`` backend one
FP8 grouped GEMM per projection (recipes ``blockwise`` and ``rowwise``; ``tensorwise`` is refused at
the build), on the CPU / ``emulate`` backend the per-expert FP8 GEMM in a loop (bit-equal to
``SequentialMLP``).

Layouts (``E`` local experts, ``H`` hidden size, ``F`` = ``moe_ffn_hidden_size`` / expert-TP size,
``G`` = 2 for SwiGLU else 1, ``T`` tokens routed to this rank's experts, sorted by expert):

* ``weight1 [E, G * F, H]``: expert ``e``'s ``linear_fc1.weight`` (``nn.Linear`` layout; SwiGLU
  rows ``[gate; up]`` of this expert-TP rank, as megatron's column-parallel fc1 holds them);
* ``weight2 [E, H, F]``: expert ``e``'s ``linear_fc2.weight`` (row-parallel shard);
* ``forward(x [T, H], tokens_per_expert [E], probs [T]) -> (y [T, H], None)``: rows of expert
  ``e`` are ``fc2(act(fc1(x_e)) * probs_e)``; partial sums over expert-TP ranks are reduced by
  megatron's token dispatcher, as for ``SequentialMLP``.

Checkpoints are interchangeable with ``SequentialMLP``: ``state_dict`` and ``sharded_state_dict``
name and shape every expert's tensors as ``local_experts.{e}.linear_fc{1,2}.weight`` (and
``_extra_state``) exactly as ``SequentialMLP`` does (global expert axis, SwiGLU split, replica ids),
and ``load_state_dict`` accepts that layout, so a checkpoint saved by either loads into the other
(the HF conversion and its mapping are unchanged). The parameters themselves stay stacked, so
megatron's gradient buffers, and with them a distributed-optimizer state, are ordered differently:
resuming an optimizer state across the two is refused (:func:`check_resumable_experts`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from kpool_layers.compat.device_copy import to_device
from kpool_layers.moe.grouped_gemm import FP8_RECIPES, GROUPED_MM, expert_linear, fused_fp8, supports_policy
from kpool_layers.precision.policy import LinearNumerics, PrecisionPolicy, Role

_FC = ("linear_fc1", "linear_fc2")


class GroupedExperts(MegatronModule):
    """The routed experts of one MoE layer on this rank as two grouped GEMMs (module docstring)."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Any = None,
        pg_collection: Any = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        del submodules, name  # the interface of megatron's experts builders; nothing to build
        _check_supported(config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        tp = self.tp_group.size()
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        if ffn % tp:
            raise ValueError(f"model.moe_ffn_hidden_size={ffn} must be divisible by the expert-TP size {tp}")
        self.glu = 2 if config.gated_linear_unit else 1
        self.ffn_per_partition = ffn // tp
        kwargs: dict[str, Any] = {"dtype": config.params_dtype}
        if not config.use_cpu_initialization:
            kwargs["device"] = torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, self.glu * self.ffn_per_partition, hidden, **kwargs))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, self.ffn_per_partition, **kwargs))
        # Expert process groups (megatron's DDP reduces over expert-DP, ``allreduce = False``) when
        # experts are sharded otherwise than the dense layers, as megatron's expert linears decide.
        expert_groups = (config.expert_model_parallel_size > 1
                         or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        # Partition dims/strides of the per-expert linears, shifted by the expert axis (SwiGLU fc1:
        # stride 2, each rank holds [gate_r; up_r]).
        for weight, dim, stride in ((self.weight1, 1, self.glu), (self.weight2, 2, 1)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=stride)
            weight.allreduce = not expert_groups
        if config.perform_initialization and self.weight1.device.type != "meta":
            self._init_like_sequential(config)
        policy = getattr(config, "precision", None) or PrecisionPolicy()  # GLMTransformerConfig's policy
        self.numerics: dict[str, LinearNumerics] = {
            "weight1": LinearNumerics(policy, Role.MOE_EXPERT_FC1),
            "weight2": LinearNumerics(policy, Role.MOE_EXPERT_FC2),
        }
        """The numerics of each stacked weight's GEMM (read by the precision map)."""
        self.register_state_dict_post_hook(_per_expert_state_dict)
        self.register_load_state_dict_pre_hook(_stacked_state_dict)

    def _init_like_sequential(self, config: TransformerConfig) -> None:
        """The weights ``SequentialMLP`` draws from the same RNG state: expert by expert, fc1 then
        fc2; with ``use_cpu_initialization`` a full FP32 master weight split to this expert-TP rank
        (megatron's CPU initialisation), else the local shard under the expert-parallel RNG stream."""
        tp_rank, tp = self.tp_group.rank(), self.tp_group.size()
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        linears = ((self.weight1, config.init_method, (self.glu * ffn, hidden), 0, self.glu),
                   (self.weight2, config.output_layer_init_method, (hidden, ffn), 1, 1))
        for e in range(self.num_local_experts):
            for weight, init, full, dim, stride in linears:
                shard = weight.data[e]
                if config.use_cpu_initialization:
                    _initialize_affine_weight_cpu(shard, *full, shard.shape[dim], dim, init, stride=stride,
                                                  rank=tp_rank, world_size=tp, skip_set_tensor_parallel_attributes=True)
                else:
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        init(shard)

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether ``grouped_mm`` runs (:data:`GROUPED_MM` resolved to it; CUDA, BF16, 16-byte
        aligned rows) rather than the loop."""
        return GROUPED_MM.default().backend == "grouped_mm" and x.is_cuda and x.dtype == torch.bfloat16 and self.config.hidden_size % 8 == 0 and self.ffn_per_partition % 8 == 0

    def _counts(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, kernel: bool) -> torch.Tensor:
        """``tokens_per_expert`` where both GEMMs read it: int32 (the grouped kernels' offsets
        dtype, cast on the host) on ``x``'s device, copied once without a host sync, when both
        run grouped kernels (each would otherwise copy the dispatcher's host counts again, a
        blocking copy); as given (on the host) when a per-expert loop reads them."""
        on_device = kernel and all(not n.replaces_gemm(w.dtype) or fused_fp8(n, x, w) for n, w in (
            (self.numerics["weight1"], self.weight1), (self.numerics["weight2"], self.weight2)))
        if not on_device:
            return tokens_per_expert
        return to_device(tokens_per_expert.to(torch.int32), x.device)

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """``x [T, H]`` sorted by local expert, ``tokens_per_expert [E]``, router ``probs [T]`` ->
        ``(y [T, H], None)`` in ``x``'s dtype (computed as megatron's unfused MLP: activation,
        then times the probability, cast back to ``x``'s dtype, then fc2)."""
        x = permuted_local_hidden_states
        kernel = self._kernel(x)
        tokens_per_expert = self._counts(x, tokens_per_expert, kernel)
        h = expert_linear(x, self.weight1, tokens_per_expert, self.numerics["weight1"], kernel)
        if self.glu == 2:
            gate, up = torch.chunk(h, 2, dim=-1)
            if (limit := self.config.activation_func_clamp_value) is not None:  # megatron's GLU clamp
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            h = self.config.activation_func(gate) * up
        else:
            h = self.config.activation_func(h)
        h = (h * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return expert_linear(h, self.weight2, tokens_per_expert, self.numerics["weight2"], kernel), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the regular backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """``SequentialMLP``'s sharded state dict for the same weights: per local expert ``e``,
        ``{prefix}local_experts.{e}.linear_fc{1,2}.{weight,_extra_state}`` stored under the
        checkpoint keys ``{prefix}experts.linear_fc{1,2}.*`` with a global expert axis (or
        ``{prefix}experts.{global e}.*`` with ``singleton_local_shards``); fc1 split into its
        SwiGLU halves, TP axis 0 for fc1 and 1 for fc2, replicas counted over expert-DP."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        num_global = self.ep_group.size() * self.num_local_experts
        first = self.ep_group.rank() * self.num_local_experts
        out: dict = {}
        for e in range(self.num_local_experts):
            local = f"{prefix}local_experts.{e}."
            offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + e, num_global))
            expert: dict = {}
            for fc, weight, axis in zip(_FC, (self.weight1, self.weight2), (0, 1)):
                expert.update(make_sharded_tensors_for_checkpoint(
                    {"weight": weight[e], "_extra_state": None}, f"{local}{fc}.", {"weight": axis}, offsets,
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
                ))
            if self.glu == 2:
                key = f"{local}linear_fc1.weight"
                expert[key] = apply_swiglu_sharded_factory(
                    expert[key], offsets, singleton, tp_group=self.tp_group, dp_group=metadata["dp_cp_group"]
                )
            replace_prefix_for_sharding(expert, local, f"{prefix}experts.{first + e}." if singleton else f"{prefix}experts.")
            for entry in expert.values():
                entry.replica_id = (*entry.replica_id[:2], self.dp_group.rank())
            out.update(expert)
        return out


def experts_module(model: torch.nn.Module) -> Optional[str]:
    """Class name of ``model``'s routed-experts modules (``GroupedExperts``, megatron's
    ``SequentialMLP``), None without MoE layers; what a training checkpoint records."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            return type(module.experts).__name__
    return None


def check_resumable_experts(saved: Optional[str], model: torch.nn.Module, path: Any) -> None:
    """Raise unless the optimizer state of checkpoint ``path``, saved by ``saved`` experts
    (:func:`experts_module`; None: saved before it was recorded, when the local backend always
    built ``SequentialMLP``), can be resumed by ``model``. megatron's distributed optimizer stores
    its state by position in the gradient buffers, where the two expert modules order their
    parameters differently; loading it anyway would silently scramble the Adam moments and the
    FP32 main weights. Model weights alone load either way (``train.load``)."""
    current = experts_module(model)
    saved = saved or "SequentialMLP"
    if current is None or current == saved:
        return
    raise ValueError(
        f"{path} was saved with {saved} routed experts; its optimizer state cannot be resumed by "
        f"{current}. Resume with model.moe_grouped_gemm={str(saved == 'GroupedExperts').lower()}, or "
        f"start from its weights with train.load={path} (the optimizer state restarts)"
    )


def _check_supported(config: TransformerConfig) -> None:
    """Raise for expert features this module does not implement (megatron's experts do)."""
    unsupported = {
        "add_bias_linear": config.add_bias_linear,
        "moe_apply_probs_on_input": config.moe_apply_probs_on_input,
        "moe_latent_size": config.moe_latent_size is not None,
        "glu_linear_offset": bool(config.glu_linear_offset),
        "bias_activation_fusion": config.bias_activation_fusion,
        "fp8 (Transformer Engine)": bool(config.fp8),
    }
    policy = getattr(config, "precision", None)  # the run's PrecisionPolicy (GLMTransformerConfig)
    if policy is not None and not supports_policy(policy):
        raise ValueError(
            f"precision.recipe={policy.recipe.value!r} with precision.fp8=true quantizes the routed experts "
            f"(moe.expert_fc1/fc2) with one activation scale per expert, which grouped experts "
            f"(model.moe_grouped_gemm=true) do not support; allowed: {[r.value for r in FP8_RECIPES]}, or set "
            "model.moe_grouped_gemm=false or leave it null (auto picks per-expert linears for this recipe)"
        )
    used = sorted(k for k, v in unsupported.items() if v)
    if used:
        raise ValueError(
            f"grouped experts (model.moe_grouped_gemm=true on the local backend) do not support {used}; "
            "set model.moe_grouped_gemm=false (megatron's SequentialMLP)"
        )


def _expert_key(prefix: str, e: int, fc: str, leaf: str) -> str:
    return f"{prefix}local_experts.{e}.{fc}.{leaf}"


def _per_expert_state_dict(module: GroupedExperts, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook: stacked ``weight1/weight2`` -> ``SequentialMLP``'s per-expert keys."""
    for fc, stacked in zip(_FC, ("weight1", "weight2")):
        weights = state_dict.pop(prefix + stacked)
        for e in range(module.num_local_experts):
            state_dict[_expert_key(prefix, e, fc, "weight")] = weights[e]
            state_dict[_expert_key(prefix, e, fc, "_extra_state")] = None


def _stacked_state_dict(module: GroupedExperts, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: ``SequentialMLP``'s per-expert keys -> stacked weights.
    Leaves ``state_dict`` alone when an expert is missing (``load_state_dict`` then names it)."""
    for fc, stacked in zip(_FC, ("weight1", "weight2")):
        keys = [_expert_key(prefix, e, fc, "weight") for e in range(module.num_local_experts)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + stacked] = torch.stack([state_dict.pop(k) for k in keys])
        for e in range(module.num_local_experts):
            state_dict.pop(_expert_key(prefix, e, fc, "_extra_state"), None)
