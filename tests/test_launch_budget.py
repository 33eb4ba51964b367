"""Launch budget (issue #12): the aten ops our own code runs per forward and backward of the
rotary and of one GLMSparseMLA layer with its indexer, pinned exactly (each is a kernel on a GPU).

Expected counts are derived op by op from the code in the comments; a change that adds a kernel
to a layer fails here. Submodules (megatron's linears, torch's norms, the core attention) and the
indexer's top-k kernel are outside the count."""

from __future__ import annotations

import torch

from kpool_layers.mla.rope import Rotary
from tests.op_counts import OwnOps
from tests.test_attention import build, tiny_config


class _Apply(torch.nn.Module):
    """A module around a rotary function, for :class:`OwnOps`."""

    def __init__(self, rotate) -> None:
        super().__init__()
        self.rotate = rotate

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.rotate(t)


ROTATION_FWD = 5
"""de-interleave (one copy), x * cos, partner(x) (one roll or flip), partner * sin, the sum."""
ROTATION_BWD = 5
"""g * cos, g * sin, the partner's inverse roll, the sum of the two gradients, the de-interleave's
inverse copy."""


def test_rotation_runs_five_kernels_each_way_with_tables_built_once() -> None:
    rotary = Rotary(dim=8, base=100.0, yarn=False)
    module = _Apply(rotary.bind_arange(7, torch.device("cpu"), mla_interleaved=True))
    t = torch.randn(7, 2, 3, 8, requires_grad=True)
    module(t)  # builds the tables of this length
    with OwnOps(module) as ops:
        module(t).sum().backward()
    assert ops.counts[("", "fwd")] == ROTATION_FWD
    assert ops.counts[("", "bwd")] == ROTATION_BWD


def test_attention_layer_own_kernels(single_rank_parallel_state) -> None:
    """One GLMSparseMLA layer (TP = CP = 1, one document per row, b = 2), indexer loss off: the
    kernels of the layer's and the indexer's own code once the per-length tables exist."""
    config = tiny_config(dsa_indexer_rope_interleaved=True)  # MLA and indexer rotary de-interleave
    layer = build(config)
    s, b = 12, 2
    window = torch.arange(s)[:, None] - torch.arange(config.dsa_indexer_topk)  # causal last keys
    selected = torch.where(window >= 0, window, -1)
    layer.indexer.range_topk = lambda *args, **kwargs: selected  # the top-k kernel: not ours here
    x = torch.randn(s, b, config.hidden_size, requires_grad=True)
    layer(x)  # builds the rotary tables, positions and pool layout of this length
    with OwnOps(layer) as ops:
        out, _ = layer(x)
        out.sum().backward()

    # forward: one rotation of q_pe and k_pe together (a cat, then the rotation), the query and
    # key cats, the two absorbed einsums (a bmm each) and the copy of the permuted value output.
    assert ops.counts[("", "fwd")] == 1 + ROTATION_FWD + 2 + 2 + 1
    # backward: two bmm per einsum, the rotation, and a cat for each split's gradient (kv ->
    # latent / k_pe, q -> nope / pe, the rotated pe -> query / key heads, kv_up -> W_uk / W_uv).
    assert ops.counts[("", "bwd")] == 4 + ROTATION_BWD + 4

    stages = config.dsa_indexer_head_dim.bit_length() - 1
    # indexer (no grad): q and keys as one tensor (a cat), its rotation and the cat with the
    # channels past the rotary ones, the Hadamard butterflies (add, sub, stack per stage, then
    # the scale), q and keys made contiguous again, the head weights' scale, and the stacks of
    # the two rows' indices and keys.
    assert ops.counts[("indexer", "fwd")] == 1 + ROTATION_FWD + 1 + (3 * stages + 1) + 2 + 1 + 2
    assert ops.counts[("indexer", "bwd")] == 0
