"""``model.dsa_kernels``: resolution, errors before the build, the spec's choice, the kernel map, and
the TileLang adapter's padding (run on CPU with the torch path standing in for the kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kpool_layers.dsa import backends as dsa_kernels
from kpool_layers.mla.attention import glm_attention_spec
from kpool_layers.dsa.core_attention import CORE_ATTENTION, TorchSparseMLA
from kpool_layers.kernels.tilelang_dsa import (TILELANG_SLOT_BLOCK, sparse_mla_tilelang, tilelang_heads,
                                               valid_indices)
from kpool_layers.dsa.sparse_attention import sparse_mla_attention
from recipes.launch.distributed import register_resolvers
from recipes.config.schema import ConfigError, register_configs
from recipes.config.rules import validate
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
    from recipes.observe.precision_map import kernel_rows

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


def test_valid_indices_with_query_pos() -> None:
    """Query rows at key positions 1 and 3 of 5 keys (context parallelism): the causal bound is
    query_pos, not the row number."""
    idx = torch.tensor([[[0, 1, 2, -1], [4, 3, 1, 2]]])  # [1, 2, 4]
    pos = torch.tensor([1, 3])
    assert valid_indices(idx, torch.tensor([0, 2]), pos).tolist() == [[[0, 1, -1, -1],
                                                                      [-1, 3, -1, 2]]]
    assert valid_indices(idx, None, pos).tolist() == [[[0, 1, -1, -1], [-1, 3, 1, 2]]]
    assert valid_indices(idx, None).tolist() == [[[0, -1, -1, -1], [-1, -1, 1, -1]]]  # rows 0, 1


def _reference_kernel(q, kv, indices, scale):
    """SparseMLA's contract on the torch path: q [b, s_q, H, 576], kv [b, s_kv, 1, 576], int32
    indices [b, s_q, 1, W]; only -1 slots are skipped (no causal mask: every query may see every
    key, ``query_pos = s_kv - 1``), so the adapter alone must mask."""
    b, s_q, heads, d = q.shape
    s_kv = kv.size(1)
    assert d == 576 and kv.shape == (b, s_kv, 1, d) and (heads in (16, 32, 64) or heads % 64 == 0)
    assert indices.shape[:3] == (b, s_q, 1) and indices.dtype == torch.int32
    assert indices.shape[3] % TILELANG_SLOT_BLOCK == 0  # SparseMLA pads other widths wrongly
    assert q.is_contiguous() and kv.is_contiguous() and indices.is_contiguous()
    out = sparse_mla_attention(q.transpose(0, 1), kv.transpose(0, 1), indices[:, :, 0].long(),
                               scale, v_channels=512, chunk_size=4,
                               query_pos=torch.full((s_q,), s_kv - 1))
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


@pytest.mark.parametrize("rope", [64, 0])
def test_tilelang_adapter_with_query_pos_is_exact(rope: int) -> None:
    """Context parallelism through the adapter: a CP rank's 6 non-contiguous query rows (CP=2,
    rank 0: chunks 0 and 3 of 4) against all 12 keys equal the torch path with the same query_pos,
    output and both gradients (the latent-key gradient [s_kv, b, 1, d]), float64."""
    from tests.test_sparse_attention import cp_rows

    g = torch.Generator().manual_seed(7 + rope)
    s, heads, d = 12, 5, 512 + rope
    rows = cp_rows(s, 2, 0)  # [0, 1, 2, 9, 10, 11]
    query = torch.randn(len(rows), 2, heads, d, dtype=torch.float64, generator=g,
                        requires_grad=True)
    kv = torch.randn(s, 2, 1, d, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(s, generator=g)[:7] for _ in range(2 * len(rows))])
    idx = idx.view(2, len(rows), 7).masked_fill(torch.rand(2, len(rows), 7, generator=g) < 0.2, -1)
    start = torch.tensor([0] * 5 + [5] * 7)[rows]  # documents [0, 5), [5, 12)
    ours = sparse_mla_tilelang(query, kv, idx, 0.05, v_channels=512, key_start=start,
                               query_pos=rows, kernel=_reference_kernel)
    ref = sparse_mla_attention(query, kv, idx, 0.05, v_channels=512, chunk_size=4,
                               key_start=start, query_pos=rows)
    assert ours.shape == (len(rows), 2, heads, 512) and ref.abs().sum() > 0
    grad = torch.randn_like(ref)
    g_ours = torch.autograd.grad(ours, (query, kv), grad)
    g_ref = torch.autograd.grad(ref, (query, kv), grad)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert g_ours[1].shape == (s, 2, 1, d)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="latent_kv"):
        sparse_mla_tilelang(query, kv, idx, 0.05, v_channels=512, key_start=start,
                            kernel=_reference_kernel)  # s_kv != s_q needs query_pos
    with pytest.raises(ValueError, match="query_pos"):
        sparse_mla_tilelang(query, kv, idx, 0.05, v_channels=512, key_start=start,
                            query_pos=rows[:4], kernel=_reference_kernel)
