"""Kernel routes (``kpool_layers.kernel_routes``): every key falls back on a machine without CUDA
and says why, a backend asked for that declines is an error naming the key and the allowed
values, the hot paths resolve once, and the precision map lists every key."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kpool_layers import kernel_routes
from kpool_layers.compat import wgrad_accumulation
from kpool_layers.dsa import backends as dsa_kernels
from kpool_layers.kernel_routes import KernelBackend, KernelUnavailable, Machine, Route
from kpool_layers.linear_attention import backends as kda_kernels
from kpool_layers.linear_attention.fla_kernels import FLA_KERNELS
from kpool_layers.linear_attention.layer_ops import TORCH_KERNELS
from kpool_layers.loss import LOSS, FusedLossGPTModel, loss_backend
from kpool_layers.moe.grouped_gemm import GROUPED_FP8, GROUPED_MM
from kpool_layers.precision import fp8
from kpool_layers.precision.fp8 import SERVING_QUANT
from kpool_layers.precision.hadamard import HADAMARD, hadamard_butterfly, hadamard_transform
from kpool_layers.precision.policy import FP8_DEQUANT, FP8_GEMM, FP8_QUANT, dequantizer, quantizer
from recipes.observe.precision_map import KERNEL_ROUTES, format_rows, route_rows

CPU = Machine(cuda=False)
KEYS = {"dsa", "fp8_gemm", "fp8_quant", "fp8_dequant", "serving_quant", "hadamard", "grouped_gemm", "grouped_mm",
        "moe_row_sum", "rope", "loss", "wgrad", "linear_attention", "mhc_gates", "mhc_stream_mix", "mhc_norm_proj", "mhc_pre_sum"}
FALLBACK = {"dsa": "torch", "fp8_gemm": "emulate", "fp8_quant": "torch", "fp8_dequant": "torch",
            "serving_quant": "torch", "hadamard": "torch", "grouped_gemm": "loop", "grouped_mm": "loop", "moe_row_sum": "torch", "rope": "torch",
            "loss": "megatron", "wgrad": "kpool", "linear_attention": "torch", "mhc_gates": "torch",
            "mhc_stream_mix": "torch", "mhc_norm_proj": "torch", "mhc_pre_sum": "torch"}
CUDA_ONLY = {"dsa": ["triton"], "fp8_gemm": [], "fp8_quant": ["triton"], "fp8_dequant": ["triton"],
             "serving_quant": ["triton"], "hadamard": ["triton"], "grouped_gemm": ["triton"],
             "grouped_mm": ["grouped_mm"], "moe_row_sum": ["triton"], "rope": ["triton"], "loss": ["triton"], "wgrad": [], "linear_attention": ["fla"],
             "mhc_gates": ["triton"], "mhc_stream_mix": ["triton"], "mhc_norm_proj": ["triton"],
             "mhc_pre_sum": ["triton"]}
"""The backends of each key that decline for want of a CUDA device (fp8_gemm's torch declines for
want of an FP8 GPU, wgrad's apex for want of apex's extension)."""


def test_every_key_is_registered_and_listed() -> None:
    assert set(kernel_routes.ROUTES) == KEYS == {route.key for route in KERNEL_ROUTES}
    for route in KERNEL_ROUTES:
        assert route.backends[-1].name == FALLBACK[route.key]


@pytest.mark.parametrize("key", sorted(KEYS))
def test_each_key_falls_back_without_cuda_and_says_why(key: str) -> None:
    route = kernel_routes.ROUTES[key]
    got = route.resolve(machine=CPU)
    assert got.backend == FALLBACK[key] and not got.forced
    assert set(got.declined) == set(route.names) - {FALLBACK[key]}
    for name in CUDA_ONLY[key]:
        assert got.declined[name] == "no CUDA device", (key, name)
    assert route.latest is got


def test_declined_reasons_of_the_other_checks() -> None:
    assert dsa_kernels.DSA.resolve(machine=CPU).declined["tilelang"] == "taken only when asked for (model.dsa_kernels)"
    ampere = dsa_kernels.DSA.resolve(machine=Machine(cuda=True, capability=(8, 0)))
    assert ampere.backend == "torch" and ampere.declined["triton"] == "compute capability (8, 0) < (9, 0)"
    assert dsa_kernels.DSA.resolve(machine=Machine(cuda=True, capability=(9, 0))).backend == "triton"
    assert FP8_GEMM.resolve(machine=CPU).declined["torch"] == "no CUDA GPU of compute capability >= 8.9"
    assert wgrad_accumulation.WGRAD.resolve(machine=CPU).declined["apex"] == (
        "apex's fused_weight_gradient_mlp_cuda extension not installed")
    missing = kernel_routes.needs_package("kpool_no_such_package", "pip install it")
    assert missing(CPU) == "package 'kpool_no_such_package' not installed (pip install it)"
    assert missing(Machine.planned_gpu()) is None  # a dry run plans for a machine with every package


def test_a_declining_backend_asked_for_is_an_error_naming_the_key_and_the_allowed_values() -> None:
    with pytest.raises(KernelUnavailable) as err:
        HADAMARD.resolve("triton", CPU)
    assert str(err.value) == "kernel route 'hadamard'=triton cannot run here: no CUDA device; allowed: ['triton', 'torch']"
    with pytest.raises(KernelUnavailable, match=r"model\.dsa_kernels=triton cannot run here: no CUDA device; "
                                                r"allowed: \['triton', 'tilelang', 'torch'\]"):
        dsa_kernels.DSA.resolve("triton", CPU)
    with pytest.raises(KernelUnavailable, match=r"train\.cross_entropy_fusion='te'; allowed: \['triton', 'megatron'\]"):
        LOSS.resolve("te", CPU)
    forced = dsa_kernels.DSA.resolve("tilelang", Machine(cuda=True, capability=(9, 0)))
    assert forced.backend == "tilelang" and forced.forced and forced.declined == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_dsa_kernels_triton_on_cpu_keeps_its_config_message() -> None:
    shapes = dsa_kernels.KernelShapes(torch.bfloat16, kv_lora_rank=512, qk_pos_emb_head_dim=64,
                                      dsa_indexer_head_dim=128)
    with pytest.raises(KernelUnavailable, match=r"dsa_kernels=triton needs a CUDA GPU \(none here\); "
                                                r"use dsa_kernels=torch \(or auto\) on CPU"):
        dsa_kernels.check_backend("triton", shapes, deterministic=False)


def test_dsa_auto_and_the_planned_machine() -> None:
    assert dsa_kernels.resolve("auto", on_device=False) == "triton"
    assert dsa_kernels.DSA.latest.kernel is None  # a planned machine loads nothing
    assert dsa_kernels.resolve("auto", (8, 9)) == "torch"
    assert dsa_kernels.resolve("torch") == "torch"
    with pytest.raises(KernelUnavailable, match=r"dsa_kernels='cudnn'; allowed: \['auto', 'torch', 'tilelang', 'triton'\]"):
        dsa_kernels.resolve("cudnn")
    taken = dsa_kernels.DSA.take("torch")  # the layer spec records the resolved auto
    assert not taken.forced and taken.declined["triton"] == "compute capability (8, 9) < (9, 0)"
    assert taken.kernel(16).keywords == {"chunk_size": 16}
    taken = dsa_kernels.DSA.take("tilelang")  # asked for: checked by check_backend, not here
    assert taken.forced and taken.declined == {} and callable(taken.kernel)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU resolution")
def test_linear_attention_route_is_the_kda_backend_choice() -> None:
    route = kda_kernels.LINEAR_ATTENTION
    assert kda_kernels.resolve("auto", on_device=False) == "fla" and route.latest.kernel is None  # planned: nothing loaded
    assert kda_kernels.resolve("auto") == "torch" and route.latest.declined == {"fla": "no CUDA device"}
    assert kda_kernels.layer_kernels("torch") is TORCH_KERNELS  # the layer spec records the resolved auto
    assert not route.latest.forced and route.latest.declined == {"fla": "no CUDA device"}
    assert kda_kernels.layer_kernels("fla") is FLA_KERNELS and route.latest.forced  # asked for
    with pytest.raises(KernelUnavailable, match=r"model\.linear_attention_kernels=fla cannot run here: no CUDA device; "
                                                r"allowed: \['fla', 'torch'\]"):
        route.resolve("fla", CPU)


def test_loss_route_is_the_fusion_decision() -> None:
    assert loss_backend(True, True) == "triton" and LOSS.latest.kernel is FusedLossGPTModel
    assert loss_backend(True, False) == "megatron" and LOSS.latest.declined == {"triton": "no CUDA device"}
    assert loss_backend(False, True) == "megatron" and LOSS.latest.forced


def test_wgrad_route_follows_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.tensor_parallel.layers as megatron_layers

    apex = object()
    monkeypatch.setattr(megatron_layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(megatron_layers, "fused_weight_gradient_mlp_cuda", apex, raising=False)
    got = wgrad_accumulation.WGRAD.resolve()
    assert got.backend == "apex" and got.kernel is apex
    monkeypatch.setattr(megatron_layers, "fused_weight_gradient_mlp_cuda", wgrad_accumulation.FUSED_WGRAD)
    assert wgrad_accumulation.WGRAD.resolve().backend == "kpool"  # our stand-in is not apex


def test_kernel_backends_load_what_their_owners_call() -> None:
    """The Triton modules import on CPU (their kernels compile only when launched) and carry the
    names the owners look up per call, so a renamed kernel function fails here, not on a GPU."""
    wanted = {"hadamard": ("supports", "hadamard_triton"), "serving_quant": ("supports", "serving_index_quant_triton"),
              "fp8_quant": ("quantize",), "fp8_dequant": ("dequantize",), "grouped_gemm": ("grouped_gemm",),
              "mhc_gates": ("supports", "gates"), "mhc_stream_mix": ("supports", "mix_streams"),
              "mhc_norm_proj": ("supports_norm_project", "norm_project"), "mhc_pre_sum": ("supports_pre_sum", "pre_sum")}
    for key, names in wanted.items():
        module = kernel_routes.ROUTES[key].backend("triton").load()
        assert all(callable(getattr(module, name)) for name in names), key
    assert FP8_QUANT.backend("torch").load() is fp8.quantize
    assert FP8_DEQUANT.backend("torch").load() is fp8.dequantize
    assert HADAMARD.backend("torch").load() is hadamard_butterfly
    assert callable(dsa_kernels.DSA.backend("triton").load()(64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU resolution")
def test_hot_paths_resolve_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for route in (HADAMARD, SERVING_QUANT, FP8_QUANT, FP8_DEQUANT, GROUPED_FP8, GROUPED_MM):
        assert route.default() is route.default() and route.default().backend == FALLBACK[route.key]
    monkeypatch.setattr(Machine, "here", staticmethod(lambda: pytest.fail("machine checked again")))
    x = torch.randn(3, 16)
    assert torch.equal(hadamard_transform(x, 0.25), hadamard_butterfly(x, 0.25))
    assert fp8.serving_index_quant(torch.randn(2, 128)).dtype == torch.bfloat16
    assert quantizer("torch", x) is fp8.quantize and dequantizer("torch", x) is fp8.dequantize


def test_fp8_gemm_route_keeps_the_precision_backend_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    from kpool_layers.precision import policy

    monkeypatch.setattr(policy, "_cuda_fp8_available", lambda: True)
    assert policy.resolve_backend(policy.PrecisionPolicy(fp8=True)) == "torch" and FP8_GEMM.latest.declined == {}
    assert policy.resolve_backend(policy.PrecisionPolicy(fp8=True, backend="emulate")) == "emulate"
    assert FP8_GEMM.latest.forced
    monkeypatch.setattr(policy, "_cuda_fp8_available", lambda: False)
    assert policy.resolve_backend(policy.PrecisionPolicy(fp8=True)) == "emulate"
    assert FP8_GEMM.latest.declined == {"torch": "no CUDA GPU of compute capability >= 8.9"}


def test_route_tables_are_checked() -> None:
    def check(machine: Machine) -> str:
        return "never"

    with pytest.raises(ValueError, match="last backend is the fallback"):
        Route("bad", (KernelBackend("a", lambda: None, "a", declines=(check,)),), "bad")
    with pytest.raises(ValueError, match="registered twice"):
        kernel_routes.register(Route("hadamard", (KernelBackend("torch", lambda: None, "t"),), "dup"))


def test_the_map_lists_every_key() -> None:
    rows = {r["role"]: r for r in route_rows()}
    assert set(rows) == {f"route.{key}" for key in KEYS}
    for key in KEYS:
        row = rows[f"route.{key}"]
        assert row["backend"] in row["allowed"] == kernel_routes.ROUTES[key].names
        assert row["note"] and set(row["declined"]) <= set(row["allowed"])
    lines = format_rows(list(rows.values()))
    assert len(lines) == len(KEYS) and all(" kernel " in line for line in lines)


@pytest.mark.gpu
def test_every_key_takes_its_kernel_on_a_hopper_gpu() -> None:
    """On a CUDA GPU of compute capability >= 9.0 with triton (and without apex) every key resolves
    to the kernel it chose before the routes existed: the first backend of each table, except
    tilelang (only when asked for) and apex where its extension is not installed."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs compute capability >= 9.0")
    expected = {"dsa": "triton", "fp8_gemm": "torch", "fp8_quant": "triton", "fp8_dequant": "triton",
                "serving_quant": "triton", "hadamard": "triton", "grouped_gemm": "triton",
                "grouped_mm": "grouped_mm", "moe_row_sum": "triton", "rope": "triton", "loss": "triton", "wgrad": "kpool",
                "linear_attention": "fla" if importlib.util.find_spec("fla") is not None else "torch",
                "mhc_gates": "triton", "mhc_stream_mix": "triton", "mhc_norm_proj": "triton", "mhc_pre_sum": "triton"}
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        expected["wgrad"] = "apex"
    assert set(expected) == KEYS
    for key, backend in expected.items():
        got = kernel_routes.ROUTES[key].resolve()
        assert got.backend == backend, (key, got.declined)
    assert dsa_kernels.resolve("auto") == "triton"
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    from kpool_layers.kernels import fp8_dequant_triton, fp8_quant_triton

    assert quantizer("torch", x) is fp8_quant_triton.quantize and quantizer("emulate", x) is fp8.quantize
    assert dequantizer("torch", x) is fp8_dequant_triton.dequantize
    assert torch.equal(hadamard_transform(x, 128**-0.5), hadamard_butterfly(x, 128**-0.5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU resolution")
def test_pin_fixes_the_default_until_unpinned() -> None:
    from kpool_layers.hyper_connections.mhc import GATES

    try:
        with pytest.raises(KernelUnavailable, match="kernel route 'mhc_gates'=triton cannot run here: no CUDA device"):
            GATES.pin("triton")
        GATES.pin("torch")
        assert GATES.default().backend == "torch" and GATES.default().forced
    finally:
        GATES.pin(None)
    assert GATES.default().backend == "torch" and not GATES.default().forced
