"""Triton indexer top-k (:func:`range_topk_triton`) against ``chunked_range_topk``.

On CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), which must be set
before triton is imported: the cases run in one subprocess (this module run as ``python -m``) so
the rest of the suite keeps a normal triton. The interpreter's ``tl.dot`` is wrong in bf16, so CPU
cases use fp32 / fp16. Most inputs lie on a coarse dyadic grid so every score is exact in FP32 in
any summation order: the selections must then be identical, ties included. The GPU class runs the
GLM-5 shape in bf16, where scores within FP32 rounding of the k-th may swap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from kpool_layers.dsa.kpool import pool_layout
from kpool_layers.dsa.topk import chunked_range_topk

ROOT = Path(__file__).resolve().parents[1]


def grid_inputs(t: int, h: int, d: int, n: int, gen: torch.Generator, levels: int = 17):
    """q [t, h, d], keys [n, d] in multiples of 1/8 and weights [t, h] in multiples of 1/4, small
    enough that every score (and partial sum) is exact in FP32."""
    def draw(*shape: int, step: float) -> torch.Tensor:
        return (torch.randint(0, levels, shape, generator=gen) - levels // 2).float() * step

    return draw(t, h, d, step=1 / 8), draw(n, d, step=1 / 8), draw(t, h, step=1 / 4)


def layout_range(t: int, kpool: int, lengths: Optional[list[int]]):
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = pool_layout(t, kpool, cu)
    return layout.query_lo, layout.query_hi, layout.n_pools


def scores64(q, keys, w, relu: bool) -> torch.Tensor:
    """FP64 scores [t, n] (small CPU shapes only)."""
    logits = torch.einsum("thd,nd->thn", q.double(), keys.double())
    return torch.einsum("th,thn->tn", w.double(), logits.relu() if relu else logits)


def assert_equal_up_to_rounding(got, ref, scores, lo, hi, tol) -> None:
    """``got`` and ``ref`` [t, k] select the same keys except keys whose exact ``scores`` [t, n] lie
    within ``tol`` [t] of the reference's k-th selected score; -1 slots agree; ``got`` lists its
    keys in ascending order."""
    assert torch.equal(got < 0, ref < 0)
    assert ((got[:, 1:] < 0) | ((got[:, :-1] >= 0) & (got[:, 1:] > got[:, :-1]))).all()
    for row in torch.nonzero((got != ref).any(1)).flatten().tolist():
        g, r = set(got[row].tolist()) - {-1}, set(ref[row].tolist()) - {-1}
        kth = scores[row, ref[row][ref[row] >= 0]].min()
        for j in g ^ r:
            assert lo[row] <= j < hi[row], (row, j)
            assert abs(scores[row, j] - kth) <= tol[row], (row, j, float(scores[row, j]), float(kth))


# --- cases run under the interpreter (each raises AssertionError on failure) --------------------


def _variants() -> dict:
    """Launch configs the cases run under: the defaults, and small tiles with an uneven
    5-bit radix (7 passes, the last 2 bits wide), 64-key selection blocks and a 16 KiB score buffer
    (several query chunks for n >= 64)."""
    from kpool_layers.kernels.indexer_topk_triton import DEFAULT_CONFIG, LaunchConfig

    return {
        "default": DEFAULT_CONFIG,
        "small": LaunchConfig(block_t=16, block_n=32, num_warps=4, num_stages=2, select_block=64,
                              radix_bits=5, score_buffer_bytes=16 * 2**10),
    }


VARIANTS = ("default", "small")
_config: list = [None]  # the variant the cases run under (None: DEFAULT_CONFIG)


def _range_topk(*args, config=None, **kwargs):
    from kpool_layers.kernels.indexer_topk_triton import DEFAULT_CONFIG, range_topk_triton

    return range_topk_triton(*args, **kwargs, config=config or _config[0] or DEFAULT_CONFIG)


def _grid_case(kpool: int, relu: bool, lengths: Optional[list[int]], topk: int, h: int, d: int,
               dtype: torch.dtype = torch.float32, levels: int = 17) -> None:
    gen = torch.Generator().manual_seed(hash((kpool, relu, topk, h, d, levels)) % 2**31)
    t = 128 if lengths is None else sum(lengths)
    lo, hi, n = layout_range(t, kpool, lengths)
    q, keys, w = grid_inputs(t, h, d, n, gen, levels)
    got = _range_topk(q.to(dtype), keys.to(dtype), w, lo, hi, topk=topk, relu=relu)
    ref = chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=relu, chunk_size=32)
    assert got.dtype == torch.long and got.shape == (t, topk)
    assert torch.equal(got, ref), (got != ref).any(1).nonzero().flatten().tolist()[:8]


def case_plain_relu() -> None:
    _grid_case(kpool=1, relu=True, lengths=None, topk=32, h=4, d=32)


def case_plain_identity() -> None:
    _grid_case(kpool=1, relu=False, lengths=None, topk=32, h=3, d=16)


def case_thd_documents() -> None:
    """Packed documents (lo > 0 restarts), short documents see fewer keys than topk."""
    _grid_case(kpool=1, relu=True, lengths=[40, 3, 1, 60, 24], topk=32, h=4, d=16)


def case_kpool4_thd() -> None:
    _grid_case(kpool=4, relu=True, lengths=[70, 2, 56], topk=8, h=4, d=32)


def case_kpool4_identity_fp16() -> None:
    _grid_case(kpool=4, relu=False, lengths=[37, 91], topk=8, h=2, d=32, dtype=torch.float16)


def case_ties_lower_index() -> None:
    """Inputs in {-1, 0, 1} times 1/8 (weights 1/4): the k-th score is tied in most rows; ties go
    to the lower index."""
    gen = torch.Generator().manual_seed(7)
    t, n, topk = 96, 96, 16
    lo, hi, _ = layout_range(t, 1, None)
    q, keys, w = grid_inputs(t, 2, 16, n, gen, levels=3)
    s = scores64(q, keys, w, relu=True).masked_fill(
        (torch.arange(n) < lo[:, None]) | (torch.arange(n) >= hi[:, None]), float("-inf"))
    top = s.sort(dim=1, descending=True).values
    assert (top[hi > topk, topk - 1] == top[hi > topk, topk]).float().mean() > 0.5  # really tied
    got = _range_topk(q, keys, w, lo, hi, topk=topk, relu=True)
    assert torch.equal(got, chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=True, chunk_size=16))


def case_signed_zeros(device: str = "cpu") -> None:
    """Scores -0.0 (both heads' terms -0.0) and +0.0 (1 - 1) tie like the reference's folded
    zeros. (The kernel's head sum starts from +0.0, so it never forms a -0.0 score itself.)"""
    t, n, d = 16, 48, 16
    q = torch.zeros(t, 2, d, device=device)
    q[:, 0, 0], q[:, 1, 1] = 1.0, 1.0
    keys = torch.zeros(n, d, device=device)
    keys[1::3, 0], keys[1::3, 1] = 1.0, -1.0  # every third key scores +0.0, the others -0.0
    w = -torch.ones(t, 2, device=device)
    lo, hi = torch.zeros(t, dtype=torch.long, device=device), torch.full((t,), n, device=device)
    got = _range_topk(q, keys, w, lo, hi, topk=8, relu=False)
    assert torch.equal(got.cpu(), torch.arange(8).expand(t, 8))


def case_random_fp32() -> None:
    """Continuous inputs: identical except keys within FP32 rounding of the k-th score."""
    gen = torch.Generator().manual_seed(3)
    t, h, d, topk = 128, 4, 32, 32
    lo, hi, n = layout_range(t, 1, [100, 28])
    q, keys, w = torch.randn(t, h, d, generator=gen), torch.randn(n, d, generator=gen), torch.rand(t, h, generator=gen)
    got = _range_topk(q, keys, w, lo, hi, topk=topk, relu=True)
    ref = chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=True, chunk_size=64)
    bound = (w.abs() * q.norm(dim=2)).sum(1) * keys.norm(dim=1).max()  # Cauchy-Schwarz
    assert_equal_up_to_rounding(got, ref, scores64(q, keys, w, True), lo, hi, 4 * (d + h) * 2**-24 * bound)


def case_empty_and_oversized() -> None:
    """lo >= hi, hi beyond n, topk > n, t = 0 and n = 0: -1 where nothing is visible."""
    gen = torch.Generator().manual_seed(5)
    t, n = 20, 12
    q, keys, w = grid_inputs(t, 2, 16, n, gen)
    lo = torch.randint(0, n, (t,), generator=gen)
    hi = lo + torch.randint(-3, n, (t,), generator=gen)
    got = _range_topk(q, keys, w, lo, hi.clamp(max=n), topk=20, relu=True)
    assert torch.equal(got, chunked_range_topk(q, keys, w, lo, hi.clamp(max=n), topk=20, relu=True, chunk_size=8))
    assert (got[hi <= lo] == -1).all()
    assert torch.equal(_range_topk(q, keys[:0], w, lo, hi, topk=4, relu=True), torch.full((t, 4), -1))
    assert _range_topk(q[:0], keys, w[:0], lo[:0], hi[:0], topk=4, relu=True).shape == (0, 4)


def case_deterministic_strided() -> None:
    """Bit-identical twice; a strided q (one batch row of [t, b, h, d]) reads like a contiguous one."""
    gen = torch.Generator().manual_seed(11)
    t, b, h, d = 64, 2, 4, 16
    lo, hi, n = layout_range(t, 1, [30, 34])
    q, keys, w = grid_inputs(t * b, h, d, n, gen)
    q_row = q.view(t, b, h, d)[:, 1]
    first = _range_topk(q_row, keys, w[:t], lo, hi, topk=16, relu=True)
    assert torch.equal(first, _range_topk(q_row, keys, w[:t], lo, hi, topk=16, relu=True))
    assert torch.equal(first, _range_topk(q_row.contiguous(), keys, w[:t], lo, hi, topk=16, relu=True))


def case_relu_zero_ties() -> None:
    """ReLU zeroes most scores: rows with fewer positive keys than topk fill up with exact zeros,
    taken in key order (lower index first)."""
    gen = torch.Generator().manual_seed(13)
    t, h, d, topk = 64, 2, 16, 16
    lo, hi, n = layout_range(t, 1, [40, 24])
    q, keys, w = grid_inputs(t, h, d, n, gen)
    q, w = q.abs(), w.abs()
    keys = -keys.abs()
    keys[::9] = keys[::9].abs()  # every 9th key scores > 0 (or 0), the others exactly 0
    got = _range_topk(q, keys, w, lo, hi, topk=topk, relu=True)
    assert torch.equal(got, chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=True, chunk_size=16))
    row = 63  # sees keys 40 .. 63: positive ones 45, 54, 63 (when their score is not 0), then zeros
    positive = [j for j in (45, 54, 63) if scores64(q[row:row + 1], keys[j:j + 1], w[row:row + 1], True) > 0]
    rest = [j for j in range(40, 64) if j not in positive][: topk - len(positive)]
    assert got[row].tolist() == sorted(positive + rest)


def case_identical_keys() -> None:
    """Every key the same: every visible score ties; each query takes the first topk keys of its
    range in key order."""
    gen = torch.Generator().manual_seed(17)
    t, h, d, topk = 64, 3, 16, 8
    lo, hi, n = layout_range(t, 1, [20, 5, 39])
    q, keys, w = grid_inputs(t, h, d, n, gen)
    keys = keys[:1].expand(n, d)
    for relu in (True, False):
        got = _range_topk(q, keys, w, lo, hi, topk=topk, relu=relu)
        want = lo[:, None] + torch.arange(topk)
        assert torch.equal(got, torch.where(want < hi[:, None], want, -1))


def case_count_at_most_topk() -> None:
    """topk >= every query's visible count (no radix pass): all visible keys, in key order."""
    gen = torch.Generator().manual_seed(19)
    t, h, d = 48, 2, 16
    lo, hi, n = layout_range(t, 1, [30, 18])
    q, keys, w = grid_inputs(t, h, d, n, gen)
    for topk in (30, 33):
        got = _range_topk(q, keys, w, lo, hi, topk=topk, relu=False)
        assert torch.equal(got, chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=False, chunk_size=16))
        assert torch.equal((got >= 0).sum(1), hi - lo)


def case_several_chunks_kpool() -> None:
    """A score buffer of 5 rows (13 query chunks, fewer rows than a scoring tile), KPool 2 ranges
    over packed documents."""
    from kpool_layers.kernels.indexer_topk_triton import DEFAULT_CONFIG, buffer_width, chunk_rows

    gen = torch.Generator().manual_seed(23)
    t, h, d, topk = 64, 2, 16, 8
    lo, hi, n = layout_range(t, 2, [27, 37])
    q, keys, w = grid_inputs(t, h, d, n, gen)
    config = replace(_config[0] or DEFAULT_CONFIG, score_buffer_bytes=4 * buffer_width(n) * 5 + 3)
    assert chunk_rows(n, config) == 5
    got = _range_topk(q, keys, w, lo, hi, topk=topk, relu=True, config=config)
    assert torch.equal(got, chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=True, chunk_size=16))


def case_packed_ties() -> None:
    """Packed documents with scores on three levels (many ties across the k-th score)."""
    gen = torch.Generator().manual_seed(29)
    lo, hi, n = layout_range(40, 1, [26, 14])
    q, keys, w = grid_inputs(40, 2, 16, n, gen, levels=3)
    got = _range_topk(q, keys, w, lo, hi, topk=8, relu=True)
    assert torch.equal(got, chunked_range_topk(q, keys, w, lo, hi, topk=8, relu=True, chunk_size=16))


CASES: dict[str, Callable[[], None]] = {
    name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")
}


def _run_cases() -> None:
    """Entry point of the interpreter subprocess: one JSON line {case/variant: null | traceback}."""
    torch.set_num_threads(1)
    results = {}
    for variant, config in _variants().items():
        _config[0] = config
        for name, fn in CASES.items():
            try:
                fn()
                results[f"{name}/{variant}"] = None
            except Exception:  # noqa: BLE001 - reported to the parent test
                results[f"{name}/{variant}"] = traceback.format_exc()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_indexer_topk_triton"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
def test_interpreter(case: str, variant: str, interpreter_results: dict) -> None:
    result = interpreter_results[f"{case}/{variant}"]
    assert result is None, result


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_cpu_tensors_rejected() -> None:
    from kpool_layers.kernels.indexer_topk_triton import range_topk_triton

    lo, hi = torch.zeros(4, dtype=torch.long), torch.full((4,), 8)
    with pytest.raises(ValueError, match="CUDA"):
        range_topk_triton(torch.randn(4, 2, 16), torch.randn(8, 16), torch.rand(4, 2), lo, hi, topk=2, relu=True)


GPU_CONFIGS = {  # the default, and 11/11/10-bit passes with 8 query chunks
    "default": {},
    "radix11_chunks": {"radix_bits": 11, "score_buffer_bytes": 8 * 2**20},
}


@pytest.mark.gpu
class TestGLM5Shape:
    """t = 4096, h = 32, d = 128, topk = 2048 in bf16: same sets as the reference up to FP32
    rounding, for plain DSA and KPool 4 (512 of 1024 pools), deterministic."""

    @staticmethod
    def check(kpool: int, relu: bool, variant: str = "default") -> None:
        from kpool_layers.kernels.indexer_topk_triton import LaunchConfig, range_topk_triton

        config = LaunchConfig(**GPU_CONFIGS[variant])
        t, h, d, topk = 4096, 32, 128, 2048 // kpool
        gen = torch.Generator(device="cuda").manual_seed(kpool)
        layout = pool_layout(t, kpool, torch.tensor([0, 1000, t]), device="cuda")
        lo, hi, n = layout.query_lo, layout.query_hi, layout.n_pools
        q = torch.randn(t, h, d, generator=gen, device="cuda").bfloat16()
        keys = torch.randn(n, d, generator=gen, device="cuda").bfloat16()
        w = torch.rand(t, h, generator=gen, device="cuda") * (h * d) ** -0.5
        got = range_topk_triton(q, keys, w, lo, hi, topk=topk, relu=relu, config=config)
        assert torch.equal(got, range_topk_triton(q, keys, w, lo, hi, topk=topk, relu=relu, config=config))
        ref = chunked_range_topk(q, keys, w, lo, hi, topk=topk, relu=relu, chunk_size=512)
        exact = torch.cat([scores64(q[i:i + 256], keys, w[i:i + 256], relu) for i in range(0, t, 256)])
        # Both sides sum d products and h heads in FP32: each is within (d + h) eps of the exact
        # score times the sum of absolute terms, bounded by Cauchy-Schwarz.
        bound = (w.double().abs() * q.double().norm(dim=2)).sum(1) * keys.double().norm(dim=1).max()
        assert_equal_up_to_rounding(got.cpu(), ref.cpu(), exact.cpu(), lo.cpu(), hi.cpu(),
                                    (4 * (d + h) * 2**-24 * bound).cpu())
        differ = [set(a) != set(b) for a, b in zip(got.tolist(), ref.tolist())]
        assert sum(differ) < 0.05 * t  # sets differ only through near-ties at the k-th score

    @pytest.mark.parametrize("variant", list(GPU_CONFIGS))
    @pytest.mark.parametrize("kpool", [1, 4])
    def test_matches_reference(self, kpool: int, variant: str) -> None:
        self.check(kpool, relu=True, variant=variant)

    def test_identity_scoring(self) -> None:
        self.check(1, relu=False)

    @pytest.mark.parametrize("variant", list(GPU_CONFIGS))
    def test_signed_zeros(self, variant: str) -> None:
        from kpool_layers.kernels.indexer_topk_triton import LaunchConfig

        _config[0] = LaunchConfig(**GPU_CONFIGS[variant])
        try:
            case_signed_zeros("cuda")
        finally:
            _config[0] = None


if __name__ == "__main__":
    _run_cases()
