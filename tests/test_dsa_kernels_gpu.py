"""Every ``model.dsa_kernels`` backend against the torch path on a GPU (marked ``gpu``; run on the
device, results in docs/benchmarks.md): the sparse MLA forward and both gradients in bf16 against
an FP32 reference (relative error <= 2e-2), the indexer top-k sets, and whole attention layers
(plain, KPool + tail, packed THD) built from the spec with each backend."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kpool_layers.dsa.backends import range_topk_kernel
from kpool_layers.dsa.kpool import pool_layout
from kpool_layers.dsa.sparse_attention import sparse_mla_attention
from kpool_layers.dsa.topk import index_scores
from tests.test_attention import build, thd, tiny_config

pytestmark = pytest.mark.gpu
BACKENDS = ["triton"] + (["tilelang"] if importlib.util.find_spec("tilelang") else [])
REL = 2e-2  # bf16 operands (8-bit mantissa, ~4e-3 per rounding) over fp32 accumulation


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def _attention(backend: str):
    if backend == "triton":
        from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

        return sparse_mla_triton
    from kpool_layers.kernels.tilelang_dsa import megatron_sparse_mla, sparse_mla_tilelang

    kernel = megatron_sparse_mla()
    return lambda *a, **k: sparse_mla_tilelang(*a, kernel=kernel, **k)


def _indices(s: int, width: int, start: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[1, s, width] distinct random keys in each query's [start, i], -1 padded."""
    keys = torch.arange(s, device="cuda")
    score = torch.rand(s, s, device="cuda", generator=g)
    visible = (keys[None] <= keys[:, None]) & (keys[None] >= start[:, None])
    val, idx = torch.topk(score.masked_fill(~visible, -1.0), width, dim=-1)
    return torch.where(val >= 0, idx, -1)[None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,rope", [(64, 64), (20, 64), (16, 0)])
@pytest.mark.parametrize("packed", [False, True])
def test_sparse_mla_matches_fp32_reference(backend: str, heads: int, rope: int, packed: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(heads + rope)
    s, v, width = 1024, 512, 256
    d = v + rope
    q = torch.randn(s, 1, heads, d, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(s, 1, 1, d, device="cuda", generator=g).bfloat16().requires_grad_()
    start = (torch.arange(s, device="cuda") // 300 * 300) if packed else torch.zeros(s, dtype=torch.long, device="cuda")
    idx = _indices(s, width, start, g)
    grad = torch.randn(s, 1, heads, v, device="cuda", generator=g).bfloat16()
    out = _attention(backend)(q, kv, idx, d ** -0.5, v_channels=v, key_start=start)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    ref = sparse_mla_attention(q32, kv32, idx, d ** -0.5, v_channels=v, chunk_size=256,
                               key_start=start)
    rq, rkv = torch.autograd.grad(ref, (q32, kv32), grad.float())
    assert _rel(out, ref) <= REL and _rel(dq, rq) <= REL and _rel(dkv, rkv) <= REL


def test_triton_sparse_mla_is_bitwise_deterministic() -> None:
    from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    s, heads, d, v = 2048, 64, 576, 512
    q = torch.randn(s, 1, heads, d, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(s, 1, 1, d, device="cuda", generator=g).bfloat16().requires_grad_()
    idx = _indices(s, 2048, torch.zeros(s, dtype=torch.long, device="cuda"), g)
    grad = torch.randn(s, 1, heads, v, device="cuda", generator=g).bfloat16()
    runs = []
    for _ in range(2):
        out = sparse_mla_triton(q, kv, idx, d ** -0.5, v_channels=v)
        runs.append((out, *torch.autograd.grad(out, (q, kv), grad)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("packed", [False, True])
def test_triton_sparse_mla_with_query_pos_matches_torch(packed: bool) -> None:
    """Context parallelism, CP=2: each rank's query rows (chunks r and 3 - r of 4, rank 0's not
    contiguous) with ``query_pos`` against all 1024 latent keys. bf16 Triton vs the FP32 torch path
    given the same ``query_pos``: output, dq, dkv ``[s_kv, 1, 1, d]`` and the slot probabilities;
    bit-deterministic; and the ranks' dkv add up to the full-sequence Triton run's dkv."""
    from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton
    from tests.test_sparse_attention import cp_rows

    g = torch.Generator(device="cuda").manual_seed(11 + packed)
    s, heads, d, v, width, cp = 1024, 16, 576, 512, 256, 2
    scale = d ** -0.5
    q = torch.randn(s, 1, heads, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(s, 1, 1, d, device="cuda", generator=g).bfloat16().requires_grad_()
    start = torch.arange(s, device="cuda") // 300 * 300
    if not packed:
        start = torch.zeros_like(start)
    idx = _indices(s, width, start, g).int()  # [1, s, width]
    grad = torch.randn(s, 1, heads, v, device="cuda", generator=g).bfloat16()
    total = torch.zeros(s, 1, 1, d, device="cuda")
    for rank in range(cp):
        rows = cp_rows(s, cp, rank).cuda()
        q_local = q[rows].requires_grad_()
        idx_local, start_local = idx[:, rows], start[rows]
        runs = []
        for _ in range(2):
            out, probs = sparse_mla_triton(q_local, kv, idx_local, scale, v_channels=v,
                                           key_start=start_local, query_pos=rows,
                                           return_slot_probs=True)
            runs.append((out, probs, *torch.autograd.grad(out, (q_local, kv), grad[rows])))
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        out, probs, dq, dkv = runs[0]
        assert out.shape == (s // 2, 1, heads, v) and dkv.shape == (s, 1, 1, d)
        assert not dkv[int(rows.max()) + 1:].any()  # keys no local row may see
        q32, kv32 = q_local.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
        ref = sparse_mla_attention(q32, kv32, idx_local, scale, v_channels=v, chunk_size=256,
                                   key_start=start_local, query_pos=rows)
        rq, rkv = torch.autograd.grad(ref, (q32, kv32), grad[rows].float())
        assert _rel(out, ref) <= REL and _rel(dq, rq) <= REL and _rel(dkv, rkv) <= REL
        # slot probabilities: fp32 softmax over each row's valid slots, summed over heads
        keys = idx_local[0].long()  # [s_q, W]
        valid = (keys >= start_local[:, None]) & (keys <= rows[:, None])
        k_sel = kv32.detach()[keys.clamp(min=0), 0, 0]  # [s_q, W, d]
        scores = torch.einsum("snd,swd->snw", q32.detach()[:, 0], k_sel) * scale
        want = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), -1)
        assert _rel(probs[0], want.nan_to_num(0.0).sum(1)) <= REL
        total += dkv.float()
    full = sparse_mla_triton(q.detach().requires_grad_(), kv, idx, scale, v_channels=v,
                             key_start=start)
    (full_dkv,) = torch.autograd.grad(full, (kv,), grad)
    assert _rel(total, full_dkv) <= REL  # what CP's reduce-scatter of the key gradient adds up


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,width", [(16, 131), (64, 131), (16, 128)])
def test_sparse_mla_slot_widths_of_kpool(backend: str, heads: int, width: int) -> None:
    """KPool's ``topk + kpool - 1`` slots with -1 groups in the middle of a row (unselected pools
    before the tail). megatron's own padding of such widths is wrong below 64 heads (16 heads,
    W = 131: relative error 0.5), which the TileLang adapter avoids by padding itself."""
    g = torch.Generator(device="cuda").manual_seed(heads + width)
    s, v, d = 1024, 512, 576
    q = torch.randn(s, 1, heads, d, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(s, 1, 1, d, device="cuda", generator=g).bfloat16().requires_grad_()
    idx = torch.roll(_indices(s, width, torch.zeros(s, dtype=torch.long, device="cuda"), g),
                     width // 2, dims=-1)  # -1 slots mid-row
    grad = torch.randn(s, 1, heads, v, device="cuda", generator=g).bfloat16()
    out = _attention(backend)(q, kv, idx, d ** -0.5, v_channels=v, key_start=None)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    ref = sparse_mla_attention(q32, kv32, idx, d ** -0.5, v_channels=v, chunk_size=256)
    rq, rkv = torch.autograd.grad(ref, (q32, kv32), grad.float())
    assert _rel(out, ref) <= REL and _rel(dq, rq) <= REL and _rel(dkv, rkv) <= REL


@pytest.mark.skipif("tilelang" not in BACKENDS, reason="needs tilelang")
@pytest.mark.parametrize("rope", [64, 0])
def test_tilelang_sparse_mla_with_query_pos_matches_torch(rope: int) -> None:
    """megatron's TileLang SparseMLA with local query rows (CP=2, rank 0: chunks 0 and 3 of 4)
    against all latent keys (``s_q != s_kv``) vs the FP32 torch path: output, dq, dkv."""
    from tests.test_sparse_attention import cp_rows

    g = torch.Generator(device="cuda").manual_seed(5 + rope)
    s, heads, v, width = 1024, 64, 512, 256
    d = v + rope
    start = torch.arange(s, device="cuda") // 300 * 300
    idx = _indices(s, width, start, g)
    rows = cp_rows(s, 2, 0).cuda()
    q = torch.randn(s // 2, 1, heads, d, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(s, 1, 1, d, device="cuda", generator=g).bfloat16().requires_grad_()
    grad = torch.randn(s // 2, 1, heads, v, device="cuda", generator=g).bfloat16()
    out = _attention("tilelang")(q, kv, idx[:, rows], d ** -0.5, v_channels=v,
                                 key_start=start[rows], query_pos=rows)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    ref = sparse_mla_attention(q32, kv32, idx[:, rows], d ** -0.5, v_channels=v, chunk_size=256,
                               key_start=start[rows], query_pos=rows)
    rq, rkv = torch.autograd.grad(ref, (q32, kv32), grad.float())
    assert _rel(out, ref) <= REL and _rel(dq, rq) <= REL and _rel(dkv, rkv) <= REL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kpool", [1, 4])
def test_indexer_topk_selects_the_torch_sets(backend: str, kpool: int) -> None:
    """Same sets as the torch path except where scores tie within FP32 rounding."""
    g = torch.Generator(device="cuda").manual_seed(kpool)
    s, h, dim, topk = 4096, 32, 128, 2048
    cu = torch.tensor([0, 1000, s], device="cuda")
    layout = pool_layout(s, kpool, cu, device="cuda")
    q = torch.randn(s, h, dim, device="cuda", generator=g).bfloat16()
    keys = torch.randn(layout.n_pools, dim, device="cuda", generator=g).bfloat16()
    w = torch.randn(s, h, device="cuda", generator=g)
    args = (q, keys, w, layout.query_lo, layout.query_hi)
    ours = range_topk_kernel(backend, 1024)(*args, topk=topk // kpool, relu=True)
    ref = range_topk_kernel("torch", 512)(*args, topk=topk // kpool, relu=True)
    assert torch.equal((ours >= 0).sum(-1), (ref >= 0).sum(-1))
    scores = index_scores(q, keys, w, relu=True)
    kth = scores.gather(1, ref.clamp_min(0)).masked_fill(ref < 0, float("inf")).min(-1).values
    for row in torch.nonzero((ours.sort(-1).values != ref.sort(-1).values).any(-1)).flatten():
        extra = set(ours[row].tolist()) - set(ref[row].tolist())
        tol = 1e-5 * scores[row].abs().max()
        assert all(abs(scores[row, k] - kth[row]) <= tol for k in extra), int(row)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kpool,rope,packed", [(1, 64, False), (4, 0, True), (1, 64, True)])
def test_layer_with_backend_matches_torch_layer(single_rank_parallel_state, backend: str,
                                                 kpool: int, rope: int, packed: bool) -> None:
    """One GLMSparseMLA layer (GLM-5 latent dims, 16 heads) built with each backend: same output
    and weight gradients as the torch-backed layer with the same weights, in bf16."""
    kw = dict(hidden_size=256, num_attention_heads=16, q_lora_rank=128, kv_lora_rank=512,
              qk_head_dim=64, qk_pos_emb_head_dim=rope, v_head_dim=64, dsa_indexer_n_heads=8,
              dsa_indexer_head_dim=64, dsa_indexer_topk=128, dsa_indexer_kpool=kpool,
              dsa_indexer_kpool_always_select_tail=kpool > 1, rope_type="rope",
              params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=False)
    torch.manual_seed(0)
    ref_layer = build(tiny_config(**kw)).cuda()
    layer = build(tiny_config(**kw, dsa_kernels=backend)).cuda()
    layer.load_state_dict(ref_layer.state_dict())
    x = torch.randn(1024, 1, 256, device="cuda", dtype=torch.bfloat16)
    params = {"packed_seq_params": thd([0, 300, 1024])} if packed else {}
    outs = []
    for mod in (ref_layer, layer):
        out, _ = mod(x, None, **params)
        out.float().square().sum().backward()
        outs.append((out, {n: p.grad for n, p in mod.named_parameters() if p.grad is not None}))
    (ref_out, ref_grads), (out, grads) = outs
    assert _rel(out, ref_out) <= REL
    for name, grad in ref_grads.items():
        assert _rel(grads[name], grad) <= REL, name


@pytest.mark.parametrize("kpool", [1, 4])
def test_triton_sparse_indexer_loss_from_the_forward_matches_torch(single_rank_parallel_state,
                                                                   kpool: int) -> None:
    """dsa_kernels=triton takes the sparse indexer-loss target from the attention forward's slot
    probabilities; the loss and the indexer's gradients match the torch layer's recomputation."""
    kw = dict(hidden_size=256, num_attention_heads=16, q_lora_rank=128, kv_lora_rank=512,
              qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=64, dsa_indexer_n_heads=8,
              dsa_indexer_head_dim=64, dsa_indexer_topk=128, dsa_indexer_kpool=kpool,
              dsa_indexer_kpool_always_select_tail=kpool > 1, rope_type="rope",
              dsa_indexer_loss_coeff=1.0, dsa_indexer_use_sparse_loss=True,
              params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=False)
    torch.manual_seed(0)
    ref_layer = build(tiny_config(**kw)).cuda()
    layer = build(tiny_config(**kw, dsa_kernels="triton")).cuda()
    layer.load_state_dict(ref_layer.state_dict())
    x = torch.randn(1024, 1, 256, device="cuda", dtype=torch.bfloat16)
    losses, grads = [], []
    for mod in (ref_layer, layer):
        mod.train()
        out, _ = mod(x, None)
        out.float().square().sum().backward()
        losses.append(mod.pop_indexer_loss())
        grads.append({n: p.grad for n, p in mod.indexer.named_parameters() if p.grad is not None})
    assert losses[0] > 0 and abs(losses[1] - losses[0]) <= REL * losses[0]
    for name, grad in grads[0].items():
        assert _rel(grads[1][name], grad) <= REL, name  # same inputs; targets differ by fp32 sum order
