"""Sparse absorbed-MLA attention equals dense attention with a mask keeping exactly the selected
keys (fp64 reference), forward and backward."""

from __future__ import annotations

import pytest
import torch

from kpool_layers.dsa.sparse_attention import sparse_mla_attention


def dense_masked_reference(query: torch.Tensor, latent_kv: torch.Tensor, topk: torch.Tensor,
                           scale: float, v_channels: int,
                           key_start: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 dense attention; key j is visible to query i iff j is in topk[b, i], j <= i and
    j >= key_start[i]. Rows without a visible key return 0."""
    s, b, n, d = query.shape
    q = query.double().permute(1, 2, 0, 3)  # [b, n, s, d]
    k = latent_kv.double().permute(1, 2, 0, 3)  # [b, 1, s, d]
    scores = q @ k.transpose(-1, -2) * scale  # [b, n, s, s]
    keep = torch.zeros(b, s, s + 1, dtype=torch.bool)
    keep.scatter_(2, torch.where(topk < 0, s, topk).long(), True)
    keep = keep[..., :s]
    rows = torch.arange(s)
    keep &= rows[None, None, :] <= rows[None, :, None]
    if key_start is not None:
        keep &= rows[None, None, :] >= key_start[None, :, None]
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = probs @ k[..., :v_channels]  # [b, n, s, v]
    return out.permute(2, 0, 1, 3)


def _inputs(s: int = 10, b: int = 2, n: int = 3, d: int = 12, width: int = 5,
            dtype: torch.dtype = torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(s, b, n, d, generator=gen, dtype=torch.float64).to(dtype)
    latent = torch.randn(s, b, 1, d, generator=gen, dtype=torch.float64).to(dtype)
    # random causal picks (some future / duplicate / empty slots on purpose)
    topk = torch.randint(-1, s, (b, s, width), generator=gen)
    return query.requires_grad_(), latent.requires_grad_(), topk


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
def test_sparse_equals_dense_masked_fp64(chunk: int) -> None:
    query, latent, topk = _inputs()
    out = sparse_mla_attention(query, latent, topk, 0.3, v_channels=8, chunk_size=chunk)
    ref = dense_masked_reference(query, latent, topk, 0.3, 8)
    assert out.shape == (10, 2, 3, 8) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(out, (query, latent)), _grads(ref, (query, latent))):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_document_start_masks_earlier_documents() -> None:
    query, latent, topk = _inputs(s=9, width=9)
    key_start = torch.tensor([0, 0, 0, 3, 3, 3, 3, 7, 7])
    out = sparse_mla_attention(query, latent, topk, 0.5, v_channels=12, chunk_size=4,
                               key_start=key_start)
    ref = dense_masked_reference(query, latent, topk, 0.5, 12, key_start)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(out, (query, latent)), _grads(ref, (query, latent))):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    unmasked = sparse_mla_attention(query, latent, topk, 0.5, v_channels=12, chunk_size=4)
    assert not torch.allclose(out[3:], unmasked[3:])


def test_rows_without_valid_keys_are_zero_not_nan() -> None:
    query, latent, _ = _inputs(s=6, b=1)
    topk = torch.full((1, 6, 3), -1)
    topk[0, 4] = torch.tensor([5, -1, 2])  # only key 2 valid (5 is in the future)
    topk[0, 1] = torch.tensor([3, 4, 5])  # all future -> empty
    out = sparse_mla_attention(query, latent, topk, 1.0, v_channels=4, chunk_size=2)
    grads = _grads(out, (query, latent))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    empty_rows = [0, 1, 2, 3, 5]
    assert (out[empty_rows] == 0).all()
    assert (grads[0][empty_rows] == 0).all()
    torch.testing.assert_close(out[4, 0], latent[2, 0, 0, :4].expand(3, 4))


def test_duplicate_indices_count_once() -> None:
    query, latent, _ = _inputs(s=5, b=1)
    dup = torch.tensor([[[0, 0, 0, -1]] * 5]).expand(1, 5, 4).clone()
    dup[0, 4] = torch.tensor([0, 3, 3, 0])
    once = dup.clone()
    once[0, 4] = torch.tensor([0, 3, -1, -1])
    out_dup = sparse_mla_attention(query, latent, dup, 1.0, v_channels=6, chunk_size=2)
    out_once = sparse_mla_attention(query, latent, once, 1.0, v_channels=6, chunk_size=2)
    torch.testing.assert_close(out_dup, out_once, rtol=0, atol=0)
    torch.testing.assert_close(out_dup, dense_masked_reference(query, latent, dup, 1.0, 6))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_close_to_fp64(dtype: torch.dtype, tol: float) -> None:
    query, latent, topk = _inputs(s=12, dtype=dtype, width=6)
    out = sparse_mla_attention(query, latent, topk, 0.25, v_channels=8, chunk_size=5)
    ref = dense_masked_reference(query, latent, topk, 0.25, 8)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    grads = _grads(out, (query, latent))
    ref_grads = _grads(ref, (query, latent))
    assert grads[0].dtype == dtype and grads[1].dtype == dtype
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * 4)


def test_saved_activations_are_linear_in_sequence_length() -> None:
    s, n, width, d = 128, 2, 8, 12
    query, latent, topk = _inputs(s=s, b=1, n=n, d=d, width=width)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sparse_mla_attention(query, latent, topk, 1.0, v_channels=8, chunk_size=4)
    out.sum().backward()
    # inputs, output and log-sum-exp only: never [s, s] scores nor [s, W, d] gathered keys
    assert saved and max(saved) <= s * n * d < s * width * d
    assert sum(saved) == s * n * d + s * d + s * width + s * n * 8 + s * n


def test_shape_validation() -> None:
    query, latent, topk = _inputs()
    with pytest.raises(ValueError, match="latent_kv"):
        sparse_mla_attention(query, latent[:, :, :, :4], topk, 1.0, v_channels=4, chunk_size=4)
    with pytest.raises(ValueError, match="topk_indices"):
        sparse_mla_attention(query, latent, topk.transpose(0, 1), 1.0, v_channels=4, chunk_size=4)
    with pytest.raises(ValueError, match="v_channels"):
        sparse_mla_attention(query, latent, topk, 1.0, v_channels=13, chunk_size=4)


@pytest.mark.gpu
def test_cuda_bf16_matches_reference_and_peak_memory_is_linear() -> None:
    device = torch.device("cuda")
    query, latent, topk = _inputs(s=256, b=1, n=4, d=40, width=32, dtype=torch.bfloat16)
    out = sparse_mla_attention(query.to(device), latent.to(device), topk.to(device), 0.2,
                               v_channels=32, chunk_size=64)
    ref = dense_masked_reference(query, latent, topk, 0.2, 32)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=3e-2, atol=3e-2)

    def extra_peak_mib(s: int) -> float:
        inputs = _inputs(s=s, b=1, n=16, d=576, width=256, dtype=torch.bfloat16)
        q, k, idx = (t.detach().to(device) for t in inputs)
        q.requires_grad_()
        k.requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sparse_mla_attention(q, k, idx, 0.05, v_channels=512, chunk_size=256).sum().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    small, large = extra_peak_mib(2048), extra_peak_mib(8192)
    assert large < 2.5 * small  # per-chunk buffers are constant; [s, W, d] grows 4x, [s, s] 16x


# ---- context parallelism: local query rows (query_pos) against the keys of the whole sequence ----

def cp_rows(s: int, cp: int, rank: int) -> torch.Tensor:
    """int64 query positions of ``rank`` under megatron's load-balanced CP split: the sequence is
    cut into ``2 cp`` chunks and the rank holds chunks ``rank`` and ``2 cp - 1 - rank``."""
    chunk = s // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _cp_problem(s: int = 16, seed: int = 3):
    """fp64 full problem with documents [0, 5), [5, 11), [11, 16) and random top-k (empty, future,
    other-document and duplicate slots on purpose; 9 slots from 16 keys repeat some keys)."""
    query, latent, topk = _inputs(s=s, b=2, n=3, d=12, width=9, seed=seed)
    bounds = torch.tensor([0, 5, 11])
    key_start = bounds[torch.searchsorted(bounds, torch.arange(s), right=True) - 1]
    topk[:, :, 1] = topk[:, :, 0]  # a duplicate in every row
    grad_out = torch.randn(s, 2, 3, 8, generator=torch.Generator().manual_seed(seed + 1),
                           dtype=torch.float64)
    return query, latent, topk, key_start, grad_out


def _local_run(query, latent, topk, key_start, grad_out, rows, chunk):
    """A rank's call: its query rows, all keys; returns (out, dq, dkv)."""
    q = query.detach()[rows].requires_grad_()
    out = sparse_mla_attention(q, latent, topk[:, rows], 0.4, v_channels=8, chunk_size=chunk,
                               key_start=key_start[rows], query_pos=rows)
    return (out, *torch.autograd.grad(out, (q, latent), grad_out[rows]))


# fp64 throughout: the local and the full run compute every row's softmax, output and query gradient
# with the same operations, and the key gradient as the same per-slot terms summed (index_add_) in
# another grouping of at most s * W = 144 terms of size O(1): differences ~ 144 * 2^-53 ~ 2e-14,
# bound 1e-12.
TOL64 = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("chunk", [3, 64])
def test_query_pos_equals_full_sequence_rows(cp: int, rank: int, chunk: int) -> None:
    """CP rank: output = the full run's rows; latent-key gradient = the full run's when the upstream
    gradient is zero on the other rows; keys past the rank's last row get exactly zero."""
    query, latent, topk, key_start, grad_out = _cp_problem()
    s = query.size(0)
    rows = cp_rows(s, cp, rank)
    assert (rows.diff() != 1).any() or rank == cp - 1  # non-contiguous except the middle rank
    out, dq, dkv = _local_run(query, latent, topk, key_start, grad_out, rows, chunk)

    full = sparse_mla_attention(query, latent, topk, 0.4, v_channels=8, chunk_size=5,
                                key_start=key_start)
    mask = torch.zeros(s, 1, 1, 1, dtype=torch.float64)
    mask[rows] = 1.0
    full_dq, full_dkv = torch.autograd.grad(full, (query, latent), grad_out * mask)
    assert out.shape == (len(rows), 2, 3, 8) and dkv.shape == latent.shape
    assert full[rows].abs().sum() > 0 and full_dkv.abs().sum() > 0
    torch.testing.assert_close(out, full[rows], **TOL64)
    torch.testing.assert_close(dq, full_dq[rows], **TOL64)
    torch.testing.assert_close(dkv, full_dkv, **TOL64)
    assert (dkv[int(rows.max()) + 1:] == 0).all()  # keys no local row may see


@pytest.mark.parametrize("cp", [2, 4])
def test_query_pos_key_grads_sum_to_the_full_grad(cp: int) -> None:
    """The CP reduce-scatter: the latent-key gradients of complementary row subsets add up to the
    full gradient (and the outputs tile the full output)."""
    query, latent, topk, key_start, grad_out = _cp_problem()
    s = query.size(0)
    full = sparse_mla_attention(query, latent, topk, 0.4, v_channels=8, chunk_size=4,
                                key_start=key_start)
    full_dq, full_dkv = torch.autograd.grad(full, (query, latent), grad_out)
    total = torch.zeros_like(latent)
    covered = torch.zeros(s, dtype=torch.int64)
    for rank in range(cp):
        rows = cp_rows(s, cp, rank)
        out, dq, dkv = _local_run(query, latent, topk, key_start, grad_out, rows, 4)
        torch.testing.assert_close(out, full[rows], **TOL64)
        torch.testing.assert_close(dq, full_dq[rows], **TOL64)
        total += dkv
        covered[rows] += 1
    assert (covered == 1).all()
    torch.testing.assert_close(total, full_dkv, **TOL64)


def test_query_pos_arange_is_the_default_bitwise() -> None:
    query, latent, topk = _inputs()
    key_start = torch.tensor([0] * 4 + [4] * 6)
    runs = []
    for pos in (None, torch.arange(10)):
        out = sparse_mla_attention(query, latent, topk, 0.3, v_channels=8, chunk_size=3,
                                   key_start=key_start, query_pos=pos)
        runs.append((out, *_grads(out, (query, latent))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_query_pos_shape_validation() -> None:
    query, latent, topk = _inputs()  # s = 10
    rows = torch.arange(10)
    with pytest.raises(ValueError, match=r"query_pos must be .*\[10\]"):
        sparse_mla_attention(query, latent, topk, 1.0, v_channels=4, chunk_size=4,
                             query_pos=rows[:9])
    with pytest.raises(ValueError, match=r"query_pos must be .*\[10\]"):
        sparse_mla_attention(query, latent, topk, 1.0, v_channels=4, chunk_size=4,
                             query_pos=rows.double())
    with pytest.raises(ValueError, match=r"latent_kv must be \[s_kv >= 10, 2, 1, 12\]"):
        sparse_mla_attention(query, latent[:8], topk, 1.0, v_channels=4, chunk_size=4,
                             query_pos=rows)
    with pytest.raises(ValueError, match=r"latent_kv must be \[10, 2, 1, 12\].*without query_pos"):
        sparse_mla_attention(query, torch.cat([latent, latent]), topk, 1.0, v_channels=4,
                             chunk_size=4)
    with pytest.raises(ValueError, match=r"key_start must be .*\[10\]"):
        sparse_mla_attention(query, latent, topk, 1.0, v_channels=4, chunk_size=4,
                             key_start=rows[:3])
