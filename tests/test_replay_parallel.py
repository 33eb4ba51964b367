"""Records of the model's own forward replayed by ``train.py`` (docs/replay.md): unsplit, and
under model parallelism (``recipes/replay/parallel.py``) at TP = 2 (sequence parallel), PP = 2 and
CP = 2 on two gloo ranks. The records come from the TP = PP = CP = 1 recorder with the weights of
an import (a pipeline stage initialises its layers from its own random stream, so only loaded
weights are the same at PP = 2). Unsplit, the replay reproduces the recorded logprobs bit for bit
(the same packed rows through the same ops); each split replay therefore equals the unsplit one
token by token when it equals the records, and its first-step loss the unsplit loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes.replay.dataset import RolloutDataset
from recipes.config.typed import to_config
from tests.test_config import _compose
from tests.test_replay import REPLAY, TINY, _record
from tests.test_replay_hf import hf_checkpoint
from tests.train_runner import metrics, run_train

GAP_TOL = 1e-5
"""TP = 2 and CP = 2 add the same fp32 terms in another order: row-parallel projections and the
vocab-parallel softmax sum partial sums over ranks, CP gathers keys and splits the experts' token
GEMMs. A reordered sum of n terms moves by at most (n - 1) * eps * sum|terms| (Higham, 2nd ed.,
section 4.2): with the longest contraction here 256 (the dense MLP) that is ~3e-5 of the terms'
scale per op, random-walk accumulated ~sqrt(n) * eps ~ 2e-6 in practice; through 4 layers onto a
logprob of ~6 this gives ~1e-6 (measured: 9.5e-7 at TP = 2, 4.8e-7 at CP = 2; the CP test's 1e-5
on the loss is the same bound, tests/test_train_cp.py). A replay that lost the recorded selection
(wrong rows, a wrong rank's experts) moves logprobs by >= 1e-3 (tests/test_replay.py's perturbed
records)."""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Records of the imported model's own forward, and the overrides that load it."""
    root = tmp_path_factory.mktemp("replay_parallel")
    _, _, load = hf_checkpoint(root)
    _record(root / "rollouts", *load)
    return root / "rollouts", load


def _unsplit_loss(rollout_dir: Path) -> float:
    """The first step's loss of the unsplit replay: its per-token losses are the recorded
    logprobs (bit for bit, the ``single`` case), token-mean over the global batch's two rows."""
    dataset = RolloutDataset(to_config(_compose(TINY + ["data=rollout", f"data.rollout_dir={rollout_dir}"])))
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(2):
        row = dataset[i]
        mask = row["loss_mask"] > 0
        total -= row["rollout_logprobs"][mask].double().sum()
        count += int(mask.sum())
    return float(total / count)


@pytest.mark.dist
@pytest.mark.parametrize("parallelism", ["single", "tp2", "pp2", "cp2"])
def test_own_records_replay_equal_at_every_split(tmp_path: Path, recorded: tuple[Path, list[str]],
                                                 parallelism: str) -> None:
    rollouts, load = recorded
    run_train(tmp_path, parallelism, REPLAY + load + [f"data.rollout_dir={rollouts}",
                                                      f"parallelism={parallelism}"],
              nproc=1 if parallelism == "single" else 2)
    row = next(r for r in metrics(tmp_path / parallelism) if "rollout/logprob_abs_diff" in r)
    loss = next(r["loss"] for r in metrics(tmp_path / parallelism) if "loss" in r)
    if parallelism in ("single", "pp2"):
        # The same ops on the same shapes (two stages split the layers, not the arithmetic): the
        # same bits, so the metric is a difference of equal numbers.
        assert row["rollout/logprob_abs_diff_max"] == 0.0 and row["rollout/kl"] == 0.0, row
    else:
        assert 0.0 < row["rollout/logprob_abs_diff_max"] <= GAP_TOL, row
    assert loss == pytest.approx(_unsplit_loss(rollouts), abs=GAP_TOL, rel=0)
    # The recorded selections are what every rank's layers recompute (their own rows and tokens),
    # measured on every layer of the whole model, whichever stage holds it.
    assert [row[f"dsa/replay_topk_overlap/layer_{n}"] for n in (1, 2, 3, 4)] == [1.0] * 4, row
    assert [row[f"moe/replay_expert_overlap/layer_{n}"] for n in (2, 3, 4)] == [1.0] * 3, row
    assert json.loads((tmp_path / parallelism / "result.json").read_text())["status"] == "completed"
