"""kpool_layers.compat.multi_tensor: torch's foreach kernels in megatron's multi-tensor seam (no TE / apex).

End to end, every run built by ``recipes.loop`` clips through them
(``tests/test_train.py::test_resume_reproduces_the_uninterrupted_run`` reproduces a run bit for
bit through a resume with them installed)."""

from __future__ import annotations

import megatron.core.optimizer.clip_grads as clip_grads
import megatron.core.optimizer.optimizer as megatron_optimizer
import pytest
import torch
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale
from torch.utils._python_dispatch import TorchDispatchMode

from kpool_layers.compat import multi_tensor
from tests.op_counts import NO_KERNEL

EPS = torch.finfo(torch.float32).eps


class _Ops(TorchDispatchMode):
    """The kernel-launching aten ops run inside it, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN204
        if func._overloadpacket.__name__ not in NO_KERNEL:
            self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _grads(n: int = 5, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3 + i, 2 * i + 1, generator=gen) * 10.0 ** (i - 2) for i in range(n)]


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's seam as this process has it without TE/apex, then :func:`install` (restored
    after the test)."""
    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", local_multi_tensor_scale)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", None)
    monkeypatch.setattr(megatron_optimizer, "multi_tensor_scale_impl", local_multi_tensor_scale)
    assert multi_tensor.install()


def test_l2_norm_is_the_local_fallbacks_bit_for_bit() -> None:
    grads = _grads()
    noop = torch.zeros(1, dtype=torch.int)
    ours, per_tensor = multi_tensor.l2_norm(2048 * 32, noop, [grads], False)
    theirs, _ = local_multi_tensor_l2_norm(2048 * 32, noop, [grads], False)
    assert per_tensor is None
    assert ours.shape == (1,) and ours.dtype == torch.float32
    assert torch.equal(ours, theirs)
    _, norms = multi_tensor.l2_norm(2048 * 32, noop, [grads], True)
    assert torch.equal(torch.stack(norms), torch.stack([g.norm() for g in grads]))


@pytest.mark.parametrize("factor", [1.0, 0.37])
def test_scale_is_the_local_fallbacks_bit_for_bit(factor: float) -> None:
    noop = torch.zeros(1, dtype=torch.int)
    src = _grads()
    ours = [torch.empty_like(g, dtype=torch.bfloat16) for g in src]  # main -> model params copy
    theirs = [torch.empty_like(g, dtype=torch.bfloat16) for g in src]
    multi_tensor.scale(0, noop, [src, ours], factor)
    local_multi_tensor_scale(0, noop, [src, theirs], factor)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    in_place, expected = _grads(), [g * factor for g in _grads()]
    multi_tensor.scale(0, noop, [in_place, in_place], factor)
    assert all(torch.equal(a, b) for a, b in zip(in_place, expected))


def test_scale_by_tensor_multiplies_in_place() -> None:
    grads, factor = _grads(), torch.tensor([0.25])
    expected = [g * 0.25 for g in grads]
    multi_tensor.scale_by_tensor(0, torch.zeros(1, dtype=torch.int), [grads, grads], factor)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped, and left as it is
def test_megatron_clips_on_the_device_without_a_host_sync(installed: None, single_rank_parallel_state,
                                                           max_norm: float) -> None:
    """megatron's own ``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32`` through the seam:
    the norm stays a device tensor and the grads are scaled by ``min(1, max_norm / (norm + 1e-6))``.
    Tolerances: the fp32 norm of n terms is within ~n eps of the float64 one (n <= 5 tensors of
    <= 45 elements: 64 eps bounds it), and one fp32 multiply adds half an ulp."""
    params = [torch.nn.Parameter(g.clone()) for g in _grads()]
    for p in params:
        p.grad = p.detach().clone()
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    group = single_rank_parallel_state.get_data_parallel_group()
    with _Ops() as ops:
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=group)
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
    assert isinstance(norm, torch.Tensor) and norm.shape == (1,)
    assert abs(norm.double().item() - exact.item()) <= 64 * EPS * exact.item()
    coeff = min(1.0, max_norm / (exact.item() + 1e-6))
    for p in params:
        want = p.detach().double() * coeff
        assert torch.allclose(p.grad.double(), want, rtol=66 * EPS, atol=0.0)
    # the same 14 kernels for any number of gradients, and no ``.item()`` (``_local_scalar_dense``)
    assert ops.names == [
        "zeros", "zeros",  # megatron: the norm accumulator, the overflow buffer
        "_foreach_norm", "stack", "linalg_vector_norm",  # l2_norm
        "pow", "allreduce_", "pow",  # megatron: norm ** 2, its all-reduce, ** (1 / 2)
        "add", "reciprocal", "mul",  # megatron: max_norm / (norm + 1e-6)
        "zeros", "clamp_max_",  # megatron: the overflow buffer, the coefficient's min(1, .)
        "_foreach_mul_",  # scale_by_tensor
    ]


def test_install_is_idempotent_and_leaves_te_or_apex_kernels_alone(installed: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert multi_tensor.install()
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_tensor_impl is multi_tensor.scale_by_tensor
    assert megatron_optimizer.multi_tensor_scale_impl is multi_tensor.scale

    def te_kernel(*args: object) -> None:
        raise AssertionError("not called here")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", te_kernel)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", te_kernel)
    assert not multi_tensor.install()
    assert clip_grads.l2_norm_impl is te_kernel and clip_grads.multi_tensor_scale_impl is te_kernel


@pytest.mark.gpu
def test_cuda_norm_and_clip_stay_on_the_device() -> None:
    """On CUDA: the l2 norm of 229 gradients (the glm5_proxy's count) as one device tensor within
    the FP32 bound of the float64 norm (``n`` terms per tensor and 229 tensors summed in FP32:
    ``gamma_(n_max + 229 + 2)`` of the squared norm), and the clip scale in place, with no host
    synchronisation (CUDA's sync debug mode raises on one)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(int(n), device="cuda", generator=gen) for n in torch.randint(1, 70_000, (229,))]
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    exact = torch.cat([g.double() for g in grads]).norm().item()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = multi_tensor.l2_norm(0, noop, [grads], False)
        factor = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        scaled = [g.clone() for g in grads]
        multi_tensor.scale_by_tensor(0, noop, [scaled, scaled], factor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    u = 2.0**-24
    terms = max(g.numel() for g in grads) + len(grads) + 2
    assert norm.shape == (1,) and norm.is_cuda
    assert abs(norm.item() - exact) <= terms * u / (1 - terms * u) * exact
    for g, s in zip(grads, scaled):
        assert torch.equal(s, g * factor.reshape(()))
