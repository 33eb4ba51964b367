"""Rollout records from a transformers GLM-5 model (``scripts/record_rollout.py --hf``,
``recipes/replay/hf_recorder.py``): a tiny random ``glm_moe_dsa`` checkpoint, imported with
``convert_checkpoint.py``'s import, recorded by transformers and replayed in our model: the
attention reads exactly HF's selection, the routers HF's experts, and the logprob gap is within
fp32 reordering (the two models compute the same function in other op orders)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from recipes.replay.dataset import RolloutDataset  # noqa: E402
from recipes.replay.hf_recorder import HFCapture, load_hf_model, to_record_topk  # noqa: E402
from recipes.config.typed import to_config  # noqa: E402
from tests.test_config import _compose  # noqa: E402
from tests.test_replay import TINY  # noqa: E402
from tests.train_runner import ROOT, subprocess_env  # noqa: E402

HF_GAP_TOL = 1e-5
"""Same selections and routing: the models differ only in op order (HF's dense masked attention
vs our gathered sparse one, fused vs split projections), i.e. reordered fp32 sums. A reordered sum
of n terms moves by at most (n - 1) * eps * sum|terms| (Higham, 2nd ed., section 4.2), in practice
~sqrt(n) * eps (random-walk roundings): with n <= 256 here, ~2e-6 relative per op, ~1e-6 on a
logprob of ~6 through 4 layers (|d logp| <= 2 max|d logit|); tests/test_hf_interop.py measures a
4.6e-7 logit error. A lost selection moves logprobs by >= 1e-3 (tests/test_replay.py)."""


def hf_checkpoint(root: Path) -> tuple[Path, Path, list[str]]:
    """A tiny random glm_moe_dsa checkpoint (glm5_tiny's shapes) and its import: (HF dir, import,
    train.py overrides that build and load it)."""
    from scripts.convert_checkpoint import import_hf
    from tests.test_hf_interop import save_tiny

    hf_dir = save_tiny(root / "hf", index_n_heads=4)
    import_hf(hf_dir, root / "ckpt", model="glm5_tiny")
    # transformers' glm_moe_dsa builds its MLA latent norms with eps 1e-6 (docs/hf_interop.md)
    return hf_dir, root / "ckpt", [f"train.load={root / 'ckpt'}", "model.mla_latent_norm_epsilon=1e-6"]


def test_hf_records_replay_hf_selection_within_fp32_reordering(tmp_path: Path, single_rank_parallel_state) -> None:
    from recipes.replay.recorder import build_recording_model
    from recipes.replay.step import RolloutStep

    hf_dir, _, load = hf_checkpoint(tmp_path)
    out = tmp_path / "rollouts"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_rollout.py"), "--hf", str(hf_dir),
                           "--out", str(out), "--num-samples", "3", "--min-length", "20", "--max-length", "30"],
                          cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = to_config(_compose(TINY + load + ["data=rollout", f"data.rollout_dir={out}", "model.dsa_topk_replay=true",
                                            "model.moe_router_replay=true"]))
    dataset = RolloutDataset(cfg)  # validated against our model: layers, widths, ranges, metadata
    record = dataset.records[0]
    assert sorted(record.topk) == [1, 2, 3, 4] and sorted(record.experts) == [2, 3, 4]

    # HF's own selection of the first sample, as its attention uses it (indices after the query
    # masked), per query as a set.
    hf = load_hf_model(hf_dir)
    capture = HFCapture(hf)
    with torch.no_grad():
        hf(input_ids=record.tokens[None], use_cache=False)
    capture.remove()
    s = record.length
    for layer, idx in capture.topk.items():
        raw = idx[0].long()
        want = [set(raw[i][raw[i] <= i].tolist()) for i in range(s)]
        assert [set(r[r >= 0].tolist()) for r in to_record_topk(idx, 16)] == want
    # Our model replaying the records: every attention reads HF's selection.
    model = build_recording_model(cfg)
    model.config.dsa_topk_replay = True
    attended: dict[int, torch.Tensor] = {}
    handles = [m.core_attention.register_forward_hook(
        lambda mod, args, output, n=m.layer_number: attended.__setitem__(n, args[2][0]))
        for m in model.modules() if type(m).__name__ == "GLMSparseMLA"]
    step = RolloutStep(cfg, model)
    step.begin(measure=False)
    row = {k: v.unsqueeze(0) for k, v in dataset[0].items()}
    with torch.enable_grad():
        loss = model(row["tokens"], row["position_ids"], None, labels=row["labels"],
                     packed_seq_params=step.prepare(row)).detach()[0]
    for h in handles:
        h.remove()
    for layer, idx in capture.topk.items():
        raw = idx[0].long()
        got = attended[layer][:s]  # the first sample is at the row's start
        assert [set(r[r >= 0].tolist()) for r in got] == [set(raw[i][raw[i] <= i].tolist()) for i in range(s)]
    mask = row["has_rollout_logprobs"][0]
    gap = (-loss[mask] - row["rollout_logprobs"][0][mask]).abs()
    assert 0 < gap.max() <= HF_GAP_TOL, gap.max()  # nonzero: other ops, the records are HF's
