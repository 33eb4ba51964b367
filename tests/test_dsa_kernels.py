"""``model.dsa_kernels``: resolution, errors before the build, the spec's choice, the kernel map, and
the TileLang adapter's padding (run on CPU with the torch path standing in for the kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kpool_layers import dsa_kernels
from kpool_layers.attention import glm_attention_spec
from kpool_layers.core_attention import CORE_ATTENTION, TorchSparseMLA
from kpool_layers.kernels.tilelang_dsa import sparse_mla_tilelang, tilelang_heads, valid_indices
from kpool_layers.sparse_attention import sparse_mla_attention
from recipes.distributed import register_resolvers
from recipes.schema import ConfigError, register_configs, validate
from tests.test_attention import build, tiny_config

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()
register_configs()
GLM5 = dsa_kernels.KernelShapes(torch.bfloat16, kv_lora_rank=512, qk_pos_emb_head_dim=64,
                                dsa_indexer_head_dim=128)


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("capability,expected", [(None, "torch"), ((8, 0), "torch"),
                                                 ((9, 0), "triton"), ((10, 0), "triton")])
def test_auto_is_triton_on_hopper_and_newer_else_torch(capability, expected) -> None:
    if capability is None and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert dsa_kernels.resolve("auto", capability) == expected
    assert dsa_kernels.resolve("tilelang", capability) == "tilelang"
    assert dsa_kernels.resolve("auto", on_device=False) == "triton"  # a dry run plans for GPUs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answers")
@pytest.mark.parametrize("backend", ["tilelang", "triton"])
def test_gpu_backends_on_a_cpu_machine_fail_before_the_build(backend: str) -> None:
    cfg = _compose([f"model.dsa_kernels={backend}"])
    with pytest.raises(ConfigError, match=rf"model.dsa_kernels=.*{backend}.*needs a CUDA GPU"):
        validate(cfg, 1)
    validate(_compose(["model.dsa_kernels=auto"]), 1)  # auto = torch here


def test_unsupported_shapes_and_dtypes_name_the_requirement() -> None:
    fp32 = dsa_kernels.KernelShapes(torch.float32, 512, 64, 128)
    with pytest.raises(dsa_kernels.KernelUnavailable, match="tilelang needs bf16"):
        dsa_kernels.check_backend("tilelang", fp32, deterministic=False, on_device=False)
    tiny = dsa_kernels.KernelShapes(torch.bfloat16, 32, 16, 32)
    with pytest.raises(dsa_kernels.KernelUnavailable, match="kv_lora_rank 512"):
        dsa_kernels.check_backend("tilelang", tiny, deterministic=False, on_device=False)
    odd = dsa_kernels.KernelShapes(torch.bfloat16, 40, 0, 32)
    with pytest.raises(dsa_kernels.KernelUnavailable, match="multiples of 16"):
        dsa_kernels.check_backend("triton", odd, deterministic=False, on_device=False)
    nope = dsa_kernels.KernelShapes(torch.bfloat16, 512, 0, 128)
    for backend in ("tilelang", "triton"):
        dsa_kernels.check_backend(backend, GLM5, deterministic=False, on_device=False)
        dsa_kernels.check_backend(backend, nope, deterministic=False, on_device=False)


def test_deterministic_training_refuses_tilelang_by_name() -> None:
    with pytest.raises(dsa_kernels.KernelUnavailable,
                       match="tilelang is not deterministic.*latent-key gradient.*atomics"):
        dsa_kernels.check_backend("tilelang", GLM5, deterministic=True, on_device=False)
    dsa_kernels.check_backend("triton", GLM5, deterministic=True, on_device=False)
    cfg = _compose(["model=glm5_proxy", "model.dsa_kernels=tilelang", "train.deterministic=true",
                    "train.dry_run=true"])
    with pytest.raises(ConfigError, match="model.dsa_kernels=.*not deterministic"):
        validate(cfg, 1)


@pytest.mark.parametrize("backend", ["torch", "tilelang", "triton"])
def test_spec_builds_the_backends_core_attention(backend: str) -> None:
    spec = glm_attention_spec(tiny_config(dsa_kernels=backend))
    assert spec.submodules.core_attention is CORE_ATTENTION[backend]
    assert spec.submodules.indexer.params["range_topk"] is not None


def test_kernel_rows_in_the_precision_map(single_rank_parallel_state) -> None:
    from recipes.precision_setup import kernel_rows

    layer = build(tiny_config())
    assert isinstance(layer.core_attention, TorchSparseMLA)
    rows = {r["role"]: r for r in kernel_rows(layer)}
    assert rows["kernel.sparse_mla"]["backend"] == "torch"
    assert rows["kernel.sparse_mla"]["note"] == "deterministic"  # CPU
    assert rows["kernel.indexer_topk"]["backend"] == "torch"


def test_tilelang_head_padding() -> None:
    assert [tilelang_heads(n) for n in (1, 5, 16, 20, 32, 33, 64, 65, 128, 130)] == [
        16, 16, 16, 32, 32, 64, 64, 128, 128, 192]


def test_valid_indices_drop_future_other_document_and_empty_slots() -> None:
    idx = torch.tensor([[[0, -1, 1], [2, 0, 1], [1, 2, 3]]])  # [1, 3, 3]
    start = torch.tensor([0, 1, 1])
    assert valid_indices(idx, start).tolist() == [[[0, -1, -1], [-1, -1, 1], [1, 2, -1]]]
    assert valid_indices(idx, start).dtype == torch.int32


def _reference_kernel(q, kv, indices, scale):  # noqa: ANN001, ANN202
    """SparseMLA's contract ([b, s, H, 576] layouts, -1 slots skipped) on the torch path."""
    out = sparse_mla_attention(q.transpose(0, 1), kv.transpose(0, 1), indices[:, :, 0].long(),
                               scale, v_channels=512, chunk_size=4)
    return out.transpose(0, 1), None


@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("heads", [5, 16])
def test_tilelang_adapter_padding_is_exact(rope: int, heads: int) -> None:
    """NoPE zero tail, padded heads and document masking change nothing (float64)."""
    g = torch.Generator().manual_seed(rope + heads)
    s, d = 9, 512 + rope
    query = torch.randn(s, 1, heads, d, dtype=torch.float64, generator=g, requires_grad=True)
    kv = torch.randn(s, 1, 1, d, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.randint(-1, s, (1, s, 6), generator=g)
    idx = torch.sort(torch.where(idx >= 0, idx, -1), dim=-1).values
    idx[..., 1:] = torch.where(idx[..., 1:] == idx[..., :-1], -1, idx[..., 1:])  # unique slots
    start = torch.tensor([0] * 4 + [4] * 5)
    ours = sparse_mla_tilelang(query, kv, idx, 0.05, v_channels=512, key_start=start,
                               kernel=_reference_kernel)
    ref = sparse_mla_attention(query, kv, idx, 0.05, v_channels=512, chunk_size=3, key_start=start)
    grad = torch.randn_like(ref)
    g_ours = torch.autograd.grad(ours, (query, kv), grad)
    g_ref = torch.autograd.grad(ref, (query, kv), grad)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
