"""KDA (Kimi delta attention) for the ``self_attention`` slot of megatron-core's ``TransformerLayer``:
GLM-5.3's linear-attention layer (transformers' ``Glm5NextTextLinearAttention``, same math).

Per layer (``H`` heads of size ``D``, ``H_l = H / TP`` on this rank, ``K_c`` conv taps)::

    q, k, v = W_q x, W_k x, W_v x                                [s, b, H_l * D] each
    q, k, v = SiLU(causal depthwise conv_{K_c}(.))               per channel, fp32, per document
    f       = W_fb (W_fa x) + dt_bias                            fp32 [s, b, H_l, D]  (rank D)
    g       = lower_bound * sigmoid(exp(A_log) f)                log decay in (lower_bound, 0)
              (lower_bound None: -exp(A_log) softplus(f))
    beta    = sigmoid(W_beta x)                                  [s, b, H_l]
    o       = delta_rule(q, k, v, g, beta, scale = D^-1/2)       [b, s, H_l, D]  (backends.py)
    o       = RMSNorm_D(o) * w_norm * sigmoid(W_gb (W_ga x))     fp32 per head, then model dtype
    out     = W_o o                                              [s, b, h]

The delta rule (L2-normalised q/k, per-channel decay) is
:mod:`kpool_layers.linear_attention.delta_rule`'s. The conv, the gate ``g``, the delta rule and the
gated norm run on the kernels of ``config.linear_attention_kernels`` (resolved ``torch`` or ``fla``;
``backends.py``, contracts in ``layer_ops.py``), each in float32 and rounded once. The conv
weights, ``dt_bias`` and ``A_log`` are created in float32 and take the model's dtype like every
other parameter (BF16 under the bf16 profiles, with FP32 master copies in the optimizer: an FP32
parameter inside a BF16 model fails megatron 0.19.2's distributed-optimizer checkpoint save); the
layer computes with them in float32. transformers keeps them in float32, so a BF16 model holds
them rounded to BF16 (relative 2^-9), as the mHC weights (docs/hyper_connections.md).

Tensor parallelism splits the heads: ``W_q``, ``W_k``, ``W_v``, ``W_beta``, ``W_fb`` and ``W_gb`` are
column-parallel (each rank holds its heads' rows, contiguous ``[h * D, (h + 1) * D)`` blocks of
``H * D``), so are the conv weights (``[H_l * D, K_c]`` per q/k/v), ``dt_bias`` ``[H_l * D]`` and
``A_log`` ``[H_l]``; ``W_o`` is row-parallel. The rank-``D`` down projections ``W_fa`` / ``W_ga`` are
column-parallel linears whose outputs are gathered over TP (scattered back to the sequence slice
under SP), so every rank gets the full ``D`` channels and the up projection's input all-reduce sums
their gradient over all heads. The output norm's weight ``[D]`` is shared by all heads: it enters
through ``copy_to_tensor_model_parallel_region``, so its gradient is summed over the TP ranks.
Under sequence parallelism the column-parallel linears gather the sequence (the conv and the
recurrence need all of it) and ``W_o`` reduce-scatters it.

Context parallelism (CP ranks, megatron's load-balanced layout of
:mod:`kpool_layers.dsa.context_parallel`: rank ``r`` holds sequence chunks ``r`` and
``2 CP - 1 - r`` of ``2 CP``) is megatron's GatedDeltaNet scheme
(``megatron.core.ssm.gated_delta_net.common``): q, k, v (before the conv), the log decay ``g`` and
``beta``, computed on this rank's ``s / CP`` tokens for all ``H_l`` heads, go through an
all-to-all that turns the sequence shard into a head shard (``tensor_a2a_cp2hp``: CP rank ``c``
gets heads ``[c H_l / CP, (c + 1) H_l / CP)`` of the whole sequence, the load-balanced chunk order
undone), the conv (with those heads' rows of the conv weights, ``get_parameter_local_cp``) and
the delta rule run on the whole sequence in order, and the inverse all-to-all
(``tensor_a2a_hp2cp``, the chunk order redone) hands each rank its tokens back for all ``H_l``
heads before the gated norm and ``W_o``. ``H`` must divide by ``TP * CP``. The parameters do not
depend on CP: every CP rank holds all of its TP rank's KDA weights, and a weight's gradient on one
CP rank is that rank's tokens' (or heads') part, summed over CP by megatron's DDP reduction over
the data-parallel x CP ranks (as for every parameter).

Packed THD (``packed_seq_params.qkv_format == 'thd'``, ``b == 1``): the conv and the recurrence
restart at every boundary of ``cu_seqlens_q`` (``cu_seqlens_q_padded`` when set); tokens past its
last entry form one more document. Under CP the boundaries describe the whole row (the row is
split like an unpacked one, documents may straddle ranks); they apply to the whole sequence the
all-to-all gathers. ``attention_mask`` is not read.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net.common import (
    get_parameter_local_cp,
    tensor_a2a_cp2hp,
    tensor_a2a_hp2cp,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import get_pg_size
from torch import Tensor

from kpool_layers.compat.attention_slot import AttentionSlotLayer
from kpool_layers.config import GLMTransformerConfig
from kpool_layers.linear_attention.backends import layer_kernels
from kpool_layers.linear_attention.layer_ops import KDAKernels, document_index
from kpool_layers.precision.linears import RoleColumnParallelLinear, RoleRowParallelLinear, role_spec
from kpool_layers.precision.policy import Role


@dataclass
class KDASubmodules:
    """Builders of :class:`KimiDeltaAttention`'s linears (ModuleSpec or class each): megatron's
    ColumnParallelLinear constructor arguments for all but ``linear_proj`` (RowParallelLinear's)."""

    linear_q: ModuleSpec | type
    linear_k: ModuleSpec | type
    linear_v: ModuleSpec | type
    linear_f_a: ModuleSpec | type
    linear_f_b: ModuleSpec | type
    linear_beta: ModuleSpec | type
    linear_g_a: ModuleSpec | type
    linear_g_b: ModuleSpec | type
    linear_proj: ModuleSpec | type


def kda_spec(config: GLMTransformerConfig) -> ModuleSpec:
    """:class:`KimiDeltaAttention` on megatron's local parallel linears, tagged with their precision
    roles (``kda.qkv`` for q/k/v, ``kda.gate`` for the forget/output gate projections and beta,
    ``kda.out``; :mod:`kpool_layers.precision.linears`), with the delta rule of
    ``config.linear_attention_kernels``'s conv, gate, delta rule and gated norm."""
    col = partial(role_spec, RoleColumnParallelLinear)
    return ModuleSpec(
        module=KimiDeltaAttention,
        submodules=KDASubmodules(
            linear_q=col(Role.KDA_QKV), linear_k=col(Role.KDA_QKV), linear_v=col(Role.KDA_QKV),
            linear_f_a=col(Role.KDA_GATE), linear_f_b=col(Role.KDA_GATE),
            linear_beta=col(Role.KDA_GATE), linear_g_a=col(Role.KDA_GATE),
            linear_g_b=col(Role.KDA_GATE), linear_proj=role_spec(RoleRowParallelLinear, Role.KDA_OUT)),
        params={"kernels": layer_kernels(config.linear_attention_kernels)},
    )


def _check_config(config: GLMTransformerConfig, tp: int, cp: int) -> None:
    if config.linear_num_key_heads != config.linear_num_value_heads:
        raise ValueError(f"KDA has one head count: linear_num_key_heads="
                         f"{config.linear_num_key_heads} must equal linear_num_value_heads="
                         f"{config.linear_num_value_heads}")
    if config.linear_key_head_dim != config.linear_value_head_dim:
        raise ValueError(f"KDA has one head size: linear_key_head_dim={config.linear_key_head_dim}"
                         f" must equal linear_value_head_dim={config.linear_value_head_dim}")
    if config.linear_num_key_heads % tp or config.linear_key_head_dim % tp:
        raise ValueError(f"KDA splits heads and the rank-D gate projections over TP: "
                         f"linear_num_key_heads={config.linear_num_key_heads} and "
                         f"linear_key_head_dim={config.linear_key_head_dim} must be multiples of "
                         f"tensor_model_parallel_size={tp}")
    if config.linear_num_key_heads % (tp * cp):
        raise ValueError(f"KDA splits its heads over TP x CP: linear_num_key_heads="
                         f"{config.linear_num_key_heads} must be a multiple of "
                         f"tensor_model_parallel_size * context_parallel_size = {tp} * {cp}")
    if config.add_bias_linear:
        raise ValueError("KDA has no linear biases; set add_bias_linear=False")


def _tp_parameter(shape: tuple[int, ...], device: Any) -> torch.nn.Parameter:
    """A parameter created in float32 and split over TP along dim 0 (megatron's attributes for
    its optimizer); the model's cast gives it the model dtype."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device))
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = 0  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]
    return param


class KimiDeltaAttention(AttentionSlotLayer):
    """KDA; see the module docstring for the math, the TP split and the packed-document rules.

    ``forward(hidden_states [s/TP if SP else s, b, h], ...)`` -> ``(output [same shape], None)``.
    Built from :func:`kda_spec`; ``kernels`` are the conv, gate, delta rule and gated norm
    (:class:`~kpool_layers.linear_attention.layer_ops.KDAKernels`).
    ``attn_mask_type``, ``cp_comm_type``, ``pp_layer_offset`` and ``name`` are accepted for
    ``TransformerLayer``'s call and not used.
    """

    def __init__(
        self,
        config: GLMTransformerConfig,
        submodules: KDASubmodules,
        layer_number: int,
        kernels: KDAKernels,
        attn_mask_type: Any = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        cp_comm_type: Optional[str] = None,
        pp_layer_offset: Optional[int] = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.kernels = kernels
        self.pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["tp", "cp"])
        self.tp_group = self.pg_collection.tp
        self.cp_group = self.pg_collection.cp
        tp = get_pg_size(self.tp_group)
        _check_config(config, tp, get_pg_size(self.cp_group))
        self.sequence_parallel = config.sequence_parallel and tp > 1
        self.head_dim = config.linear_key_head_dim
        self.local_heads = config.linear_num_key_heads // tp
        self.lower_bound = config.linear_gate_lower_bound
        width = config.linear_num_key_heads * self.head_dim
        local = self.local_heads * self.head_dim

        def linear(spec: ModuleSpec | type, n_in: int, n_out: int, label: str) -> torch.nn.Module:
            return build_module(spec, n_in, n_out, config=config, init_method=config.init_method,
                                bias=False, skip_bias_add=False, is_expert=False, gather_output=False,
                                tp_comm_buffer_name=label, tp_group=self.tp_group)

        h = config.hidden_size
        self.linear_q = linear(submodules.linear_q, h, width, "kda_q")
        self.linear_k = linear(submodules.linear_k, h, width, "kda_k")
        self.linear_v = linear(submodules.linear_v, h, width, "kda_v")
        self.linear_f_a = linear(submodules.linear_f_a, h, self.head_dim, "kda_f_a")
        self.linear_f_b = linear(submodules.linear_f_b, self.head_dim, width, "kda_f_b")
        self.linear_beta = linear(submodules.linear_beta, h, config.linear_num_key_heads, "kda_beta")
        self.linear_g_a = linear(submodules.linear_g_a, h, self.head_dim, "kda_g_a")
        self.linear_g_b = linear(submodules.linear_g_b, self.head_dim, width, "kda_g_b")
        self.linear_proj = build_module(
            submodules.linear_proj, width, h, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="kda_proj",
            tp_group=self.tp_group)

        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        taps = config.linear_conv_kernel_dim
        self.conv_q = _tp_parameter((local, taps), device)
        self.conv_k = _tp_parameter((local, taps), device)
        self.conv_v = _tp_parameter((local, taps), device)
        self.dt_bias = _tp_parameter((local,), device)
        self.A_log = _tp_parameter((self.local_heads,), device)
        self.out_norm_weight = torch.nn.Parameter(
            torch.ones(self.head_dim, dtype=config.params_dtype, device=device))
        self.reset_parameters()

    TP_SHARDED = ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")
    """The module's own parameters split over TP along dim 0."""

    def reset_parameters(self) -> None:
        """transformers' initialisation: conv ``U(-1/sqrt(K_c), 1/sqrt(K_c))`` (PyTorch's
        ``Conv1d`` default), ``A_log`` 0 with a lower bound (else ``log U(1, 16)``), ``dt_bias``
        the inverse softplus of ``exp(U(log 1e-3, log 1e-1))``, output norm weight 1.

        As megatron initialises its parallel linears: with ``use_cpu_initialization`` each
        tensor is drawn whole from the default generator (the same on every TP rank) and this
        rank's rows are kept, so the model does not depend on TP; otherwise each rank draws its
        shard under the model-parallel RNG tracker."""
        if not self.config.perform_initialization:
            return
        tp = get_pg_size(self.tp_group)
        rank = self.tp_group.rank() if tp > 1 else 0
        whole = self.config.use_cpu_initialization

        def draw(param: torch.nn.Parameter, fill: Any) -> None:
            if not whole:
                param.copy_(fill(torch.empty_like(param)))
                return
            full = fill(torch.empty((param.shape[0] * tp, *param.shape[1:]), dtype=param.dtype))
            param.copy_(full.chunk(tp, dim=0)[rank])

        def inverse_softplus_dt(t: Tensor) -> Tensor:
            dt = t.uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            return dt + torch.log(-torch.expm1(-dt))

        rng = contextlib.nullcontext() if whole else get_cuda_rng_tracker().fork()
        with rng, torch.no_grad():
            bound = 1.0 / math.sqrt(self.conv_q.shape[1])
            for conv in (self.conv_q, self.conv_k, self.conv_v):
                draw(conv, lambda t: t.uniform_(-bound, bound))
            if self.lower_bound is not None:
                self.A_log.zero_()
            else:
                draw(self.A_log, lambda t: t.uniform_(1.0, 16.0).log())
            draw(self.dt_bias, inverse_softplus_dt)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """megatron's default, with the conv weights, ``dt_bias`` and ``A_log`` sharded over TP."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {name: getattr(self, name) for name in self.TP_SHARDED}
        sharded.update(make_sharded_tensors_for_checkpoint(
            own, prefix, {name: 0 for name in self.TP_SHARDED}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        return sharded

    def _low_rank(self, down: torch.nn.Module, up: torch.nn.Module, x: Tensor) -> Tensor:
        """``up(down(x))`` with ``down``'s rank-``D`` output gathered over TP (and scattered back
        to this rank's sequence slice under SP) -> ``[s, b, H_l * D]``."""
        mid, _ = down(x)
        out, _ = up(self.full_width(mid, self.head_dim))
        return out

    def _decay(self, x: Tensor) -> Tensor:
        """The forget gate's log decay, float32 ``[s, b, H_l, D]``."""
        f = self._low_rank(self.linear_f_a, self.linear_f_b, x)
        return self.kernels.decay(f.unflatten(-1, (self.local_heads, self.head_dim)), self.A_log,
                                  self.dt_bias, self.lower_bound)

    def _gated_norm(self, o: Tensor, gate: Tensor) -> Tensor:
        """``RMSNorm_D(o) * w * sigmoid(gate)`` per head (float32 math, ``o``'s dtype); ``o, gate
        [..., D]``."""
        weight = copy_to_tensor_model_parallel_region(self.out_norm_weight, group=self.tp_group)
        return self.kernels.gated_norm(o, gate, weight, self.config.layernorm_epsilon)

    def _to_heads(self, x: Tensor) -> Tensor:
        """``[s / CP, b, H_l * C]`` (this CP rank's tokens, SP gathered; all ``H_l`` heads, ``C``
        channels per head) -> ``[b, s, H_l / CP, C]`` (the whole sequence in order, this CP rank's heads);
        the all-to-all of megatron's GatedDeltaNet, the identity without CP."""
        if get_pg_size(self.cp_group) > 1:
            x = tensor_a2a_cp2hp(x, seq_dim=0, head_dim=-1, cp_group=self.cp_group)
        return x.transpose(0, 1).unflatten(-1, (self._cp_heads(), -1))

    def _from_heads(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`_to_heads`: ``[b, s, H_l / CP, C]`` -> ``[s / CP, b, H_l, C]``."""
        x = x.flatten(2).transpose(0, 1)
        if get_pg_size(self.cp_group) > 1:
            x = tensor_a2a_hp2cp(x.contiguous(), seq_dim=0, head_dim=-1, cp_group=self.cp_group)
        return x.unflatten(-1, (self.local_heads, -1))

    def _cp_heads(self) -> int:
        """Heads this rank runs the conv and the delta rule for: ``H / (TP * CP)``."""
        return self.local_heads // get_pg_size(self.cp_group)

    def _cp_local(self, param: Tensor) -> Tensor:
        """This CP rank's heads' rows of a per-channel parameter (all of them without CP)."""
        return get_parameter_local_cp(param, dim=0, cp_group=self.cp_group)

    def attend(self, hidden_states: Tensor, packed_seq_params: Optional[PackedSeqParams],
               cu_seqlens: Optional[Tensor]) -> tuple[Tensor, None]:
        """``hidden_states [s_local, b, h]`` -> ``(output [s_local, b, h], None)``; the THD
        boundaries ``cu_seqlens`` (of the whole row) restart the conv and the recurrence (the
        base's ``forward`` takes ``TransformerLayer``'s arguments and rejects inference and
        cross-attention). Under CP the conv and the delta rule see the whole sequence for
        ``H / (TP * CP)`` heads (module docstring)."""

        q, k, v = (self._to_heads(lin(hidden_states)[0])
                   for lin in (self.linear_q, self.linear_k, self.linear_v))  # [b, s, H_l/CP, D]
        s = q.shape[1]  # the full sequence (SP and CP gathered)
        docs = document_index(s, cu_seqlens, q.device)
        q, k, v = (self.kernels.conv(t.flatten(2), self._cp_local(w), docs).unflatten(-1, t.shape[2:])
                   for t, w in ((q, self.conv_q), (k, self.conv_k), (v, self.conv_v)))
        g = self._to_heads(self._decay(hidden_states).flatten(2))                     # [b, s, H_l/CP, D]
        beta = self._to_heads(torch.sigmoid(self.linear_beta(hidden_states)[0]))[..., 0]  # [b, s, H_l/CP]
        o = self.kernels.delta_rule(q, k, v, g, beta, self.head_dim ** -0.5, docs.bounds)  # [b, s, H_l/CP, D]
        o = self._from_heads(o)                                                        # [s/CP, b, H_l, D]
        gate = self._low_rank(self.linear_g_a, self.linear_g_b, hidden_states)
        o = self._gated_norm(o, gate.unflatten(-1, (self.local_heads, self.head_dim)))
        out, _ = self.linear_proj(o.flatten(2).contiguous())                           # [s_local, b, h]
        return out, None
