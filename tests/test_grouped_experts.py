"""Grouped experts (``kpool_layers.moe.experts``) against megatron's ``SequentialMLP``: output
and every gradient with the same weights (experts without tokens included), the grouped GEMM
against a per-expert loop, checkpoint layout and loading both ways, the whole model through
megatron's router and dispatcher, the FP8 recipes refused and the ``auto`` choice (FP8 numerics:
``tests/test_grouped_experts_fp8.py``).

Tolerances (FP32, unit roundoff ``u = 2**-24``): a length-``K`` dot product summed in two orders
differs by at most ``2 * gamma_K * sum|a_i b_i|`` with ``gamma_K = K u / (1 - K u)`` (Higham,
Accuracy and Stability of Numerical Algorithms, 3.1). :func:`gemm_tol` is that bound per element;
:func:`module_tolerances` carries it through the expert MLP's chain of GEMMs and SwiGLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from kpool_layers.moe import grouped_gemm
from kpool_layers.moe.experts import GroupedExperts
from kpool_layers.moe.grouped_gemm import grouped_linear
from kpool_layers.precision.policy import PrecisionPolicy

U = 2.0**-24
HIDDEN, FFN = 32, 16
TOKENS_PER_EXPERT = [5, 0, 7, 0, 3, 1]  # experts 1 and 3 receive no tokens


def _cpu_grouped_mm() -> bool:
    """Whether this torch runs ``grouped_mm`` on the CPU (torch 2.14 does, FP32, 16-byte rows)."""
    try:
        grouped_linear(torch.ones(2, 4), torch.ones(2, 4, 4), torch.tensor([1, 1]), kernel=True)
    except (RuntimeError, NotImplementedError):
        return False
    return True


CPU_GROUPED_MM = _cpu_grouped_mm()


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def gemm_tol(a: torch.Tensor, b: torch.Tensor, u_out: float = 0.0) -> torch.Tensor:
    """Elementwise bound between a result of ``a [M, K] @ b [K, N]`` (FP32 accumulation, rounded
    to a storage format of unit roundoff ``u_out``) and the FP32 product of the same operands."""
    a, b = a.float(), b.float()
    return 2 * gamma(a.shape[-1]) * (a.abs() @ b.abs()) + 2 * u_out * (a @ b).abs()


def module_tolerances(x, probs, g, w1, w2, counts, u_out: float = 0.0) -> dict[str, float]:
    """Bounds on |grouped - sequential| for ``y = fc2(a)``, ``a = silu(gate) * up * p``, and its
    gradients, from a reference pass in FP32 on the same inputs.

    A GEMM ``C = A B`` (reduction length ``K``, FP32 accumulation) computed twice differs by at most
    ``2 (gamma_K + u_out) max(|A| |B|)`` (summation orders, and one rounding of each result to the
    storage format, unit roundoff ``u_out``: 0 for FP32, 2**-8 for BF16). An error ``d`` already in
    ``A`` reaches ``C`` as ``max(d) * max row-L1 of B``. The SwiGLU passes an error ``e`` in ``h``
    on as ``(1.1 |up| + |silu(gate)|) e`` (``|silu'| <= 1.1``) and its gradient as
    ``|d_a| (0.5 |up| + 2.2) e`` (``|silu''| <= 0.5``); the BF16 casts of ``a`` and ``dh`` add
    ``2 u_out`` of their magnitude. Products are first order (second-order terms are far below)."""
    x, g, w1, w2 = (t.float() for t in (x, g, w1, w2))
    p = probs.float()[:, None]
    idx = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts.to(x.device))
    w1t, w2t = w1[idx], w2[idx]  # per token: [T, 2F, H], [T, H, F]

    def gemm(a: torch.Tensor, b: torch.Tensor, k: int) -> float:  # a [T, K], b [T, N, K]
        return 2 * (gamma(k) + u_out) * float(torch.einsum("tk,tnk->tn", a.abs(), b.abs()).max())

    hidden, ffn = x.shape[1], w2.shape[2]
    h = torch.einsum("tk,tnk->tn", x, w1t)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    a = act * p
    d_a = torch.einsum("tk,tkn->tn", g, w2t)  # dL/da
    dh = torch.cat([d_a * p * up * 1.1, d_a * p * F.silu(gate)], dim=-1).abs()  # |dh| bound
    lip = float((1.1 * up.abs() + F.silu(gate).abs()).max())
    e_h = gemm(x, w1t, hidden)
    e_a = lip * e_h + 2 * u_out * float(a.abs().max())
    e_da = gemm(g, w2t.transpose(1, 2), hidden)
    e_dh = (lip * e_da + float(d_a.abs().max()) * (0.5 * float(up.abs().max()) + 2.2) * e_h
            + 2 * u_out * float(dh.max()))
    per_expert = torch.split(torch.arange(x.shape[0], device=x.device), counts.tolist())

    def wgrad(left: torch.Tensor, right: torch.Tensor, e_right: float) -> float:
        """Weight gradient ``left_e^T right_e`` per expert, ``right`` carrying error ``e_right``."""
        worst = 0.0
        for rows in per_expert:
            if len(rows):
                own = 2 * (gamma(len(rows)) + u_out) * float((left[rows].abs().t() @ right[rows].abs()).max())
                worst = max(worst, own + float(left[rows].abs().sum(0).max()) * e_right)
        return worst

    return {
        "y": gemm(a, w2t, ffn) + float(w2.abs().sum(-1).max()) * e_a,
        "dx": gemm(dh, w1t.transpose(1, 2), 2 * ffn) + float(w1.abs().sum(-2).max()) * e_dh,
        "dw2": wgrad(g, a, e_a),
        "dw1": wgrad(dh, x, e_dh),
        "dprobs": 2 * (gamma(ffn) + u_out) * float((d_a.abs() * act.abs()).sum(-1).max())
        + float((act.abs() * e_da + d_a.abs() * lip * e_h).sum(-1).max()),
    }


def config(**overrides) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                moe_ffn_hidden_size=FFN, num_moe_experts=len(TOKENS_PER_EXPERT), moe_router_topk=2,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                bias_activation_fusion=False, gradient_accumulation_fusion=False,
                use_cpu_initialization=True, params_dtype=torch.float32)
    return TransformerConfig(**{**base, **overrides})


def build_pair(cfg: TransformerConfig) -> tuple[SequentialMLP, GroupedExperts]:
    """A SequentialMLP and GroupedExperts holding the same weights (loaded through the hooks)."""
    pgs = get_default_pg_collection()
    torch.manual_seed(0)
    seq = SequentialMLP(cfg.num_moe_experts, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear), pg_collection=pgs)
    grouped = GroupedExperts(cfg.num_moe_experts, cfg, pg_collection=pgs)
    grouped.load_state_dict(seq.state_dict())
    return seq, grouped


def test_same_seed_gives_sequentials_weights(single_rank_parallel_state):
    """GroupedExperts draws SequentialMLP's weights from the same RNG state (a seed keeps its run)."""
    pgs = get_default_pg_collection()
    cfg = config()
    torch.manual_seed(3)
    seq = SequentialMLP(cfg.num_moe_experts, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear), pg_collection=pgs)
    torch.manual_seed(3)
    grouped = GroupedExperts(cfg.num_moe_experts, cfg, pg_collection=pgs)
    ref = seq.state_dict()
    got = grouped.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.items() if isinstance(v, torch.Tensor))
    assert grouped.weight1.partition_stride == seq.local_experts[0].linear_fc1.weight.partition_stride == 2


def check_grouped_linear(device: str, dtype: torch.dtype, kernels: list[bool], u_out: float) -> None:
    """``grouped_linear`` (each path in ``kernels``) against per-expert FP32 GEMMs of the same
    operands: output, input and weight gradients elementwise within :func:`gemm_tol`."""
    torch.manual_seed(0)
    counts = torch.tensor(TOKENS_PER_EXPERT)
    x = torch.randn(int(counts.sum()), HIDDEN, device=device).to(dtype).requires_grad_()
    w = torch.randn(len(counts), 2 * FFN, HIDDEN, device=device).to(dtype).requires_grad_()
    g = torch.randn(x.shape[0], 2 * FFN, device=device).to(dtype)
    bounds = torch.cumsum(torch.tensor([0, *TOKENS_PER_EXPERT]), 0).tolist()
    groups = list(zip(bounds[:-1], bounds[1:]))
    xs, ws = x.detach().float(), w.detach().float()
    ref = torch.cat([xs[a:b] @ ws[e].t() for e, (a, b) in enumerate(groups)])
    ref_gx = torch.cat([g[a:b].float() @ ws[e] for e, (a, b) in enumerate(groups)])
    ref_gw = torch.stack([g[a:b].float().t() @ xs[a:b] for a, b in groups])
    tol_y = torch.cat([gemm_tol(xs[a:b], ws[e].t(), u_out) for e, (a, b) in enumerate(groups)])
    tol_gx = torch.cat([gemm_tol(g[a:b], ws[e], u_out) for e, (a, b) in enumerate(groups)])
    tol_gw = torch.stack([gemm_tol(g[a:b].t(), xs[a:b], u_out) for a, b in groups])
    for kernel in kernels:
        x.grad = w.grad = None
        y = grouped_linear(x, w, counts, kernel)
        y.backward(g)
        assert y.dtype == dtype and y.shape == ref.shape
        assert ((y.float() - ref).abs() <= tol_y).all(), kernel
        assert ((x.grad.float() - ref_gx).abs() <= tol_gx).all(), kernel
        assert ((w.grad.float() - ref_gw).abs() <= tol_gw).all(), kernel
        assert not w.grad[1].any() and not w.grad[3].any()  # no tokens, zero gradient


def test_grouped_linear_kernel_and_loop_match_per_expert_gemms():
    check_grouped_linear("cpu", torch.float32, [False, True] if CPU_GROUPED_MM else [False], 0.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_wgrad_comes_in_the_weights_layout(device):
    """The FP8 experts' weight gradient: the grouped kernel gives ``[E, N, K]`` contiguous, the
    weight's own layout (a transposed result would make autograd copy every expert weight's
    gradient), equal to the per-expert GEMMs."""
    if device == "cpu" and not CPU_GROUPED_MM:
        pytest.skip("this torch has no CPU grouped_mm")
    counts = torch.tensor(TOKENS_PER_EXPERT)
    g = torch.randn(int(counts.sum()), 2 * FFN, device=device)
    x = torch.randn(int(counts.sum()), HIDDEN, device=device)
    grouped = grouped_gemm.grouped_wgrad(g, x, counts, kernel=True)
    loop = grouped_gemm.grouped_wgrad(g, x, counts, kernel=False)
    assert grouped.shape == (len(counts), 2 * FFN, HIDDEN) and grouped.is_contiguous()
    bounds = torch.cumsum(torch.tensor([0, *TOKENS_PER_EXPERT]), 0).tolist()
    tol = torch.stack([gemm_tol(g[a:b].t(), x[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    assert ((grouped - loop).abs() <= 2 * tol).all()
    assert not grouped[1].any() and not grouped[3].any()


@pytest.mark.gpu
def test_grouped_linear_cuda_bf16_kernel_and_loop(monkeypatch):
    """The CUDA grouped GEMM and the cuBLAS loop in BF16 (FP32 accumulation: cuBLAS's reduced
    precision BF16 reductions off), each within one BF16 rounding of the FP32 product."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    check_grouped_linear("cuda", torch.bfloat16, [False, True], 2.0**-8)


@pytest.mark.parametrize("kernel", [False, True], ids=["loop", "grouped_mm"])
def test_grouped_equals_sequential_output_and_every_gradient(single_rank_parallel_state, monkeypatch, kernel):
    if kernel and not CPU_GROUPED_MM:
        pytest.skip("grouped_mm has no CPU kernel in this torch")
    monkeypatch.setattr(GroupedExperts, "_kernel", lambda self, x: kernel)
    seq, grouped = build_pair(config())
    counts = torch.tensor(TOKENS_PER_EXPERT)
    torch.manual_seed(1)
    x = torch.randn(int(counts.sum()), HIDDEN)
    probs = torch.rand(x.shape[0])
    g = torch.randn(x.shape[0], HIDDEN)
    outs = {}
    for name, module in (("seq", seq), ("grouped", grouped)):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, bias = module(xi, counts, pi)
        assert bias is None
        y.backward(g)
        outs[name] = (y.detach(), xi.grad, pi.grad)
    w1 = torch.stack([e.linear_fc1.weight for e in seq.local_experts]).detach()
    w2 = torch.stack([e.linear_fc2.weight for e in seq.local_experts]).detach()
    gw1 = torch.stack([e.linear_fc1.weight.grad for e in seq.local_experts])
    gw2 = torch.stack([e.linear_fc2.weight.grad for e in seq.local_experts])
    tol = module_tolerances(x, probs, g, w1, w2, counts)
    (y_s, gx_s, gp_s), (y_g, gx_g, gp_g) = outs["seq"], outs["grouped"]
    assert (y_g - y_s).abs().max() <= tol["y"]
    assert (gx_g - gx_s).abs().max() <= tol["dx"]
    assert (gp_g - gp_s).abs().max() <= tol["dprobs"]
    assert (grouped.weight1.grad - gw1).abs().max() <= tol["dw1"]
    assert (grouped.weight2.grad - gw2).abs().max() <= tol["dw2"]
    for e in (1, 3):  # experts without tokens: zero gradients on both sides
        assert not grouped.weight1.grad[e].any() and not gw1[e].any()
        assert not grouped.weight2.grad[e].any() and not gw2[e].any()


@pytest.mark.gpu
def test_grouped_mm_on_gpu_equals_sequential_bf16(single_rank_parallel_state, monkeypatch):
    """The CUDA grouped GEMM (BF16) against SequentialMLP: output and every gradient within the
    BF16 bounds of :func:`module_tolerances` (worst case, loose in BF16; the per-GEMM test above
    is the tight one)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    seq, grouped = build_pair(config(params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=False))
    counts = torch.tensor(TOKENS_PER_EXPERT)
    torch.manual_seed(1)
    x = torch.randn(int(counts.sum()), HIDDEN, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(x.shape[0], device="cuda")
    g = torch.randn_like(x)
    assert grouped._kernel(x)
    outs = {}
    for name, module in (("seq", seq), ("grouped", grouped)):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = module(xi, counts, pi)
        y.backward(g)
        outs[name] = (y.detach().float(), xi.grad.float(), pi.grad.float())
    w1 = torch.stack([e.linear_fc1.weight for e in seq.local_experts]).detach()
    w2 = torch.stack([e.linear_fc2.weight for e in seq.local_experts]).detach()
    gw1 = torch.stack([e.linear_fc1.weight.grad for e in seq.local_experts]).float()
    gw2 = torch.stack([e.linear_fc2.weight.grad for e in seq.local_experts]).float()
    tol = module_tolerances(x, probs, g, w1, w2, counts, u_out=2.0**-8)
    (y_s, gx_s, gp_s), (y_g, gx_g, gp_g) = outs["seq"], outs["grouped"]
    assert (y_g - y_s).abs().max() <= tol["y"]
    assert (gx_g - gx_s).abs().max() <= tol["dx"]
    assert (gp_g - gp_s).abs().max() <= tol["dprobs"]
    assert (grouped.weight1.grad.float() - gw1).abs().max() <= tol["dw1"]
    assert (grouped.weight2.grad.float() - gw2).abs().max() <= tol["dw2"]
    assert not grouped.weight1.grad[1].any() and not grouped.weight2.grad[3].any()


def _leaves(sharded: dict) -> dict:
    """Sharded state dict entries by dict key -> comparable descriptions (factories built)."""
    out = {}
    for key, entry in sharded.items():
        built = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
        items = built if isinstance(built, list) else [built]
        desc = []
        for item in items:
            if isinstance(item, ShardedTensor):
                desc.append((item.key, item.global_shape, item.global_offset, item.axis_fragmentations,
                             item.replica_id, item.data.clone()))
            else:
                assert isinstance(item, ShardedObject)
                desc.append((item.key, item.global_shape, item.global_offset, item.replica_id, None))
        out[key] = desc
    return out


@pytest.mark.parametrize("singleton", [False, True])
def test_sharded_state_dict_and_state_dict_equal_sequentials(single_rank_parallel_state, singleton):
    seq, grouped = build_pair(config())
    meta = {"singleton_local_shards": singleton}
    ours, theirs = _leaves(grouped.sharded_state_dict("mlp.experts.", (), meta)), _leaves(
        seq.sharded_state_dict("mlp.experts.", (), meta))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        for a, b in zip(ours[key], theirs[key], strict=True):
            assert a[:-1] == b[:-1], key
            assert (a[-1] is None and b[-1] is None) or torch.equal(a[-1], b[-1]), key
    sd_g, sd_s = grouped.state_dict(), seq.state_dict()
    assert sd_g.keys() == sd_s.keys()
    assert all(torch.equal(sd_g[k], v) for k, v in sd_s.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("direction", ["sequential_to_grouped", "grouped_to_sequential"])
def test_dist_checkpoint_loads_across_expert_modules(single_rank_parallel_state, tmp_path, direction):
    seq, grouped = build_pair(config())
    src, dst = (seq, grouped) if direction == "sequential_to_grouped" else (grouped, seq)
    with torch.no_grad():  # the destination starts different
        for p in dst.parameters():
            p.normal_()
    dist_checkpointing.save({"model": src.sharded_state_dict("mlp.experts.")}, str(tmp_path))
    loaded = dist_checkpointing.load({"model": dst.sharded_state_dict("mlp.experts.")}, str(tmp_path))
    dst.load_state_dict({k.removeprefix("mlp.experts."): v for k, v in loaded["model"].items()})
    ref = seq.state_dict()
    got = (grouped if dst is grouped else seq).state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.items() if isinstance(v, torch.Tensor))
    w1 = torch.stack([e.linear_fc1.weight for e in seq.local_experts])
    assert torch.equal(grouped.weight1, w1)


def test_load_names_a_missing_expert(single_rank_parallel_state):
    seq, grouped = build_pair(config())
    sd = seq.state_dict()
    del sd["local_experts.2.linear_fc2.weight"]
    with pytest.raises(RuntimeError, match="weight2"):
        grouped.load_state_dict(sd)


def test_unsupported_expert_features_are_named(single_rank_parallel_state):
    with pytest.raises(ValueError, match=r"add_bias_linear.*moe_grouped_gemm=false"):
        GroupedExperts(2, config(add_bias_linear=True), pg_collection=get_default_pg_collection())


def test_fp8_tensorwise_experts_are_refused_naming_the_key(single_rank_parallel_state):
    cfg = config()
    cfg.precision = PrecisionPolicy(fp8=True, recipe="tensorwise", backend="emulate")
    with pytest.raises(ValueError, match=r"precision\.recipe='tensorwise'.*allowed: \['blockwise', 'rowwise'\]"
                                         r".*model\.moe_grouped_gemm=false"):
        GroupedExperts(2, cfg, pg_collection=get_default_pg_collection())
    for policy in (PrecisionPolicy(), PrecisionPolicy(fp8=True, backend="emulate"),
                   PrecisionPolicy(fp8=True, recipe="rowwise", backend="emulate")):
        cfg.precision = policy
        GroupedExperts(2, cfg, pg_collection=get_default_pg_collection())  # bf16, FP8 blockwise / rowwise: fine


def test_auto_choice_is_gpu_with_the_supported_recipes():
    from recipes.config.megatron import grouped_experts

    bf16, fp8_blockwise = PrecisionPolicy(), PrecisionPolicy(fp8=True)
    fp8_rowwise = PrecisionPolicy(fp8=True, recipe="rowwise")
    fp8_tensorwise = PrecisionPolicy(fp8=True, recipe="tensorwise")
    assert all(grouped_experts(None, p, on_gpu=True) for p in (bf16, fp8_blockwise, fp8_rowwise))
    assert not grouped_experts(None, fp8_tensorwise, on_gpu=True)
    assert not grouped_experts(None, bf16, on_gpu=False) and not grouped_experts(None, fp8_blockwise, on_gpu=False)
    assert grouped_experts(True, bf16, on_gpu=False) and not grouped_experts(False, bf16, on_gpu=True)


def test_module_uses_the_public_grouped_mm_name_when_present():
    expected = getattr(F, "grouped_mm", None) or torch._grouped_mm
    assert grouped_gemm._GROUPED_MM is expected


def test_tiny_model_loads_a_sequential_checkpoint_and_matches(single_rank_parallel_state, tmp_path):
    """glm5_tiny through megatron's router and allgather dispatcher: a dist checkpoint saved with
    sequential experts loads into grouped ones (``recipes.checkpoint.store.load_weights``) and the
    logits and every parameter gradient agree (bounds as above; observed bit-equal on the CPU)."""
    from hydra import compose, initialize_config_dir

    from recipes.checkpoint.store import load_weights
    from recipes.launch.distributed import register_resolvers
    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model
    from recipes.config.schema import register_configs
    from recipes.config.typed import to_config
    from tests.test_precision_profiles import CONF

    register_resolvers()
    register_configs()
    models = {}
    for grouped in (False, True):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = to_config(compose(config_name="config", overrides=[
                "model=glm5_tiny", "precision=fp32", f"model.moe_grouped_gemm={str(grouped).lower()}"]))
        tcfg = to_transformer_config(cfg)
        assert tcfg.moe_grouped_gemm is grouped
        torch.manual_seed(int(grouped))  # different initial weights
        models[grouped] = build_gpt_model(cfg, tcfg)
    assert any(isinstance(m, GroupedExperts) for m in models[True].modules())
    assert not any(isinstance(m, GroupedExperts) for m in models[False].modules())
    dist_checkpointing.save({"model": models[False].sharded_state_dict()}, str(tmp_path))
    load_weights(tmp_path, models[True])
    logits, grads = tiny_logits_and_grads(models)
    scale = float(logits[False].abs().max())
    # The CPU loop runs the same per-expert GEMMs as SequentialMLP (observed bit-equal); 1e-5 of the
    # magnitude leaves room for a BLAS blocking them differently (per-module bounds: tests above).
    assert (logits[True] - logits[False]).abs().max() <= 1e-5 * scale
    for name, got, ref in grads:
        if ref is None or got is None:  # parameters outside the loss (e.g. the router's bias)
            assert ref is None and got is None, name
            continue
        assert (got - ref).abs().max() <= 1e-5 * float(ref.abs().max()) + 1e-30, name


def tiny_logits_and_grads(models: dict[bool, torch.nn.Module]) -> tuple[dict[bool, torch.Tensor], list[tuple]]:
    """glm5_tiny models with sequential (``False``) and grouped (``True``) experts on the same
    tokens, backward of the mean squared logits: each model's logits, and per parameter of the
    grouped model ``(name, its gradient, the sequential model's)``, the stacked expert gradients
    against ``SequentialMLP``'s per-expert ones stacked."""
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, -1)
    logits = {}
    for grouped, model in models.items():
        out = model(tokens, positions, None)
        out.float().square().mean().backward()
        logits[grouped] = out.detach()
    seq_grads = {n: p.grad for n, p in models[False].named_parameters()}
    grads = []
    for name, p in models[True].named_parameters():
        if name.endswith(("experts.weight1", "experts.weight2")):
            fc = "linear_fc1" if name.endswith("1") else "linear_fc2"
            base = name.rsplit(".", 1)[0]
            ref = torch.stack([seq_grads[f"{base}.local_experts.{e}.{fc}.weight"] for e in range(p.shape[0])])
        else:
            ref = seq_grads[name]
        grads.append((name, p.grad, ref))
    return logits, grads


def test_resuming_across_expert_modules_is_refused(single_rank_parallel_state):
    from kpool_layers.moe.experts import check_resumable_experts, experts_module
    from tests.test_grouped_experts_dist import _moe_layer

    seq, grouped = _moe_layer(False, {}), _moe_layer(True, {})
    assert (experts_module(seq), experts_module(grouped)) == ("SequentialMLP", "GroupedExperts")
    assert experts_module(torch.nn.Linear(2, 2)) is None
    check_resumable_experts("GroupedExperts", grouped, "ck")
    check_resumable_experts(None, seq, "ck")  # saved before the module was recorded: sequential
    check_resumable_experts("GroupedExperts", torch.nn.Linear(2, 2), "ck")  # no MoE layers
    with pytest.raises(ValueError, match=r"ck was saved with SequentialMLP.*moe_grouped_gemm=false.*train\.load=ck"):
        check_resumable_experts(None, grouped, "ck")
    with pytest.raises(ValueError, match=r"GroupedExperts.*moe_grouped_gemm=true"):
        check_resumable_experts("GroupedExperts", seq, "ck")


@pytest.mark.gpu
def test_expert_offsets_reach_the_gpu_without_a_host_sync() -> None:
    """megatron's dispatchers return the expert counts on the host; their copy to the GPU must not
    synchronize (CUDA's sync debug mode raises on a synchronizing copy)."""
    from kpool_layers.moe.grouped_gemm import _offsets

    counts = torch.tensor([3, 0, 5, 2])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        offs = _offsets(counts, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert offs.tolist() == [3, 3, 8, 10] and offs.dtype == torch.int32


def test_counts_cross_to_the_device_once_for_the_grouped_kernels(single_rank_parallel_state):
    """The per-expert loop reads the dispatcher's host counts as they are; the grouped kernels get
    them once, int32 (their offsets' dtype) on the input's device, instead of a blocking copy
    per GEMM."""
    _, grouped = build_pair(config())
    counts = torch.tensor(TOKENS_PER_EXPERT)
    x = torch.randn(int(counts.sum()), HIDDEN)
    assert grouped._counts(x, counts, kernel=False) is counts
    on_device = grouped._counts(x, counts, kernel=True)
    assert on_device.dtype == torch.int32 and on_device.device == x.device
    assert on_device.tolist() == TOKENS_PER_EXPERT
