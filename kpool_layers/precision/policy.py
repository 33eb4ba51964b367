"""Precision policy for GLM-5.x training and the FP8 linear backends that carry it out.

* :class:`PrecisionPolicy` - the ``precision`` config group (but ``drift``) as one frozen value:
  the model dtype, which linear *role* (:class:`Role`) runs quantized and in which dtype, and the
  indexer's numerics (:func:`kpool_layers.dsa.numerics.indexer_numerics`). The profiles are the YAML files
  of ``conf/precision``; the recipes build the policy once (:meth:`PrecisionPolicy.from_config`)
  and keep it on the model's config (``GLMTransformerConfig.precision``).
* :func:`quantized_matmul` - ``y = x @ w.T`` with both operands quantized to e4m3 under a recipe
  (:mod:`kpool_layers.precision.fp8`), on the ``torch`` (fused Triton quantization, :func:`quantizer`, and
  ``torch._scaled_mm`` / ``F.scaled_mm``, CUDA) or ``emulate`` (quantize-dequantize, any device)
  backend. Backward (``precision.fp8_backward``): straight-through in the model dtype (fused Triton
  dequantization on ``torch``, :func:`dequantizer`), or FP8 dgrad and wgrad GEMMs
  (:func:`fp8_dgrad`: ``dy`` in 1x128 tiles along N times the forward's 128x128 weight blocks;
  :func:`fp8_wgrad`: ``dy^T`` and ``x^T`` in 1x128 tiles along the tokens; DeepSeek-V3 report 3.3.2,
  Transformer Engine ``Float8BlockScaling``), ``F.scaled_mm`` on ``torch``, FP32 GEMMs of the
  dequantized operands on ``emulate``; each gradient rounded once to the model dtype. Error bound
  and layouts: docs/precision.md "FP8 backward"; the routed experts keep the straight-through
  backward (:data:`BF16_BACKWARD_ROLES`).
* :class:`LinearNumerics` - how the linear of one role computes under a policy; the role-tagged
  linears of :mod:`kpool_layers.precision.linears` hold theirs from the build on.

Layouts: activations ``x [..., K]`` (megatron passes ``[s, b, K]``), weights ``w [N, K]``
(``nn.Linear`` / megatron layout, output partition first), outputs ``[..., N]``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from kpool_layers.kernel_routes import KernelBackend, Machine, Route, needs_cuda, needs_package, register

from kpool_layers.precision import fp8
from kpool_layers.precision import fp8_format
from kpool_layers.precision.fp8_format import Recipe, ScaleFormat
from kpool_layers.precision.weight_cache import derived_weight, quantized_weight
from kpool_layers.compat.wgrad_accumulation import accumulate_into_main_grad, add_into_main_grad

class Role(str, enum.Enum):
    """The fixed set of linear roles of a GLM-5.x model."""

    MLA_Q_DOWN = "mla.q_down"
    MLA_Q_UP = "mla.q_up"
    MLA_KV_DOWN = "mla.kv_down"
    MLA_KV_UP = "mla.kv_up"
    MLA_OUT = "mla.out"
    INDEXER_Q = "indexer.q"
    INDEXER_K = "indexer.k"
    INDEXER_WEIGHTS = "indexer.weights"
    INDEXER_KPOOL_GATE = "indexer.kpool_gate"
    KDA_QKV = "kda.qkv"
    KDA_GATE = "kda.gate"
    KDA_OUT = "kda.out"
    MLP_FC1 = "mlp.fc1"
    MLP_FC2 = "mlp.fc2"
    MOE_EXPERT_FC1 = "moe.expert_fc1"
    MOE_EXPERT_FC2 = "moe.expert_fc2"
    MOE_SHARED_FC1 = "moe.shared_fc1"
    MOE_SHARED_FC2 = "moe.shared_fc2"
    MOE_ROUTER = "moe.router"
    MHC_PROJ = "mhc.proj"
    EMBEDDING = "embedding"
    OUTPUT = "output"


_MLA_ROLES = {Role.MLA_Q_DOWN, Role.MLA_Q_UP, Role.MLA_KV_DOWN, Role.MLA_KV_UP, Role.MLA_OUT}
_INDEXER_QK_ROLES = {Role.INDEXER_Q, Role.INDEXER_K, Role.INDEXER_KPOOL_GATE}
_KDA_PROJ_ROLES = {Role.KDA_QKV, Role.KDA_OUT}
"""KDA's q/k/v and output projections: attention projections like MLA's (the same switch)."""
_NEVER_QUANTIZED = {Role.MOE_ROUTER, Role.MHC_PROJ, Role.EMBEDDING, Role.OUTPUT, Role.KDA_GATE}
"""``kda.gate`` (the rank-D forget/output gate projections and beta) feeds exp/sigmoid decays."""
_FP32_ROLES = {Role.MOE_ROUTER, Role.MHC_PROJ}
BF16_BACKWARD_ROLES = frozenset({Role.MOE_EXPERT_FC1, Role.MOE_EXPERT_FC2})
"""FP8 roles whose backward stays straight-through BF16 under ``precision.fp8_backward=fp8``: the
routed experts. Their grouped GEMMs (:mod:`kpool_layers.moe.grouped_gemm`) run over the tokens of
all local experts stacked, and an FP8 wgrad quantizes the tokens of each expert in 1x128 tiles of
its own, whose boundaries the stacked layout does not align to 128; megatron's per-expert
``SequentialMLP`` linears keep the same backward, so the two expert layouts stay bit-equal."""


class DType(enum.StrEnum):
    """A floating-point dtype of the precision keys (``precision.dtype``)."""

    bf16 = "bf16"
    fp32 = "fp32"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype it names."""
        return torch.bfloat16 if self is DType.bf16 else torch.float32


class WeightsProjDtype(enum.StrEnum):
    """dtype of the indexer head-weights projection (``precision.dsa_indexer_weights_proj_dtype``)."""

    fp32 = "fp32"
    bf16 = "bf16"
    inherit = "inherit"
    """The model's dtype."""


class Fp8Backward(enum.StrEnum):
    """What the backward of an FP8 linear computes (``precision.fp8_backward``)."""

    bf16 = "bf16"
    """Straight-through: ``dx = dy @ Q(w)``, ``dw = dy^T @ Q(x)`` as GEMMs in the model dtype (BF16; FP32
    under ``precision.dtype=fp32``) of the forward's dequantized operands, ``dy`` unquantized."""
    fp8 = "fp8"
    """FP8 dgrad and wgrad GEMMs (``blockwise`` only): ``dx = Q(dy) @ Q(w)`` with ``dy`` in 1x128 tiles
    along N and the forward's 128x128 weight blocks; ``dw = Q(dy^T) @ Q(x^T)^T`` with both operands
    in 1x128 tiles along the tokens (:func:`fp8_dgrad`, :func:`fp8_wgrad`)."""


class Backend(enum.StrEnum):
    """Where FP8 GEMMs run (``precision.backend``); :func:`resolve_backend` makes ``auto`` concrete."""

    auto = "auto"
    """``torch`` on an FP8 GPU, else ``emulate``."""
    torch = "torch"
    """``torch._scaled_mm`` / ``F.scaled_mm`` on a CUDA GPU with FP8 (sm_89+)."""
    emulate = "emulate"
    """FP32 GEMM of the quantize-dequantized operands, any device."""


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """The numerics of a run: the ``precision`` config group but ``drift``, field for field (the
    schema ``recipes.config.schema.PrecisionConfig`` is made from these fields). Enum fields accept their
    string values."""

    name: str = "bf16"
    """The profile (``conf/precision/<name>.yaml``) the policy was composed from."""
    dtype: DType = DType.bf16
    """Parameter and compute dtype of the model."""
    fp8: bool = False
    """Run the quantizable linears in FP8 (False = the model dtype everywhere)."""
    recipe: Recipe = Recipe.blockwise
    """FP8 scaling recipe."""
    backend: Backend = Backend.auto
    """Where the FP8 GEMMs run."""
    scale_format: ScaleFormat = ScaleFormat.ue8m0
    """FP8 scale format (training GEMMs and the serving-quantized index scoring)."""
    dsa_indexer_qk_proj_disable_quantization: bool = False
    """Keep the indexer q/k projections (and the KPool gate) unquantized."""
    mla_proj_disable_quantization: bool = False
    """Keep the MLA q/kv down/up and output projections unquantized."""
    dsa_indexer_kpool_use_quantization: bool = False
    """Score with :func:`kpool_layers.precision.fp8.serving_index_quant`-ed index q and (pooled) k."""
    dsa_indexer_weights_proj_dtype: WeightsProjDtype = WeightsProjDtype.inherit
    """dtype of the indexer head-weights projection."""
    dsa_indexer_weights_proj_disable_quantization: bool = False
    """Keep the indexer head-weights projection unquantized."""
    dsa_indexer_k_norm_fp32: bool = False
    """Compute the indexer key LayerNorm in FP32."""
    fp8_backward: Fp8Backward = Fp8Backward.bf16
    """What the FP8 linears' backward computes (:class:`Fp8Backward`); ``fp8`` needs ``recipe=blockwise``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            kind = _field_types()[f.name]
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                object.__setattr__(self, f.name, _member(kind, f.name, getattr(self, f.name)))
        if (
            self.fp8
            and self.dsa_indexer_weights_proj_dtype == WeightsProjDtype.fp32
            and not self.dsa_indexer_weights_proj_disable_quantization
        ):
            raise ValueError(
                "precision.dsa_indexer_weights_proj_dtype=fp32 with precision.fp8=true needs "
                "precision.dsa_indexer_weights_proj_disable_quantization=true (an FP32 projection "
                "cannot also be an FP8 GEMM)"
            )
        if self.fp8 and self.fp8_backward == Fp8Backward.fp8 and self.recipe != Recipe.blockwise:
            raise ValueError(
                f"precision.fp8_backward=fp8 with precision.recipe={self.recipe.value} is not supported; "
                "allowed: precision.recipe=blockwise (the FP8 dgrad/wgrad GEMMs are blockwise) or "
                "precision.fp8_backward=bf16"
            )

    @classmethod
    def from_config(cls, precision_cfg: Any) -> "PrecisionPolicy":
        """The policy of a ``precision`` config node (a DictConfig or a schema object); its
        ``drift`` settings are not part of the policy."""
        return cls(**{f.name: getattr(precision_cfg, f.name) for f in dataclasses.fields(cls)})

    @property
    def params_dtype(self) -> torch.dtype:
        """The model's parameter and compute dtype."""
        return self.dtype.torch_dtype

    def quantized(self, role: Role | str) -> bool:
        """Whether the linear of ``role`` runs as an FP8 GEMM under this policy."""
        role = Role(role)
        if not self.fp8 or role in _NEVER_QUANTIZED:
            return False
        if role in _MLA_ROLES or role in _KDA_PROJ_ROLES:
            return not self.mla_proj_disable_quantization
        if role in _INDEXER_QK_ROLES:
            return not self.dsa_indexer_qk_proj_disable_quantization
        if role is Role.INDEXER_WEIGHTS:
            return not self.dsa_indexer_weights_proj_disable_quantization
        return True

    def fp8_backward_gemms(self, role: Role | str) -> bool:
        """Whether the linear of ``role`` runs FP8 dgrad / wgrad GEMMs: quantized, under
        ``fp8_backward=fp8``, and not a routed expert (:data:`BF16_BACKWARD_ROLES`)."""
        role = Role(role)
        return self.quantized(role) and self.fp8_backward == Fp8Backward.fp8 and role not in BF16_BACKWARD_ROLES

    def compute_dtype(self, role: Role | str, params_dtype: torch.dtype) -> torch.dtype:
        """The dtype the linear of ``role`` computes in (inputs and output; an FP8 GEMM's
        operands are quantized from / its output returned in this dtype) in a model whose
        weights are ``params_dtype``."""
        role = Role(role)
        if role in _FP32_ROLES:
            return torch.float32
        if role is Role.INDEXER_WEIGHTS and self.dsa_indexer_weights_proj_dtype != WeightsProjDtype.inherit:
            return DType(self.dsa_indexer_weights_proj_dtype.value).torch_dtype
        return params_dtype


def _member(kind: type[enum.Enum], key: str, value: Any) -> Any:
    """``kind``'s member of value ``value``; ``ValueError`` naming ``precision.<key>`` otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"precision.{key}={value!r} is not supported; "
                         f"allowed: {[m.value for m in kind]}") from None


@functools.cache
def _field_types() -> dict[str, Any]:
    """:class:`PrecisionPolicy`'s field types (its annotations are strings here)."""
    return typing.get_type_hints(PrecisionPolicy)


def _cuda_fp8_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _needs_fp8_gpu(machine: Machine) -> Optional[str]:
    """Declines without a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores)."""
    return None if _cuda_fp8_available() else "no CUDA GPU of compute capability >= 8.9"


FP8_GEMM = register(Route("fp8_gemm", (
    KernelBackend("torch", lambda: _scaled_mm, "torch._scaled_mm / F.scaled_mm FP8 GEMM, FP32 accumulation",
                  declines=(_needs_fp8_gpu,)),
    KernelBackend("emulate", lambda: None, "FP32 GEMM of the dequantized operands"),
), summary="FP8 GEMMs of the quantized roles", config_key="precision.backend"))
"""``fp8_gemm``: the ``precision.backend`` values other than ``auto``, most preferred first."""


def available_backends() -> list[Backend]:
    """Concrete backends usable in this process, most preferred first (:data:`FP8_GEMM`'s table
    without the backends that decline here)."""
    machine = Machine.here()
    return [Backend(b.name) for b in FP8_GEMM.backends if b.decline(machine) is None]


def resolve_backend(policy: PrecisionPolicy) -> str:
    """The backend ``policy``'s FP8 GEMMs run on: ``none`` without FP8, ``auto`` -> the first of
    :func:`available_backends`; a concrete backend must be available. Recorded in :data:`FP8_GEMM`."""
    if not policy.fp8:
        return "none"
    available = available_backends()
    if policy.backend == Backend.auto:
        return FP8_GEMM.resolve().backend
    if policy.backend not in available:
        raise ValueError(
            f"precision.backend={policy.backend.value!r} is not available here; "
            f"available: {[b.value for b in available]}"
        )
    return FP8_GEMM.resolve(policy.backend.value).backend


# ---------------------------------------------------------------------------------------------
# Quantized GEMM
# ---------------------------------------------------------------------------------------------


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """``t [R, C]`` padded at the end to ``[rows, cols]`` with ``value`` (no copy if no padding)."""
    pad_r, pad_c = rows - t.shape[0], cols - t.shape[1]
    if not (pad_r or pad_c):
        return t
    if t.dtype == torch.float8_e4m3fn:  # F.pad has no FP8 kernel: pad the bytes (0x00 is +0.0)
        return _pad_to(t.view(torch.uint8), rows, cols).view(torch.float8_e4m3fn)
    return torch.nn.functional.pad(t, (0, pad_c, 0, pad_r), value=value)


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _scaled_mm(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, recipe: str
) -> torch.Tensor:
    """FP8 GEMM on CUDA: ``xq [M, K]`` e4m3 (scales from :func:`fp8.quantize`, activation),
    ``wq [N, K]`` e4m3 (weight scales) -> BF16 ``[M, N]``, FP32 accumulation.

    ``torch._scaled_mm`` wants ``mat2`` column-major (``wq.t()`` of a row-major weight is) and
    M, K, N multiples of 16; ``F.scaled_mm``'s BlockWise1x128 / BlockWise128x128 want multiples of
    128. Operands are zero-padded up to those multiples (GLM-5's ``mla.kv_down`` has N = 576, the
    indexer weights N = 32) and the output sliced back: padded K columns are zero in both operands,
    so they add nothing; padded rows / columns are dropped. The quantization tiles are unchanged
    (:func:`fp8.quantize` already scales partial edge tiles by their own amax), so the result equals
    the emulate backend's up to FP32 accumulation order. Scale layouts: 1x128 scales
    ``[M, K/128]`` column-major, 128x128 scales ``[ceil4(K/128), N/128]`` column-major with the K
    blocks padded to a multiple of 4 (the layout of torch's own OpInfo samples for these recipes)."""
    m, k = xq.shape
    n = wq.shape[0]
    if m == 0:  # e.g. an MoE expert that received no tokens
        return xq.new_zeros((0, n), dtype=torch.bfloat16)
    align = fp8_format.BLOCK if recipe == "blockwise" else 16
    mp, kp, np_ = _ceil(m, align), _ceil(k, align), _ceil(n, align)
    a = _pad_to(xq.contiguous(), mp, kp)
    mat_b = _pad_to(wq.contiguous(), np_, kp).t()  # column-major B [Kp, Np]
    if recipe == "tensorwise":
        out = torch._scaled_mm(a, mat_b, xs.reshape(()), ws.reshape(()), out_dtype=torch.bfloat16)
    elif recipe == "rowwise":
        sa = _pad_to(xs.reshape(m, 1), mp, 1, value=1.0)
        sb = _pad_to(ws.reshape(n, 1), np_, 1, value=1.0).reshape(1, np_).contiguous()
        out = torch._scaled_mm(a, mat_b, sa, sb, out_dtype=torch.bfloat16)
    else:
        out = _blockwise_scaled_mm(a, xs, mat_b, ws, "weight")
    return out[:m, :n]


def _blockwise_scaled_mm(
    a: torch.Tensor, sa: torch.Tensor, mat_b: torch.Tensor, sb: torch.Tensor, b_operand: str
) -> torch.Tensor:
    """``F.scaled_mm`` of ``a [Mp, Kp]`` e4m3 row-major with 1x128 scales ``sa [M', Kp/128]``
    (``M' <= Mp``: rows of scales for the unpadded rows, padded here with 1.0) by ``mat_b
    [Kp, Np]`` e4m3 column-major (the transpose of a row-major ``[Np, Kp]``), M, K, N multiples of
    128 -> BF16 ``[Mp, Np]``, FP32 accumulation. ``b_operand="weight"``: ``sb [N'/128, Kp/128]``
    128x128 block scales (BlockWise128x128, passed as ``[ceil4(Kp/128), Np/128]`` column-major);
    ``"activation"``: ``sb [N', Kp/128]`` 1x128 scales along K (BlockWise1x128, passed as
    ``[Np, Kp/128]`` column-major), the layouts of torch's own ``scaled_mm`` OpInfo samples."""
    F = torch.nn.functional
    mp, kp = a.shape
    np_ = mat_b.shape[1]
    kb = kp // fp8_format.BLOCK
    sa = _pad_to(sa, mp, kb, value=1.0).t().contiguous().t()  # [Mp, Kp/128] column-major
    if b_operand == "weight":
        sb = _pad_to(sb, np_ // fp8_format.BLOCK, _ceil(kb, 4), value=1.0).contiguous().t()
        recipe_b = F.ScalingType.BlockWise128x128
    else:
        sb = _pad_to(sb, np_, kb, value=1.0).t().contiguous().t()  # [Np, Kp/128] column-major
        recipe_b = F.ScalingType.BlockWise1x128
    return F.scaled_mm(a, mat_b, sa, F.ScalingType.BlockWise1x128, sb, recipe_b, output_dtype=torch.bfloat16)


def _blockwise_gemm(
    aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, b_operand: str, backend: str
) -> torch.Tensor:
    """``Q(a) @ Q(b).T`` of e4m3 ``aq [M, K]`` (1x128 tiles along K, scales ``sa``) and ``bq [N, K]``
    (``b_operand``: ``"weight"`` 128x128 blocks or ``"activation"`` 1x128 tiles along K, scales
    ``sb``) -> ``[M, N]``: ``torch`` BF16 from ``F.scaled_mm`` (zero-padded to multiples of 128,
    as :func:`_scaled_mm`), ``emulate`` FP32 from the FP32 GEMM of the dequantized operands."""
    if backend != "torch":
        return (fp8.dequantize(aq, sa, Recipe.blockwise, "activation")
                @ fp8.dequantize(bq, sb, Recipe.blockwise, b_operand).t())
    m, k = aq.shape
    n = bq.shape[0]
    if m == 0 or n == 0 or k == 0:
        return aq.new_zeros((m, n), dtype=torch.bfloat16)
    mp, kp, np_ = (_ceil(d, fp8_format.BLOCK) for d in (m, k, n))
    a = _pad_to(aq.contiguous(), mp, kp)
    mat_b = _pad_to(bq.contiguous(), np_, kp).t()
    return _blockwise_scaled_mm(a, sa, mat_b, sb, b_operand)[:m, :n]


def fp8_dgrad(
    grad_q: torch.Tensor, grad_scale: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, backend: str,
    wq_t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FP8 input gradient ``dx = Q(dy) @ Q(w)`` -> ``[M, K]`` (BF16 on ``torch``, FP32 on ``emulate``).

    ``grad_q [M, N]`` / ``grad_scale [M, ceil(N/128)]``: ``dy`` quantized in 1x128 tiles along N (the
    reduction dim; :func:`fp8.quantize` ``"activation"``); ``wq [N, K]`` / ``ws [ceil(N/128),
    ceil(K/128)]``: the forward's weight, 128x128 blocks, which are also the blocks of ``w^T``
    (``ws.T``). ``emulate`` multiplies ``dequantize(dy) [M, N] @ dequantize(w) [N, K]`` in FP32;
    ``torch`` runs ``F.scaled_mm`` BlockWise1x128 x BlockWise128x128 on ``dy`` by ``w^T``'s e4m3
    bytes made row-major (``wq_t [K, N]``, ``wq.t().contiguous()`` unless given: the weight cache
    keeps it for the step)."""
    if backend != "torch":
        return fp8.dequantize(grad_q, grad_scale, Recipe.blockwise, "activation") @ fp8.dequantize(
            wq, ws, Recipe.blockwise, "weight")
    return _blockwise_gemm(grad_q, grad_scale, wq.t().contiguous() if wq_t is None else wq_t, ws.t(),
                           "weight", backend)


def fp8_wgrad(
    grad_t_q: torch.Tensor, grad_t_scale: torch.Tensor, x_t_q: torch.Tensor, x_t_scale: torch.Tensor, backend: str
) -> torch.Tensor:
    """FP8 weight gradient ``dw = Q(dy^T) @ Q(x^T)^T`` -> ``[N, K]`` (BF16 on ``torch``, FP32 on
    ``emulate``): ``grad_t_q [N, M]`` / ``grad_t_scale [N, ceil(M/128)]`` is ``dy^T`` and ``x_t_q
    [K, M]`` / ``x_t_scale [K, ceil(M/128)]`` is ``x^T``, both quantized in 1x128 tiles along the M
    tokens (the reduction dim; :func:`fp8.quantize` ``"activation"`` of the transposes).
    ``emulate``: ``dequantize(dy^T) @ dequantize(x^T).T`` in FP32; ``torch``: ``F.scaled_mm``
    BlockWise1x128 x BlockWise1x128 (M zero-padded to a multiple of 128: zero tokens add nothing)."""
    return _blockwise_gemm(grad_t_q, grad_t_scale, x_t_q, x_t_scale, "activation", backend)


def _quant_triton() -> ModuleType:
    from kpool_layers.kernels import fp8_quant_triton

    return fp8_quant_triton


def _dequant_triton() -> ModuleType:
    from kpool_layers.kernels import fp8_dequant_triton

    return fp8_dequant_triton


_TRITON_HERE = (needs_cuda, needs_package("triton"))

FP8_QUANT = register(Route("fp8_quant", (
    KernelBackend("triton", _quant_triton, "fused Triton quantization: one kernel per operand, two for tensorwise",
                  declines=_TRITON_HERE),
    KernelBackend("torch", lambda: fp8.quantize, "kpool_layers.precision.fp8.quantize (aten ops)"),
), summary="FP8 e4m3 operand quantization of precision.backend=torch (same bytes and scales)"))
"""``fp8_quant``: the Triton kernel module (``quantize`` looked up per call) or :func:`fp8.quantize`."""

FP8_DEQUANT = register(Route("fp8_dequant", (
    KernelBackend("triton", _dequant_triton, "fused Triton dequantization, one kernel", declines=_TRITON_HERE),
    KernelBackend("torch", lambda: fp8.dequantize, "kpool_layers.precision.fp8.dequantize (aten ops)"),
), summary="FP8 e4m3 operand dequantization of precision.backend=torch (same bits)"))
"""``fp8_dequant``: the Triton kernel module (``dequantize`` looked up per call) or :func:`fp8.dequantize`."""


def _fused_kernels(backend: str, x: torch.Tensor, route: Route) -> bool:
    """Whether ``backend`` quantizes (dequantizes) operands on ``x``'s device with ``route``'s
    fused Triton kernel: ``torch`` on CUDA, where the route resolved to ``triton``."""
    return backend == "torch" and x.is_cuda and route.default().backend == "triton"


def quantizer(backend: str, x: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """How ``backend`` quantizes operands on ``x``'s device: the fused Triton kernel
    (:data:`FP8_QUANT`, :mod:`kpool_layers.kernels.fp8_quant_triton`: one kernel per operand, two
    for tensorwise) where :func:`_fused_kernels`, otherwise :func:`kpool_layers.precision.fp8.quantize`;
    both give the same bytes and scales."""
    if _fused_kernels(backend, x, FP8_QUANT):
        return FP8_QUANT.default().kernel.quantize
    return fp8.quantize


def dequantizer(backend: str, q: torch.Tensor) -> Callable[..., torch.Tensor]:
    """How ``backend`` dequantizes e4m3 operands ``q`` on their device, ``(q, scale, recipe,
    operand, out_dtype) -> out_dtype``: the fused Triton kernel (:data:`FP8_DEQUANT`,
    :mod:`kpool_layers.kernels.fp8_dequant_triton`, one kernel) where :func:`_fused_kernels`,
    otherwise :func:`kpool_layers.precision.fp8.dequantize`; both give the same bits."""
    if _fused_kernels(backend, q, FP8_DEQUANT):
        return FP8_DEQUANT.default().kernel.dequantize
    return fp8.dequantize


class _QuantizedMatmul(torch.autograd.Function):
    """``y = Q(x) @ Q(w).T``. Backward, ``fp8_backward=False`` (straight-through, BF16):
    ``dx = dy @ Q(w)``, ``dw = dy.T @ Q(x)`` computed in ``x``'s dtype from the operands kept as
    e4m3 + scales, dequantized straight into that dtype (:func:`dequantizer`).
    ``fp8_backward=True`` (``blockwise``): ``dx`` = :func:`fp8_dgrad` of ``dy`` quantized in 1x128
    tiles along N and the forward's e4m3 weight, ``dw`` = :func:`fp8_wgrad` of ``dy^T`` and ``x^T``
    quantized in 1x128 tiles along the tokens (``x^T`` quantized from ``x`` in the forward and kept
    instead of the forward's ``Q(x)``: the same bytes per element), each rounded once to ``x``'s
    dtype. Inside :func:`kpool_layers.precision.weight_cache.step_scope` the weight's e4m3 form and
    its backward operand (the dequantized copy; for the FP8 dgrad on ``torch`` the transposed e4m3
    bytes, on ``emulate`` the FP32 dequantized copy) are kept for the step's later micro-batches.
    With ``accumulate_wgrad`` ``dw`` goes straight into ``w.main_grad``
    (:func:`kpool_layers.compat.wgrad_accumulation.accumulate_into_main_grad`: FP32 accumulation, the
    product not rounded to ``x``'s dtype; the FP8 wgrad's product, already in ``x``'s dtype, through
    :func:`kpool_layers.compat.wgrad_accumulation.add_into_main_grad`)."""

    @staticmethod
    def forward(ctx, x, w, recipe, backend, scale_format, accumulate_wgrad, fp8_backward):  # noqa: ANN001, ANN205
        x2 = x.reshape(-1, x.shape[-1])
        quantize = quantizer(backend, x)
        xq, xs = quantize(x2, recipe, "activation", scale_format)
        qw = quantized_weight(w, recipe, scale_format, lambda: quantize(w, recipe, "weight", scale_format))
        wq, ws = qw.q, qw.scale
        if backend == "torch":
            y = _scaled_mm(xq, xs, wq, ws, recipe)
        else:
            y = fp8.dequantize(xq, xs, recipe, "activation") @ fp8.dequantize(wq, ws, recipe, "weight").t()
        if fp8_backward:  # the wgrad's x^T in 1x128 tiles along the tokens, in place of Q(x)
            xq, xs = quantize(x2.t(), recipe, "activation", scale_format) if ctx.needs_input_grad[1] else (None, None)
        ctx.save_for_backward(xq, xs, wq, ws)  # freed once the backward ran; the node keeps a weight
        ctx.kept_weight = qw if qw.derived is not None else None  # only for its kept backward operand
        ctx.recipe, ctx.backend, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, backend, x.shape, x.dtype, w.dtype
        ctx.scale_format, ctx.fp8_backward = scale_format, fp8_backward
        ctx.weight = w if accumulate_wgrad else None
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        if ctx.fp8_backward:
            return _QuantizedMatmul._fp8_backward(ctx, grad_out)
        xq, xs, wq, ws = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.x_dtype)
        dequantize = dequantizer(ctx.backend, xq)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_deq = derived_weight(ctx.kept_weight, ctx.x_dtype,
                                   lambda: dequantize(wq, ws, ctx.recipe, "weight", ctx.x_dtype))
            grad_x = (g @ w_deq).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_deq = dequantize(xq, xs, ctx.recipe, "activation", ctx.x_dtype)
            if ctx.weight is not None:
                grad_w = accumulate_into_main_grad(ctx.weight, x_deq, g)
            else:
                grad_w = (g.t() @ x_deq).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None

    @staticmethod
    def _fp8_backward(ctx, grad_out):  # noqa: ANN001, ANN205
        """The FP8 dgrad and wgrad (class docstring)."""
        x_t_q, x_t_s, wq, ws = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.x_dtype)
        quantize = quantizer(ctx.backend, g)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = quantize(g, Recipe.blockwise, "activation", ctx.scale_format)
            if ctx.backend == "torch":
                wq_t = derived_weight(ctx.kept_weight, "e4m3_t", lambda: wq.t().contiguous())
                dx = fp8_dgrad(gq, gs, wq, ws, ctx.backend, wq_t)
            else:
                w_deq = derived_weight(ctx.kept_weight, torch.float32,
                                       lambda: fp8.dequantize(wq, ws, Recipe.blockwise, "weight"))
                dx = fp8.dequantize(gq, gs, Recipe.blockwise, "activation") @ w_deq
            grad_x = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gtq, gts = quantize(g.t(), Recipe.blockwise, "activation", ctx.scale_format)
            dw = fp8_wgrad(gtq, gts, x_t_q, x_t_s, ctx.backend).to(ctx.x_dtype)
            grad_w = add_into_main_grad(ctx.weight, dw) if ctx.weight is not None else dw.to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None


def quantized_matmul(
    x: torch.Tensor, w: torch.Tensor, recipe: str, backend: str, scale_format: str = "ue8m0",
    accumulate_wgrad: bool = False, fp8_backward: bool = False,
) -> torch.Tensor:
    """``x [..., K] @ w[N, K].T -> [..., N]`` (x's dtype) with both operands e4m3-quantized under
    ``recipe``; ``backend`` is ``torch`` (CUDA FP8 GEMM) or ``emulate`` (FP32 GEMM of the
    dequantized operands). Differentiable (see :class:`_QuantizedMatmul`): straight-through in
    ``x``'s dtype, or with ``fp8_backward`` (``recipe="blockwise"`` only) FP8 dgrad and wgrad GEMMs;
    ``accumulate_wgrad``: ``w`` is a parameter with megatron DDP's ``main_grad``, which receives
    the weight gradient directly."""
    _member(Recipe, "recipe", recipe)
    _member(ScaleFormat, "scale_format", scale_format)
    if backend not in (Backend.torch, Backend.emulate):
        raise ValueError(f"quantized_matmul runs precision.backend='torch' or 'emulate', got {backend!r}")
    if fp8_backward and recipe != Recipe.blockwise:
        raise ValueError(f"precision.fp8_backward=fp8 runs precision.recipe='blockwise', got {recipe!r}")
    return _QuantizedMatmul.apply(x, w, recipe, backend, scale_format, accumulate_wgrad, fp8_backward)


# ---------------------------------------------------------------------------------------------
# The numerics of one linear
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearNumerics:
    """How the linear of ``role`` computes ``x @ w.T`` under ``policy``: an FP8 GEMM
    (:attr:`quantized`; the policy's recipe, scale format and backend) or a GEMM in
    :meth:`dtype`. Decided against the weight's dtype when the linear runs (a model cast after the
    build computes as its weights are). With ``note`` the linear's forward does not compute the
    role: the module that owns it uses the weight itself, in ``owner_dtype`` (None: the weight's),
    e.g. the absorbed MLA ``kv_up`` and the KPool indexer's head weights. ``accumulate_wgrad``
    (megatron's ``gradient_accumulation_fusion``, on under the trainer's DDP): an FP8 GEMM of a
    weight that has a ``main_grad`` adds its weight gradient straight into it, as megatron's
    linears do for the unreplaced roles (:mod:`kpool_layers.compat.wgrad_accumulation`)."""

    policy: PrecisionPolicy
    role: Role
    note: Optional[str] = None
    owner_dtype: Optional[torch.dtype] = None
    accumulate_wgrad: bool = False
    _replaces: dict[torch.dtype, bool] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """:meth:`replaces_gemm` per weight dtype (asked at every forward)."""

    def computed_by_owner(self, note: str, dtype: Optional[torch.dtype] = None) -> "LinearNumerics":
        """These numerics for a linear whose forward never runs: its owner computes with the
        weight in ``dtype`` (None: the weight's), for the reason ``note``."""
        return LinearNumerics(self.policy, self.role, note, dtype)

    @property
    def quantized(self) -> bool:
        """Whether the linear runs as an FP8 GEMM."""
        return self.note is None and self.policy.quantized(self.role)

    @property
    def fp8_backward(self) -> bool:
        """Whether the FP8 GEMM's backward runs FP8 dgrad / wgrad GEMMs (:class:`Fp8Backward`)."""
        return self.note is None and self.policy.fp8_backward_gemms(self.role)

    def backward(self, weight_dtype: torch.dtype) -> str:
        """What the backward GEMMs compute in, for the precision map: ``"fp8"`` (FP8 dgrad and
        wgrad) or the dtype of the GEMMs (e.g. ``"bfloat16"``; straight-through from the
        dequantized operands for an FP8 forward)."""
        return "fp8" if self.fp8_backward else str(self.dtype(weight_dtype)).removeprefix("torch.")

    def dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype the linear computes in, for a weight of ``weight_dtype``."""
        if self.note is not None:
            return self.owner_dtype or weight_dtype
        return self.policy.compute_dtype(self.role, weight_dtype)

    def replaces_gemm(self, weight_dtype: torch.dtype) -> bool:
        """Whether the linear's forward must compute with these numerics instead of its base
        class' GEMM (quantized, or a dtype other than the weight's)."""
        if weight_dtype not in self._replaces:
            self._replaces[weight_dtype] = self.note is None and (
                self.quantized or self.dtype(weight_dtype) != weight_dtype)
        return self._replaces[weight_dtype]

    @functools.cached_property
    def backend(self) -> str:
        """The FP8 GEMMs' backend (:func:`resolve_backend`, resolved at the first use: a dry run
        builds for another machine)."""
        return resolve_backend(self.policy)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype(w.dtype)
        if self.quantized:
            accumulate = self.accumulate_wgrad and dtype == w.dtype and hasattr(w, "main_grad")
            return quantized_matmul(x.to(dtype), w.to(dtype), self.policy.recipe, self.backend,
                                    self.policy.scale_format, accumulate, self.fp8_backward)
        return x.to(dtype) @ w.to(dtype).t()
