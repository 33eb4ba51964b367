"""Top-k drift metrics on constructed selections with hand-computed values, and the offline
wandb drift report."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from kpool_layers.dsa import drift

INF = float("inf")


def _exact(metrics: dict[str, torch.Tensor], expected: dict[str, float]) -> None:
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key].dim() == 0 and metrics[key].dtype == torch.float32, key
        assert metrics[key].item() == pytest.approx(value, abs=1e-6), key


def test_topk_drift_by_hand():
    ref = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3], [5, 6, -1, -1], [-1, -1, -1, -1]]])
    train = torch.tensor([[[3, 2, 1, 0], [3, 2, 1, 9], [6, 7, 8, -1], [1, 2, 3, 4]]])
    # q0: same set           -> |S∩R| 4, overlap 1,   jaccard 4/4 = 1,   exact
    # q1: 9 instead of 0     -> |S∩R| 3, overlap 3/4, jaccard 3/5 = 0.6, mismatch (< 0.8)
    # q2: R {5,6}, S {6,7,8} -> |S∩R| 1, overlap 1/2, jaccard 1/4,       mismatch
    # q3: empty reference    -> left out of every mean
    assert drift.intersection_sizes(train, ref).tolist() == [[4, 3, 1, 0]]
    _exact(
        drift.topk_drift(train, ref),
        {
            "topk_overlap": (1 + 0.75 + 0.5) / 3,
            "topk_exact_rows": 1 / 3,
            "topk_mismatch_frac": 2 / 3,
            "topk_jaccard": (1 + 0.6 + 0.25) / 3,
        },
    )
    # Threshold 0.5: overlaps 1, 0.75, 0.5 are all >= 0.5 -> no mismatch.
    assert drift.topk_drift(train, ref, mismatch_threshold=0.5)["topk_mismatch_frac"].item() == 0.0


def test_topk_drift_batches_and_widths():
    # Two sequences; the training selection is wider (W 3 vs 2) than the reference.
    ref = torch.tensor([[[0, 1]], [[4, -1]]])
    train = torch.tensor([[[1, 0, 7]], [[5, 6, -1]]])
    # b0: |R| 2, |S| 3, I 2 -> overlap 1, jaccard 2/3, not exact; b1: I 0 -> overlap 0, jaccard 0.
    _exact(
        drift.topk_drift(train, ref),
        {"topk_overlap": 0.5, "topk_exact_rows": 0.0, "topk_mismatch_frac": 0.5, "topk_jaccard": 1 / 3},
    )


def test_pool_overlap_excludes_tail():
    # kpool 4, topk 8 (2 pools) + 3 tail columns (the query's incomplete pool).
    # Query at 26: R pools {2, 5}, S pools {2, 3}, tail 24..26 in both.
    #   tokens: R = 8..11, 20..23, 24..26 (11), S shares 8..11 and the tail -> 7/11;
    #   pools (tail excluded): {2, 5} vs {2, 3} -> 1/2 (with the tail's pool 6 it would be 2/3).
    # Query at 9: pools {0, 1} in both (other order), tail 8, 9 -> tokens 10/10, pools 2/2.
    r_a = [8, 9, 10, 11, 20, 21, 22, 23, 24, 25, 26]
    s_a = [12, 13, 14, 15, 8, 9, 10, 11, 24, 25, 26]
    r_b = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1]
    s_b = [4, 5, 6, 7, 0, 1, 2, 3, 8, 9, -1]
    ref, train = torch.tensor([[r_a, r_b]]), torch.tensor([[s_a, s_b]])
    out = drift.topk_drift(train, ref, kpool=4, tail=3)
    assert out["topk_overlap"].item() == pytest.approx((7 / 11 + 1) / 2)
    assert out["pool_overlap"].item() == pytest.approx((0.5 + 1) / 2)
    assert drift.pool_ids(ref, 4, tail=3)[0].tolist() == [[2, 5] + [-1] * 6, [0, 1] + [-1] * 6]
    assert "pool_overlap" not in drift.topk_drift(train, ref)


def test_score_rel_err_by_hand():
    # Valid where both finite: columns 0, 1 -> diff (0, 1), ref (3, 4): 1 / 5 = 0.2.
    ref = torch.tensor([[[3.0, 4.0, -INF, 10.0]]])
    train = torch.tensor([[[3.0, 5.0, 7.0, -INF]]])
    assert drift.score_rel_err(train, ref).item() == pytest.approx(0.2)
    idx = torch.tensor([[[0]]])
    out = drift.topk_drift(idx, idx, train_scores=train.bfloat16(), ref_scores=ref)
    assert out["score_rel_err"].item() == pytest.approx(0.2) and out["topk_overlap"].item() == 1.0
    assert drift.score_rel_err(torch.zeros(2), torch.zeros(2)).item() == 0.0
    with pytest.raises(ValueError, match="both"):
        drift.topk_drift(idx, idx, train_scores=train)


def test_boundary_tie_frac_by_hand():
    scores = torch.tensor(
        [
            [
                [5.0, 3.0, 3.0, 1.0, -INF],  # top3 5, 3, 3: 2nd == 3rd -> tie
                [5.0, 4.0, 3.0, 1.0, 0.0],  # 4 != 3 -> no tie
                [2.0, 2.0, -INF, -INF, -INF],  # only 2 finite scores: left out
                [1.0, 7.0, 7.0, 7.0, 0.0],  # 7, 7, 7 -> tie
            ]
        ]
    )
    assert drift.boundary_tie_frac(scores, k=2).item() == pytest.approx(2 / 3)
    # k=1: top2 (5,3) (5,4) (2,2) (7,7), all finite -> rows 2 and 3 tie: 2/4.
    assert drift.boundary_tie_frac(scores, k=1).item() == pytest.approx(0.5)
    assert drift.boundary_tie_frac(scores, k=5).item() == 0.0
    with pytest.raises(ValueError):
        drift.boundary_tie_frac(scores, k=0)


def test_score_drift_over_chunks_equals_the_whole_rows():
    """ScoreDrift fed query chunk by chunk gives the metrics of the whole [s, sk] rows: the tie
    counts exactly, score_rel_err up to FP32 summation order (relative 2 * sk * s * 2^-24 for the
    two sums of squares, far below the 1e-5 asserted)."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 50, generator=gen).round(decimals=1)  # rounding makes boundary ties
    ref[torch.rand(37, 50, generator=gen) < 0.3] = -INF
    train = ref + 1e-2 * torch.randn(37, 50, generator=gen)
    whole_err, whole_ties = drift.score_rel_err(train, ref), drift.boundary_tie_frac(ref, k=8)
    acc = drift.ScoreDrift(8, ref.device)
    for start in range(0, 37, 5):
        acc.add(train[start:start + 5], ref[start:start + 5])
    out = acc.result()
    assert out["boundary_tie_frac"].item() == whole_ties.item() > 0
    assert out["score_rel_err"].item() == pytest.approx(whole_err.item(), rel=1e-5)


def test_score_rows_bound_the_chunk_intermediate(monkeypatch: pytest.MonkeyPatch):
    """A chunk's [c, heads, keys] FP32 scores stay within SCORE_BUFFER_BYTES (1 GiB): 1024 queries
    at 4096 keys and 32 heads (512 MiB), 64 at 131072 keys; ScoredSelection.score_chunks splits
    its rows the same way and yields every query once, in order."""
    from kpool_layers.dsa import indexer, topk

    assert topk.score_rows(1024, 32, 4096) == 1024
    assert topk.score_rows(1024, 32, 131072) == 64
    assert topk.score_rows(1024, 1, 131072) == 1024 and topk.score_rows(8, 32, 10**12) == 1
    monkeypatch.setattr(topk, "SCORE_BUFFER_BYTES", 4 * 2 * 16 * 3)  # 3 queries of 2 heads x 16 keys
    lay = type("Layout", (), {"n_pools": 16, "query_lo": torch.zeros(10, dtype=torch.long),
                              "query_hi": torch.arange(1, 11)})()
    sel = indexer.ScoredSelection(topk_indices=torch.zeros(1, 10, 4, dtype=torch.long),
                                  q=torch.randn(10, 1, 2, 8), keys=torch.randn(16, 1, 8),
                                  weights=torch.rand(10, 1, 2), layout=lay)
    parts = list(sel.score_chunks(0, relu=True, chunk_size=1024))
    assert [p.shape[0] for p in parts] == [3, 3, 3, 1]
    whole = topk.index_scores(sel.q[:, 0], sel.keys[:, 0], sel.weights[:, 0], relu=True)
    visible = torch.arange(16) < lay.query_hi[:, None]
    # the same scores up to the GEMM's blocking: 16-term FP32 sums per head of terms below 20
    # in magnitude (2 heads): |error| <= 2 * 16 * 2^-24 * 20 < 1e-4
    torch.testing.assert_close(torch.cat(parts), whole.masked_fill(~visible, -INF), rtol=0, atol=1e-4)


def test_reduce_drift_metrics_single_process():
    metrics = {"b": torch.tensor(0.25), "a": torch.tensor(1.0)}
    assert drift.reduce_drift_metrics(metrics) == metrics


def _reduce_worker(rank: int, world: int, port: int, result: "torch.multiprocessing.SimpleQueue") -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    metrics = {"topk_overlap": torch.tensor(0.5 + 0.5 * rank), "topk_jaccard": torch.tensor(float(rank))}
    out = drift.reduce_drift_metrics(metrics)
    result.put((rank, {k: v.item() for k, v in out.items()}))
    dist.destroy_process_group()


@pytest.mark.dist
def test_reduce_drift_metrics_two_ranks():
    from tests.conftest import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_reduce_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = dict(queue.get() for _ in range(2))
    for rank in range(2):
        assert results[rank] == {"topk_jaccard": 0.5, "topk_overlap": 0.75}


# ----------------------------------------------------------------------------------------------
# scripts/drift_report.py
# ----------------------------------------------------------------------------------------------


def _load_report_module():
    path = Path(__file__).resolve().parents[1] / "scripts" / "drift_report.py"
    spec = importlib.util.spec_from_file_location("drift_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def offline_run(tmp_path, monkeypatch):
    """A tiny offline wandb run: 120 steps x 3 layers of dsa/topk_overlap plus padding text so
    that records cross the 32 KiB log blocks."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="drift-test", config={"x": 1})
    for step in range(120):
        row = {f"dsa/topk_overlap/layer_{layer}": 1.0 - 0.001 * step * layer for layer in (1, 2, 3)}
        row["dsa/score_rel_err/layer_1"] = 0.01 * step
        row["loss"] = 2.0
        row["note"] = "x" * 400
        run.log(row, step=step)
    run.finish()
    # wandb's service process writes the file; on a loaded machine it can still be appending the
    # last records when finish() returns (seen with 2 cores at load ~7): wait for them, bounded.
    report, deadline = _load_report_module(), time.monotonic() + 120
    while time.monotonic() < deadline:
        files = report.find_run_files(tmp_path)
        if len(files) == 1 and len(report.read_history(files[0])) == 120:
            break
        time.sleep(0.2)
    return tmp_path


def test_drift_report_reads_offline_run(offline_run, tmp_path):
    report = _load_report_module()
    (wandb_file,) = report.find_run_files(offline_run)
    assert wandb_file.stat().st_size > report.BLOCK
    history = report.read_history(wandb_file)
    assert sorted(history) == list(range(120))
    series = report.drift_series(history)
    assert set(series) == {"topk_overlap", "score_rel_err"}
    assert sorted(series["topk_overlap"]) == [1, 2, 3]
    assert series["topk_overlap"][3][100] == pytest.approx(0.7)
    assert series["score_rel_err"][1][7] == pytest.approx(0.07)

    out = tmp_path / "report"
    assert report.main([str(offline_run), "--out", str(out)]) == 0
    md = (out / "drift_report.md").read_text()
    assert "## topk_overlap" in md and "## score_rel_err" in md
    # layer 3: first 1.0, last 1 - 0.003 * 119 = 0.643, min at step 119
    overlap = md.split("## topk_overlap")[1].split("## score_rel_err")[0]  # the overlap comes first
    assert "| 3 | 120 | 1.0000 | 0.6430 |" in overlap and overlap.rstrip().splitlines()[-1].endswith("| 119 |")
    for name in ("topk_overlap_lines.png", "topk_overlap_heatmap.png", "score_rel_err_heatmap.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drift_report_truncated_and_bad_files(offline_run, tmp_path):
    report = _load_report_module()
    (wandb_file,) = report.find_run_files(offline_run)
    data = wandb_file.read_bytes()
    cut = tmp_path / "run-cut.wandb"
    cut.write_bytes(data[: len(data) // 2])
    steps = sorted(report.read_history(cut))
    assert steps and steps == list(range(len(steps))) and len(steps) < 120
    bad = tmp_path / "run-bad.wandb"
    bad.write_bytes(b"notwandb" + data[8:])
    with pytest.raises(ValueError, match="not a wandb"):
        list(report.iter_records(bad))
    corrupt = bytearray(data)
    corrupt[20] ^= 0xFF
    (tmp_path / "run-corrupt.wandb").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="checksum"):
        list(report.iter_records(tmp_path / "run-corrupt.wandb"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError):
        report.find_run_files(empty)


def test_drift_report_reads_metrics_jsonl_without_wandb(tmp_path):
    """A ``logging=none`` run has no wandb files; the report reads its metrics.jsonl (step lines
    and drift lines of one step merged, a line cut short by a kill skipped)."""
    report = _load_report_module()
    lines = []
    for step in range(1, 11):
        lines.append(json.dumps({"step": step, "loss": 2.0, "tokens_per_s": 10.0}))
        if step % 5 == 0:
            lines.append(json.dumps({"step": step, "dsa/topk_overlap": 0.95,
                                     **{f"dsa/topk_overlap/layer_{i}": 1.0 - 0.01 * step * i for i in (1, 2)}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 11, "dsa/to')
    assert report.main([str(tmp_path)]) == 0
    md = (tmp_path / "drift_report" / "drift_report.md").read_text()
    assert "metrics.jsonl" in md and "## topk_overlap" in md
    assert "| 2 | 2 | 0.9000 | 0.8000 |" in md  # layer 2: steps 5 and 10
    assert not (tmp_path / "wandb").exists()


def _layers(n: int, value: float, slope: float) -> dict[int, dict[int, float]]:
    return {layer: {step: value + slope * step * layer for step in range(0, 40, 5)} for layer in range(1, n + 1)}


def test_drift_report_figures_axes_colorbars_and_layer_styles():
    """The overlap axis ran past 1, the relative-error axis below 0, colorbars had no label and
    12 layers shared a 10-colour cycle."""
    from matplotlib.colors import to_hex

    report = _load_report_module()
    overlap = _layers(12, 1.0, -0.0005)  # 1.0 down to 1 - 0.0005 * 35 * 12 = 0.79
    fig = report.lines_figure("topk_overlap", overlap)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert 0.0 <= lo < 0.79 and hi == 1.0  # margin max(5% of 0.21, 0.005), clipped at 1
    lines = ax.get_lines()
    assert len(lines) == 12 and len({to_hex(line.get_color()) for line in lines}) == 12
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"layer {i}" for i in range(1, 13)]
    assert ax.get_ylabel() == "topk_overlap (fraction)" and ax.get_xlabel() == "step"

    rel = report.lines_figure("score_rel_err", _layers(2, 0.001, 0.0001)).axes[0]
    assert rel.get_ylim()[0] == 0.0 and rel.get_ylim()[1] >= 0.001 + 0.0001 * 35 * 2
    assert rel.get_ylabel() == "score_rel_err (relative error)"

    heat = report.heatmap_figure("topk_overlap", overlap)
    image_ax, colorbar_ax = heat.axes
    assert colorbar_ax.get_ylabel() == "topk_overlap (fraction)"
    vmin, vmax = image_ax.images[0].get_clim()
    assert (vmin, vmax) == (lo, hi)  # the same range as the lines
    assert [t.get_text() for t in image_ax.get_yticklabels()] == [str(i) for i in range(1, 13)]


def test_drift_report_puts_the_overlap_first():
    report = _load_report_module()
    series = {name: _layers(1, 0.5, 0.0) for name in ("boundary_tie_frac", "score_rel_err", "topk_overlap",
                                                      "custom_metric", "topk_jaccard")}
    md = report.summary_markdown(series, [Path("metrics.jsonl")])
    sections = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert sections == ["topk_overlap", "topk_jaccard", "boundary_tie_frac", "score_rel_err", "custom_metric"]
