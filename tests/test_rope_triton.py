"""The rotary kernel (:mod:`kpool_layers.kernels.rope_triton`, route ``rope``) against the torch ops
of :class:`kpool_layers.mla.rope.RotaryTables`: the rotation, its gradient and the concatenation
with a rotation (MLA's query and key) equal bit for bit, under Triton's interpreter on the CPU
and on a GPU at glm5_proxy's shapes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from kpool_layers.mla.rope import Rotary, route_kernel
from tests.interpreter import run_interpreted

Case = tuple[int, int, int, int, int, bool, bool, bool, int]
"""``(s, b, n, d, rot, mla_interleaved, pairs, yarn, rest)``: ``[s, b, n, d]`` tensors, ``rot``
rotary channels, megatron's MLA de-interleave, rotary_interleaved pairs, YaRN tables, ``rest``
channels before a concatenated rotation."""


def _run(fn: Callable[..., torch.Tensor | list[torch.Tensor]], inputs: Sequence[torch.Tensor], seed: int
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fn(*inputs)`` flattened and its inputs' gradients for a random output gradient (``seed``)."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    flat = torch.cat([o.flatten() for o in out]) if isinstance(out, list) else out
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    flat.backward(torch.randn(flat.shape, generator=gen, device=flat.device).to(flat.dtype))
    return flat.detach(), [x.grad for x in inputs]


def _same(got: tuple[torch.Tensor, list[torch.Tensor]], want: tuple[torch.Tensor, list[torch.Tensor]],
          what: str) -> None:
    for i, (a, b) in enumerate(zip([got[0], *got[1]], [want[0], *want[1]], strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
        assert torch.equal(a, b), (what, i, (a.float() - b.float()).abs().max())


def check_cases(device: str, cases: Sequence[Case]) -> int:
    """The kernel's rotation (of a strided view, with its pass-through channels) and its
    concatenations (query heads and one key head, ``cat(rest, rotated pe)``) against the torch ops,
    forward and backward, bit for bit; returns the number of cases checked."""
    from kpool_layers.kernels import rope_triton

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    for i, (s, b, n, d, rot, mla, pairs, yarn, rest) in enumerate(cases):
        rotary = Rotary(dim=rot, base=10000.0, yarn=yarn, scaling_factor=4.0,
                        original_max_position_embeddings=8, concentration=1.1 if yarn else 1.0,
                        rotary_interleaved=pairs)
        tables = rotary.tables(torch.arange(3, 3 + s, device=device), torch.bfloat16)
        t = randn(s, b, n, d + 5, scale=30.0)[..., 5:]  # strided, as MLA's q_pe in q
        _same(_run(lambda x: tables.rotate(x, mla_interleaved=mla, kernel=rope_triton), [t], i),
              _run(lambda x: tables.rotate_torch(x, mla_interleaved=mla), [t], i), f"rotate {i}")
        parts = [randn(s, b, n, rest), randn(s, b, 1, rest), randn(s, b, n, rot + 3)[..., 3:], randn(s, b, 1, rot)]
        _same(_run(lambda *x: tables.rotate_concat(x[:2], x[2:], mla_interleaved=mla, kernel=rope_triton), parts, i),
              _run(lambda *x: tables.rotate_concat(x[:2], x[2:], mla_interleaved=mla), parts, i), f"concat {i}")
    return len(cases)


def test_kernel_equals_torch_ops_bit_for_bit_under_the_interpreter() -> None:
    """Every convention (MLA de-interleave or not, pairs or halves, RoPE or YaRN tables), the rotary
    channels alone and with pass-through channels, strided inputs, and the concatenations with
    their gradients; rows of more than one program's block."""
    cases = [(5, 2, 3, 8, 8, True, False, False, 40), (7, 1, 2, 24, 16, False, False, True, 130),
             (3, 2, 2, 8, 8, False, True, False, 3), (33, 1, 2, 8, 8, True, False, True, 40)]
    out = run_interpreted(f"from tests.test_rope_triton import check_cases\n"
                          f"print('cases', check_cases('cpu', {cases!r}))")
    assert "cases 4" in out


def test_route_leaves_cpu_tensors_to_the_torch_ops() -> None:
    assert route_kernel(torch.zeros(2, 1, 1, 8, dtype=torch.bfloat16), 8) is None


def test_kernel_refuses_what_it_cannot_rotate() -> None:
    from kpool_layers.kernels import rope_triton

    x = torch.zeros(2, 1, 1, 6, dtype=torch.bfloat16)
    cos = torch.zeros(2, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        rope_triton.rope(x, None, cos, cos, x, None, backward=False, mla_interleaved=True, pairs=False)
    x = torch.zeros(2, 1, 1, 8)
    with pytest.raises(ValueError, match="BF16"):
        rope_triton.rope(x, None, cos, cos, x, None, backward=False, mla_interleaved=True, pairs=False)


@pytest.mark.gpu
def test_gpu_kernel_equals_torch_ops_at_glm5_proxy_shapes() -> None:
    """On the GPU: glm5_proxy's MLA rotation (16 query heads, rope 64; the concatenation with the
    512-channel latent) and its indexer's q and keys (33 heads of 128, rope-first), bit for bit,
    forward and backward; the route picks the kernel for them."""
    assert check_cases("cuda", [(4096, 1, 16, 64, 64, True, False, False, 512),
                                (4096, 1, 33, 128, 64, True, False, False, 128)]) == 2
    assert route_kernel(torch.zeros(4, 1, 1, 64, dtype=torch.bfloat16, device="cuda"), 64) is not None
