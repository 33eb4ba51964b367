"""FP8 weights quantized once per step (``kpool_layers.precision.weight_cache``): inside a step scope the
micro-batches after the first reuse the weight's e4m3 form and its dequantized copy, with the same
bits as quantizing every time; outside a scope, or for a weight changed in place, nothing stale is
used; the trainer's forward-backward opens the scope.

CPU: the ``emulate`` backend through megatron's column-parallel role linear (its weight, a
parameter, reaches the GEMM). GPU: the fused FP8 grouped experts (Triton quantization, FP8
grouped GEMM, ``grouped_mm`` backward)."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch

from kpool_layers.precision import fp8, weight_cache
from kpool_layers.moe import grouped_gemm
from kpool_layers.precision.policy import LinearNumerics, PrecisionPolicy, Role
from recipes.train import cuda_graph
from recipes.config.schema import FP8WeightCache, TrainConfig
from tests.test_precision import _megatron_config, _parallel_linear, _profile


def _counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str, calls: Counter) -> None:
    """Wrap ``module.name`` (a quantize or dequantize function) to count its calls by
    ``(name, operand)``; a dequantization into a given dtype (the backward's) counts as
    ``(name + ' into', operand)``."""
    inner: Callable = getattr(module, name)

    def counted(q, scale_or_recipe, *args, **kwargs):
        operand = next(a for a in (*args, *kwargs.values()) if a in ("weight", "activation"))
        into = name == "dequantize" and len(args) + len(kwargs) >= 3
        calls[(name + " into" if into else name, operand)] += 1
        return inner(q, scale_or_recipe, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def _micro_batches(layer: torch.nn.Module, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward and backward of every micro-batch (as megatron's schedule: one after the other,
    gradients accumulating): the outputs and input gradients, and the accumulated weight gradient."""
    layer.weight.grad = None
    outs = []
    for x in xs:
        x.grad = None
        out, _ = layer(x)
        out.square().sum().backward()
        outs += [out.detach(), x.grad]
    return outs, layer.weight.grad.clone()


@pytest.mark.parametrize("keep_dequantized", [True, False])
def test_a_step_quantizes_each_weight_once_with_the_same_bits(single_rank_parallel_state, monkeypatch,
                                                               keep_dequantized):
    layer = _parallel_linear("column", _megatron_config(_profile("fp8", backend="emulate", fp8_backward="bf16")),
                             role="mlp.fc1")
    torch.manual_seed(0)
    xs = [torch.randn(5, 2, 128, requires_grad=True) for _ in range(3)]  # three micro-batches, [s, b, h]
    calls: Counter = Counter()
    _counting(monkeypatch, fp8, "quantize", calls)
    _counting(monkeypatch, fp8, "dequantize", calls)
    every_time = _micro_batches(layer, xs)
    assert calls["quantize", "weight"] == 3 and calls["dequantize into", "weight"] == 3
    calls.clear()
    with weight_cache.step_scope(keep_dequantized):
        kept = _micro_batches(layer, xs)
    assert calls["quantize", "weight"] == 1 and calls["dequantize into", "weight"] == (1 if keep_dequantized else 3)
    assert calls["quantize", "activation"] == 3 and calls["dequantize into", "activation"] == 3
    for a, b in zip([*every_time[0], every_time[1]], [*kept[0], kept[1]], strict=True):
        assert torch.equal(a, b)


def test_nothing_stale_is_used(single_rank_parallel_state):
    """A new scope (the next step, after the optimizer) and a weight changed in place inside a
    scope both quantize and dequantize the weight as it is: output and input gradient equal those
    computed outside a scope."""
    layer = _parallel_linear("column", _megatron_config(_profile("fp8", backend="emulate", fp8_backward="bf16")),
                             role="mlp.fc1")
    x = torch.randn(5, 2, 128, requires_grad=True)

    def run() -> list[torch.Tensor]:
        x.grad = None
        out, _ = layer(x)
        out.square().sum().backward()
        return [out.detach(), x.grad]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))

    with weight_cache.step_scope(keep_dequantized=True):
        before = run()
        with torch.no_grad():
            layer.weight.mul_(1.5)  # in place: the version counter moves
        changed = run()
    assert not same(before, changed) and same(changed, run())
    with torch.no_grad():
        layer.weight.mul_(0.5)  # as an optimizer step between two steps
    expected = run()
    with weight_cache.step_scope(keep_dequantized=True):
        assert same(run(), expected) and same(run(), expected)
    assert weight_cache._scope is None
    plain = torch.randn(4, 128)  # not a parameter: never kept, even inside a scope
    with weight_cache.step_scope():
        got = weight_cache.quantized_weight(plain, "blockwise", "ue8m0",
                                            lambda: fp8.quantize(plain, "blockwise", "weight", "ue8m0"))
        assert got.source is None and not weight_cache._scope.weights


@pytest.mark.parametrize("fp8_backward", ["bf16", "fp8"])
def test_a_tiny_fp8_models_step_quantizes_each_weight_once(single_rank_parallel_state, monkeypatch, fp8_backward):
    """The whole glm5_tiny model, fp8 profile (emulated), two micro-batches: inside a scope every
    weight is quantized and dequantized half as often (each once), and the logits and every
    parameter's gradient are the same bits; with either backward (the FP8 one keeps the FP32
    dequantized weight of its emulated dgrad, which the counter does not see as "into")."""
    from tests.test_precision_profiles import _build

    _, model = _build(["precision=fp8", "precision.backend=emulate", f"precision.fp8_backward={fp8_backward}"])
    calls: Counter = Counter()
    _counting(monkeypatch, fp8, "quantize", calls)
    _counting(monkeypatch, fp8, "dequantize", calls)

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        outs = []
        for seed in (0, 1):
            tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(seed))
            logits = model(tokens, torch.arange(64).expand(2, 64), None)
            logits.float().square().mean().backward()
            outs.append(logits.detach())
        return outs + [p.grad for p in model.parameters() if p.grad is not None]

    every_time = step()
    quantized, dequantized = calls["quantize", "weight"], calls["dequantize into", "weight"]
    calls.clear()
    with weight_cache.step_scope(keep_dequantized=True):
        kept = step()
    assert quantized > 0 and calls["quantize", "weight"] * 2 == quantized
    assert calls["dequantize into", "weight"] * 2 == dequantized
    assert len(every_time) == len(kept) > 2
    for a, b in zip(every_time, kept, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("choice,scope", [("none", None), ("fp8", False), ("dequantized", True)])
def test_the_trainers_forward_backward_is_one_scope(monkeypatch, choice, scope):
    """``train.fp8_weight_cache``: each forward-backward call runs in one scope that keeps the
    dequantized weights or not (``none``: no scope)."""
    seen = []
    monkeypatch.setattr(cuda_graph, "get_forward_backward_func", lambda: lambda **kw: seen.append(
        weight_cache._scope and weight_cache._scope.keep_dequantized))
    cuda_graph.ForwardBackward(TrainConfig(fp8_weight_cache=FP8WeightCache(choice)))(x=1)
    assert seen == [scope] and weight_cache._scope is None


@pytest.mark.gpu
def test_grouped_fp8_experts_quantize_their_weights_once_per_step(monkeypatch):
    from kpool_layers.kernels import fp8_dequant_triton, fp8_quant_triton

    numerics = LinearNumerics(PrecisionPolicy(fp8=True, recipe="blockwise", backend="torch"), Role.MOE_EXPERT_FC1)
    counts = torch.tensor([37, 0, 5, 90, 1, 0])
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(len(counts), 256, 384, device="cuda") * 0.05).to(torch.bfloat16))
    xs = [torch.randn(int(counts.sum()), 384, device="cuda").to(torch.bfloat16).requires_grad_() for _ in range(2)]
    assert grouped_gemm.fused_fp8(numerics, xs[0], w)
    calls: Counter = Counter()
    _counting(monkeypatch, fp8_quant_triton, "quantize", calls)
    _counting(monkeypatch, fp8_dequant_triton, "dequantize", calls)

    def step() -> list[torch.Tensor]:
        w.grad = None
        outs = []
        for x in xs:
            x.grad = None
            y = grouped_gemm.expert_linear(x, w, counts, numerics, kernel=True)
            y.float().square().sum().backward()
            outs += [y.detach(), x.grad]
        return outs + [w.grad]

    every_time = step()  # outside a scope
    assert calls["quantize", "weight"] == 2 and calls["dequantize into", "weight"] == 2
    calls.clear()
    with weight_cache.step_scope(keep_dequantized=True):
        kept = step()
    assert calls["quantize", "weight"] == 1 and calls["dequantize into", "weight"] == 1
    for a, b in zip(every_time, kept, strict=True):
        assert torch.equal(a, b)
