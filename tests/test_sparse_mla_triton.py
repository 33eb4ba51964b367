"""The Triton sparse-MLA kernels equal the chunked torch reference, forward and both gradients, and
are bit-deterministic; the optional slot probabilities equal an fp64 softmax summed over heads.

CPU: the kernels run under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before triton is imported, so all CPU cases run once in a subprocess (this module run as a script)
that prints their errors as JSON; the tests read that report. The interpreter's ``tl.dot`` is exact
in fp32 and fp16 but wrong in bf16, so bf16 is checked only on a GPU (class ``TestGPU``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kpool_layers.dsa.sparse_attention import sparse_mla_attention

pytest.importorskip("triton")

# Tolerances on ||got - ref|| / ||ref||. fp32: both paths do exact fp32 arithmetic in different
# summation orders over <= 48 terms, so ~sqrt(48) * 2^-24 ~ 1e-6; bound 1e-5. fp16: both round the
# operands identically, but P and dS are rounded to fp16 (unit roundoff 2^-11 = 4.9e-4) from fp32
# values that differ in the last bits, and outputs/gradients are rounded to fp16 again, so single
# elements may differ by ~2 fp16 ulps (1e-3 relative); the norm-wise bound is 2e-3.
RTOL = {"float32": 1e-5, "float16": 2e-3}
REPO = Path(__file__).resolve().parents[1]


def random_topk(b: int, s: int, width: int, gen: torch.Generator, empty: float = 0.2
                ) -> torch.Tensor:
    """int32 ``[b, s, W]`` distinct random keys per row from ``[0, s)`` (so some lie in the future)
    with a fraction ``empty`` of slots set to -1."""
    keys = torch.stack([torch.randperm(s, generator=gen)[:width] for _ in range(b * s)])
    keys = torch.where(torch.rand(keys.shape, generator=gen) < empty, -1, keys)
    return keys.view(b, s, width).int()


def slot_probs_reference(query: torch.Tensor, latent_kv: torch.Tensor, topk: torch.Tensor,
                         scale: float, key_start: torch.Tensor | None,
                         query_pos: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 ``[b, s_q, W]``: softmax over each query's valid slots, summed over heads."""
    s, b, n, d = query.shape
    rows = query_pos if query_pos is not None else torch.arange(s)
    lowest = key_start if key_start is not None else torch.zeros(s, dtype=torch.int64)
    keys = topk.long()
    valid = (keys >= lowest[None, :, None]) & (keys <= rows[None, :, None])
    k_sel = latent_kv.detach().double()[:, :, 0].transpose(0, 1)  # [b, s, d]
    k_sel = k_sel[torch.arange(b)[:, None, None], keys.clamp(min=0)]  # [b, s, W, d]
    scores = torch.einsum("sbnd,bswd->bsnw", query.detach().double(), k_sel) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, :, None], float("-inf")), -1)
    return probs.nan_to_num(0.0).sum(2)


def run_case(s: int, b: int, n: int, d: int, v: int, width: int, dtype: str, *,
             thd: bool = False, empty_rows: tuple[int, ...] = (), partial_rows: int = 0,
             chunk_tokens: int = 0, seed: int = 0, layout: str = "gather") -> dict:
    """Triton (``layout``'s kernels) vs reference errors of out, dq, dkv (and determinism,
    empty-row zeros). ``partial_rows``: the gather layout's key-gradient chunk; ``chunk_tokens``:
    the dense layout's query chunk, forward and backward (through their buffer budgets)."""
    from kpool_layers.kernels import sparse_mla_dense_triton as dense
    from kpool_layers.kernels import sparse_mla_triton as smla

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    query = torch.randn(s, b, n, d, generator=gen).to(dt).requires_grad_()
    latent = torch.randn(s, b, 1, d, generator=gen).to(dt).requires_grad_()
    topk = random_topk(b, s, width, gen)
    topk[:, list(empty_rows)] = -1
    key_start = None
    if thd:  # documents [0, s/3), [s/3, s/2), [s/2, s)
        bounds = torch.tensor([0, s // 3, s // 2])
        key_start = bounds[torch.searchsorted(bounds, torch.arange(s), right=True) - 1]
    grad_out = torch.randn(s, b, n, v, generator=gen).to(dt)
    scale = d ** -0.5
    budgets = smla.PARTIAL_BUFFER_BYTES, dense.S_BUFFER_BYTES, dense.DS_BUFFER_BYTES

    def triton_run() -> list[torch.Tensor]:
        out = smla.sparse_mla_triton(query, latent, topk, scale, v_channels=v, key_start=key_start,
                                     layout=layout)
        return [out, *torch.autograd.grad(out, (query, latent), grad_out)]

    try:
        if partial_rows:  # several query chunks in the key-gradient reduction
            smla.PARTIAL_BUFFER_BYTES = partial_rows * smla.partial_bytes_per_token(
                n, width, d, query.dtype)
        if chunk_tokens:  # chunks of chunk_tokens queries x n heads x s keys: fp32 S and P
            dense.S_BUFFER_BYTES = chunk_tokens * n * s * (4 + query.element_size())
            dense.DS_BUFFER_BYTES = chunk_tokens * n * s * 2 * query.element_size()  # P and dS
        got, again = triton_run(), triton_run()
    finally:
        smla.PARTIAL_BUFFER_BYTES, dense.S_BUFFER_BYTES, dense.DS_BUFFER_BYTES = budgets
    ref_out = sparse_mla_attention(query, latent, topk, scale, v_channels=v, chunk_size=7,
                                   key_start=key_start)
    ref = [ref_out, *torch.autograd.grad(ref_out, (query, latent), grad_out)]
    report = {name: ((g.double() - r.double()).norm() / r.double().norm()).item()
              for name, g, r in zip(("out", "dq", "dkv"), got, ref)}
    _, probs = smla.sparse_mla_triton(query.detach(), latent.detach(), topk, scale, v_channels=v,
                                      key_start=key_start, return_slot_probs=True, layout=layout)
    want = slot_probs_reference(query, latent, topk, scale, key_start)
    report["probs"] = ((probs.double() - want).norm() / want.norm()).item()
    report["dtypes"] = [str(g.dtype).removeprefix("torch.") for g in got]
    report["deterministic"] = all(torch.equal(g, a) for g, a in zip(got, again))
    report["empty_rows_zero"] = all(
        not got[i][list(empty_rows)].any().item() for i in (0, 1)) if empty_rows else True
    return report


def run_cp_case(s: int, b: int, n: int, d: int, v: int, width: int, cp: int, partial_rows: int,
                layout: str = "gather", seed: int = 0) -> dict:
    """Context parallelism, fp32: each CP rank's query rows (megatron's load-balanced split) with
    ``query_pos`` against all keys, by Triton, vs (a) the full-sequence Triton run's rows (its
    latent-key gradient taken with the upstream gradient zero on the other rows), (b) the torch
    reference given the same ``query_pos``; output, dq, dkv and slot probabilities. Also: the
    ranks' dkv sum to the full dkv, keys past a rank's last row get exactly zero, determinism."""
    from kpool_layers.kernels import sparse_mla_triton as smla
    from tests.test_sparse_attention import cp_rows

    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(s, b, n, d, generator=gen).requires_grad_()
    latent = torch.randn(s, b, 1, d, generator=gen).requires_grad_()
    topk = random_topk(b, s, width, gen)
    topk[:, [2, s - 3]] = -1  # an empty row in each half
    bounds = torch.tensor([0, s // 3, s // 2 + 1])  # documents straddling the CP chunks
    key_start = bounds[torch.searchsorted(bounds, torch.arange(s), right=True) - 1]
    grad_out = torch.randn(s, b, n, v, generator=gen)
    scale = d ** -0.5
    rel = lambda g, r: ((g.double() - r.double()).norm() / r.double().norm()).item()  # noqa: E731

    full_out, full_probs = smla.sparse_mla_triton(query, latent, topk, scale, v_channels=v,
                                                  key_start=key_start, return_slot_probs=True,
                                                  layout=layout)
    full_dkv = torch.autograd.grad(full_out, latent, grad_out, retain_graph=True)[0]
    report: dict = {"deterministic": True, "unseen_keys_zero": True}
    total = torch.zeros_like(latent)
    budget = smla.PARTIAL_BUFFER_BYTES
    for rank in range(cp):
        rows = cp_rows(s, cp, rank)
        mask = torch.zeros(s, 1, 1, 1)
        mask[rows] = 1.0
        want = [full_out[rows], *torch.autograd.grad(full_out, (query, latent), grad_out * mask,
                                                     retain_graph=True), full_probs[:, rows]]
        want[1] = want[1][rows]

        def local(backend: str) -> list[torch.Tensor]:
            q = query.detach()[rows].requires_grad_()
            args = (q, latent, topk[:, rows], scale)
            kw = dict(v_channels=v, key_start=key_start[rows], query_pos=rows)
            if backend == "triton":
                out, probs = smla.sparse_mla_triton(*args, **kw, return_slot_probs=True,
                                                    layout=layout)
            else:
                out = sparse_mla_attention(*args, **kw, chunk_size=5)
                probs = slot_probs_reference(q, latent, topk[:, rows], scale, key_start[rows],
                                             rows)
            return [out, *torch.autograd.grad(out, (q, latent), grad_out[rows]), probs]

        try:  # several query chunks in the key-gradient reduction, some across batch rows
            smla.PARTIAL_BUFFER_BYTES = partial_rows * smla.partial_bytes_per_token(
                n, width, d, query.dtype)
            got, again = local("triton"), local("triton")
        finally:
            smla.PARTIAL_BUFFER_BYTES = budget
        ref = local("torch")
        for name, g, f, r in zip(("out", "dq", "dkv", "probs"), got, want, ref):
            report[f"rank{rank}/vs_full/{name}"] = rel(g, f)
            report[f"rank{rank}/vs_ref/{name}"] = rel(g, r)
        report["deterministic"] &= all(torch.equal(g, a) for g, a in zip(got, again))
        report["unseen_keys_zero"] &= not got[2][int(rows.max()) + 1:].any().item()
        total += got[2]
    report["sum_dkv"] = rel(total, full_dkv)
    return report


CP_CASES = {
    # name: (s, b, n, d_k, v, W, CP, partial rows)
    "cp2_fp32": (24, 2, 3, 48, 32, 10, 2, 5),
}


CASES = {
    # name: (s, b, n, d_k, v, W, dtype, options)
    "fp32_rope": (20, 2, 3, 48, 32, 12, "float32", {}),
    "fp16_rope": (24, 2, 3, 48, 32, 12, "float16", {}),
    "fp32_nope_one_head": (20, 1, 1, 32, 32, 9, "float32", {}),
    "fp16_nope_five_heads": (20, 1, 5, 32, 32, 9, "float16", {}),
    "fp32_thd_empty_rows": (30, 1, 2, 48, 32, 10, "float32", {"thd": True, "empty_rows": (4, 17)}),
    "fp16_wide_multichunk": (34, 2, 5, 48, 32, 33, "float16",
                             {"partial_rows": 16, "empty_rows": (0, 9)}),
    "fp32_three_slots": (16, 1, 4, 48, 32, 3, "float32", {"thd": True}),
    "fp32_many_head_blocks": (8, 1, 65, 32, 32, 5, "float32", {}),  # 5 blocks of 16 in fp32
    # fp16 channel blocks of 64: two in the gradient kernel's value loop (96 = 64 + masked 32), a
    # 48-wide tail, three in the dQ kernel (144 = 2 x 64 + masked 16)
    "fp16_wide_channels": (12, 1, 3, 144, 96, 7, "float16", {}),
    "fp16_dense_query_chunks_of_3": (40, 2, 5, 48, 32, 30, "float16",
                                     {"chunk_tokens": 3, "thd": True, "empty_rows": (3, 22)}),
}
LAYOUTS = ("gather", "dense")
"""Every case runs both kernel layouts (``sparse_mla_triton(layout=...)``)."""


@pytest.fixture(scope="module")
def cpu_report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tests.test_sparse_mla_triton"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_cpu(cpu_report: dict, case: str, layout: str) -> None:
    report, dtype = cpu_report[f"{case}/{layout}"], CASES[case][6]
    assert report["dtypes"] == [dtype] * 3
    for name in ("out", "dq", "dkv", "probs"):
        assert report[name] <= RTOL[dtype], (name, report)
    assert report["empty_rows_zero"], report


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_query_pos_matches_full_sequence_rows_cpu(cpu_report: dict, case: str, layout: str
                                                  ) -> None:
    """fp32. Vs the full run, gather layout: every row's output, dq and slot probabilities come
    from the same operations on the same values in the same order (only where the causal bound is
    read from differs), so they are equal exactly; dkv sums the same fp32 partial rows, plus exact
    zeros for the masked rows, in another tree grouping, ~sqrt(terms) * 2^-24: bound ``RTOL`` (1e-5,
    norm-wise); so is the ranks' dkv sum vs the full dkv. Vs the torch reference with the same
    ``query_pos``: ``RTOL`` as in ``test_matches_reference_cpu``. The dense layout takes each
    row's scores and output (and its backward ``dQ = dS K``) from fp32 GEMMs over the whole
    chunk, which the interpreter runs as CPU matmuls: their summation order may change with the
    chunk's shape and the CPU (it does on an AMD EPYC without AVX-512, by 2.4e-8), so
    there every result is held to ``RTOL``, the bound of an fp32 reordering."""
    report = cpu_report[f"{case}/{layout}"]
    errors = {k: e for k, e in report.items() if not isinstance(e, bool)}
    assert len(errors) == 8 * CP_CASES[case][6] + 1, report
    for key, err in errors.items():
        exact = "/vs_full/" in key and not key.endswith("dkv") and layout != "dense"
        assert err <= (0.0 if exact else RTOL["float32"]), (key, report)
    assert report["unseen_keys_zero"], report


def test_deterministic_cpu(cpu_report: dict) -> None:
    assert all(report["deterministic"] for report in cpu_report.values()), cpu_report


def test_rejects_bad_shapes() -> None:
    from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

    query = torch.zeros(4, 1, 2, 48)
    with pytest.raises(ValueError, match="latent_kv"):
        sparse_mla_triton(query, torch.zeros(4, 1, 1, 32), torch.zeros(1, 4, 2, dtype=torch.int32),
                          1.0, v_channels=32)
    with pytest.raises(ValueError, match="v_channels"):
        sparse_mla_triton(query, torch.zeros(4, 1, 1, 48), torch.zeros(1, 4, 2, dtype=torch.int32),
                          1.0, v_channels=64)


def test_layout_rule_and_bad_layout() -> None:
    """``auto`` takes the contiguous-block kernels up to the measured crossovers (16 heads: up to
    32K dense, 64K gather; 64 heads: 8K dense, 16K gather) and an unknown layout names the allowed
    ones."""
    from kpool_layers.kernels.sparse_mla_dense_triton import dense_pays
    from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

    assert [dense_pays(s, 2048, 16) for s in (4096, 32768, 65536)] == [True, True, False]
    assert [dense_pays(s, 2048, 64) for s in (8192, 16384, 32768)] == [True, False, False]
    with pytest.raises(ValueError, match="layout must be one of .*'gather', 'dense'"):
        sparse_mla_triton(torch.zeros(4, 1, 2, 48), torch.zeros(4, 1, 1, 48),
                          torch.zeros(1, 4, 2, dtype=torch.int32), 1.0, v_channels=32,
                          layout="blocks")


def causal_topk(b: int, s: int, width: int, key_start: torch.Tensor | None, device: str,
                seed: int) -> torch.Tensor:
    """int32 ``[b, s, W]``: per query up to W distinct random keys of its document's causal
    prefix, then -1 (built in query chunks: no ``[s, s]`` at once)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    start = key_start if key_start is not None else torch.zeros(s, dtype=torch.int64, device=device)
    rows = []
    for r0 in range(0, s, 1024):
        i = torch.arange(r0, min(r0 + 1024, s), device=device)
        keys = torch.arange(s, device=device)
        visible = (keys[None] <= i[:, None]) & (keys[None] >= start[i, None])
        score = torch.rand(b, len(i), s, generator=gen, device=device).masked_fill(~visible, -1.0)
        top, idx = score.topk(min(width, s), dim=-1)
        rows.append(torch.where(top >= 0, idx, -1))
    out = torch.cat(rows, 1)
    if width > s:
        out = torch.cat([out, out.new_full((b, s, width - s), -1)], -1)
    return out.int()


def gpu_errors(s: int, n: int, d: int, v: int, width: int, thd: bool, layout: str,
               seed: int = 0) -> tuple[dict, bool]:
    """bf16 Triton vs the fp32 torch reference on the same (bf16-rounded) inputs: relative errors of
    out, dq, dkv; and whether two Triton runs are bit-identical."""
    from kpool_layers.kernels.sparse_mla_triton import sparse_mla_triton

    gen = torch.Generator(device="cuda").manual_seed(seed)
    query = torch.randn(s, 1, n, d, generator=gen, device="cuda").bfloat16().requires_grad_()
    latent = torch.randn(s, 1, 1, d, generator=gen, device="cuda").bfloat16().requires_grad_()
    key_start = None
    if thd:
        bounds = torch.tensor([0, s // 5, s // 2], device="cuda")
        doc = torch.searchsorted(bounds, torch.arange(s, device="cuda"), right=True) - 1
        key_start = bounds[doc]
    topk = causal_topk(1, s, width, key_start, "cuda", seed)
    grad_out = torch.randn(s, 1, n, v, generator=gen, device="cuda").bfloat16()
    scale = d ** -0.5

    def run() -> list[torch.Tensor]:
        out = sparse_mla_triton(query, latent, topk, scale, v_channels=v, key_start=key_start,
                                layout=layout)
        return [out, *torch.autograd.grad(out, (query, latent), grad_out)]

    got, again = run(), run()
    q32, kv32 = (x.detach().float().requires_grad_() for x in (query, latent))
    ref_out = sparse_mla_attention(q32, kv32, topk, scale, v_channels=v, chunk_size=128,
                                   key_start=key_start)
    ref = [ref_out, *torch.autograd.grad(ref_out, (q32, kv32), grad_out.float())]
    errors = {name: ((g.float() - r).norm() / r.norm()).item()
              for name, g, r in zip(("out", "dq", "dkv"), got, ref)}
    return errors, all(torch.equal(g, a) for g, a in zip(got, again))


@pytest.mark.gpu
class TestGPU:
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("shape", [  # two shapes only: each compiles its own kernels
        (2048, 64, 576, 512, 2048, False),  # GLM-5
        (1024, 20, 512, 512, 256, True),  # NoPE (GLM-5.3-Flash), odd head count, packed documents
    ])
    def test_bf16_matches_fp32_reference_and_is_deterministic(self, shape: tuple, layout: str
                                                              ) -> None:
        errors, deterministic = gpu_errors(*shape, layout)
        assert all(e <= 2e-2 for e in errors.values()), errors
        assert deterministic


@pytest.mark.parametrize("s,per_token,budget,size", [
    (4096, 64 * 4096 * 6, 1 << 29, 320),      # GLM-5's 64 heads at 4K, forward: 341 tokens fit
    (4096, 64 * 4096 * 4, 1 << 29, 512),      # its backward
    (8191, 16 * 8191 * 6, 1 << 29, 640),      # an odd length (682 fit): the last chunk ends it
    (200, 4, 1 << 20, 48),                    # at least QUERY_CHUNKS chunks: 50 tokens
    (32768, 64 * 32768 * 6, 1 << 29, 40),     # 64 heads at 32K: 42 tokens fit, below CHUNK_ALIGN
    (40, 5 * 40 * 4, 3 * 5 * 40 * 4, 3),      # 3 tokens fit, below ROW_ALIGN: unaligned
])
def test_dense_query_chunks_are_aligned_within_budget(s: int, per_token: int, budget: int,
                                                      size: int) -> None:
    """The dense layout's query chunks tile ``[0, s)`` in order, each ``size`` tokens but the
    last: the most the buffer budget and ``QUERY_CHUNKS`` allow, rounded down to a multiple of
    ``CHUNK_ALIGN``, or of ``ROW_ALIGN`` below it (a chunk's key count is the GEMMs' leading
    dimension)."""
    from kpool_layers.kernels import sparse_mla_dense_triton as dense

    chunks = list(dense._query_chunks(s, s, None, per_token, budget))
    assert [t0 for t0, _, _ in chunks] == list(range(0, s, size)) and chunks[-1][1] == s
    assert all(t1 - t0 == size and keys == t1 for t0, t1, keys in chunks[:-1])
    assert size * per_token <= budget and len(chunks) >= dense.QUERY_CHUNKS


if __name__ == "__main__":  # CPU cases under the interpreter (see the module docstring)
    from kpool_layers.kernels import sparse_mla_dense_triton

    # 8-key blocks: the dense forward's softmax rows span several key blocks (online max and sum
    # across blocks, the blocks before key_start skipped), as on a GPU with real lengths
    sparse_mla_dense_triton.CONFIGS["softmax"]["BN"] = 8
    report = {f"{name}/{layout}": run_case(*args[:7], **args[7], layout=layout)
              for name, args in CASES.items() for layout in LAYOUTS}
    report.update({f"{name}/{layout}": run_cp_case(*args, layout=layout)
                   for name, args in CP_CASES.items() for layout in LAYOUTS})
    print(json.dumps(report))

