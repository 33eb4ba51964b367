"""The validation loss (``train.eval_interval`` / ``train.eval_iters``, recipes/train/evaluate.py):
``val/loss`` on the expected steps of ``metrics.jsonl``, equal to a forward over the same
validation batches done by hand, without changing the training trajectory; config errors."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.utils import Split
from torch.utils.data import default_collate

from recipes.config.rules import validate
from recipes.config.schema import ConfigError
from recipes.config.typed import to_config
from tests.test_config import _compose
from tests.test_data import corpus  # noqa: F401 - the indexed-corpus fixture
from tests.train_runner import metrics, run_train

FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=32", "logging.mode=disabled",
        "train.lr_warmup_steps=0", "precision.drift.interval=0", "train.save_final=false",
        "train.steps=5"]


def test_val_loss_on_the_eval_steps_and_the_same_training(tmp_path: Path) -> None:
    """Every 2 steps and after the last (steps 2, 4, 5) a finite ``val/loss`` (and its ``val/ppl``)
    in that step's record, one record per step as without eval; the training losses bit-equal to
    a run with eval off (the evaluation reads its own batches, in eval mode without autograd)."""
    out = run_train(tmp_path, "eval", FAST + ["train.eval_interval=2", "train.eval_iters=2"])
    run_train(tmp_path, "plain", FAST)
    rows, plain = metrics(tmp_path / "eval"), metrics(tmp_path / "plain")
    assert [r["step"] for r in rows] == [r["step"] for r in plain] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "val/loss" in r] == [2, 4, 5]
    assert not any("val/loss" in r for r in plain)
    for r in rows:
        if "val/loss" in r:
            assert math.isfinite(r["val/loss"]) and r["val/ppl"] == math.exp(r["val/loss"])
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in plain]
    assert out.stdout.count("val_loss ") == 3


def test_val_loss_equals_a_forward_by_hand(single_rank_parallel_state) -> None:
    """The validator's loss of glm5_tiny (FP32, CPU) over 3 global batches of 4 samples equals the
    token mean computed here from the model's per-token losses over the same validation samples
    (the dataset's first 12, in order: one data-parallel rank), exactly: both run the same ops
    on the same values in the same order (each micro batch's FP32 masked sum, then FP64 sums over
    micro batches), deterministic on a CPU. The samples are not the training split's."""
    from recipes.config.megatron import to_transformer_config
    from recipes.loop import _validator, forward_step
    from recipes.train import data as data_lib
    from recipes.train.model import build_gpt_model

    cfg = to_config(_compose(FAST + ["train.eval_interval=1", "train.eval_iters=3",
                                     "train.micro_batch_size=2", "train.global_batch_size=4",
                                     "train.cross_entropy_fusion=false"]))
    torch.manual_seed(0)
    model = build_gpt_model(cfg, to_transformer_config(cfg))
    tokenizer = data_lib.build_tokenizer(cfg.data, cfg.model.vocab_size)
    validator = _validator(cfg, tokenizer, num_microbatches=2)
    assert validator.num_microbatches == 6 and validator.due(1)
    device = torch.device("cpu")
    found = validator.loss(model, partial(forward_step, device, None), device)
    assert model.training and all(p.grad is None for p in model.parameters())

    kwargs = dict(tokenizer=tokenizer, seq_length=32, num_samples=12, seed=cfg.train.seed)
    valid = data_lib.build_dataset(cfg.data, Split.valid, **kwargs)
    train = data_lib.build_dataset(cfg.data, Split.train, **kwargs)
    assert not torch.equal(torch.as_tensor(valid[0]["tokens"]), torch.as_tensor(train[0]["tokens"]))
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for first in range(0, 12, 2):
            b = default_collate([valid[i] for i in range(first, first + 2)])
            loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            mask = b["loss_mask"].reshape(-1).float()
            totals += torch.stack([(loss.float().reshape(-1) * mask).sum(), mask.sum()]).double()
    assert totals[1] == 12 * 32
    assert found == (totals[0] / totals[1]).item()


@pytest.mark.parametrize(("overrides", "key"), [
    (["data=indexed", "data.paths=[data/x_text_document]", "data.tokenizer=tok",
      "data.split='100,0,0'"], "data.split"),
    (["data=rollout", "data.rollout_dir=r", "train.micro_batch_size=1"], "train.eval_interval"),
    (["train.eval_iters=0"], "train.eval_iters"),
    (["train.eval_interval=-1"], "train.eval_interval"),
])
def test_eval_config_errors_name_the_key(overrides: list[str], key: str) -> None:
    """Eval on data without a validation split, or a count outside its range: a ConfigError
    naming the key before anything is built."""
    cfg = _compose(["train.eval_interval=2", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert err.value.key == key


def test_indexed_split_with_a_validation_part_passes_and_eval_off_needs_none() -> None:
    """``969,30,1`` with eval on, and ``100,0,0`` with eval off, are valid."""
    indexed = ["data=indexed", "data.paths=[data/x_text_document]", "data.tokenizer=tok"]
    validate(_compose([*indexed, "train.eval_interval=2"]), 1)
    validate(_compose([*indexed, "data.split='100,0,0'"]), 1)


def test_resume_with_eval_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    """Eval every 2 steps over 6 steps, resumed from the step-3 checkpoint: steps 4-6 log the same
    training losses and the same ``val/loss`` (steps 4 and 6) as the uninterrupted run, bit for bit
    (the evaluation never reads the training iterator, whose position the checkpoint holds)."""
    common = FAST + ["train.steps=6", "train.eval_interval=2", "train.keep_checkpoints=5"]
    run_train(tmp_path, "full", common + ["train.save_interval=3"])
    full = metrics(tmp_path / "full")
    ckpt3 = tmp_path / "full" / "checkpoints" / "iter_0000003"
    run_train(tmp_path, "resumed", common + [f"train.resume={ckpt3}"])
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["step"] for r in resumed if "val/loss" in r] == [4, 6]
    for key in ("loss", "val/loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in full[3:]], key


GRAPHED = ["model=glm5_tiny", "model.num_moe_experts=null", "precision=bf16", "model.dsa_kernels=triton",
           "data.seq_length=256", "train.steps=5", "train.micro_batch_size=1",
           "train.global_batch_size=2", "train.save_final=false", "logging.mode=disabled",
           "train.cuda_graph_warmup_steps=1", "precision.drift.interval=0"]


@pytest.mark.gpu
def test_eval_runs_eagerly_beside_the_cuda_graph(tmp_path: Path) -> None:
    """A dense graphed run (step 1 eager, step 2 captured, later steps replayed) with eval every 2
    steps: the evaluation runs eagerly between replays; training losses and ``val/loss`` bit-equal
    to the eager run with eval (dense bf16: no atomics in the step, see tests/test_cuda_graph.py),
    and training losses bit-equal to the graphed run without eval."""
    ev = ["train.eval_interval=2"]
    graphs = ["train.cuda_graph_impl=full_iteration"]
    out = run_train(tmp_path, "graphed_eval", GRAPHED + graphs + ev, timeout=900).stdout
    assert "step 2: forward-backward captured as one CUDA graph" in out
    run_train(tmp_path, "graphed", GRAPHED + graphs, timeout=900)
    run_train(tmp_path, "eager_eval", GRAPHED + ev, timeout=900)
    graphed_eval, graphed, eager_eval = (metrics(tmp_path / n) for n in ("graphed_eval", "graphed", "eager_eval"))
    assert [r["step"] for r in graphed_eval if "val/loss" in r] == [2, 4, 5]
    assert all(math.isfinite(r["val/loss"]) for r in graphed_eval if "val/loss" in r)
    for key in ("loss", "val/loss"):
        assert [r.get(key) for r in graphed_eval] == [r.get(key) for r in eager_eval], key
    assert [r["loss"] for r in graphed_eval] == [r["loss"] for r in graphed]


def test_sweep_summary_lists_the_last_val_loss(tmp_path: Path) -> None:
    """``final_val_loss``: the job's last ``val/loss`` (not its last step's record, which may
    hold none), empty for a job that evaluated nothing; a column of summary.md too."""
    import csv
    import json

    from recipes.observe.sweep import write_summary

    sweep = tmp_path / "sweep"
    records = {"a": [{"step": 1, "loss": 3.0, "val/loss": 2.5}, {"step": 2, "loss": 2.0, "val/loss": 2.25},
                     {"step": 3, "loss": 1.0}],
               "b": [{"step": 1, "loss": 3.0}]}
    for num, (x, rows) in enumerate(records.items()):
        job = sweep / str(num)
        job.mkdir(parents=True)
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (job / "result.json").write_text(json.dumps({"status": "completed", "error": None,
                                                     "final_loss": rows[-1]["loss"], "steps": len(rows),
                                                     "overrides": [f"x={x}"]}))
    write_summary(sweep)
    with (sweep / "summary.csv").open() as f:
        found = {row["label"]: row["final_val_loss"] for row in csv.DictReader(f)}
    assert found == {"x=a": "2.25", "x=b": ""}
    assert "final_val_loss" in (sweep / "summary.md").read_text()


def test_indexed_validation_split_is_built_and_an_empty_one_is_named(corpus, tmp_path: Path) -> None:
    """40 documents: ``9,1,0`` gives the validation split documents 36-39, built as megatron's
    GPTDataset with the requested samples; ``99,1,0`` gives it none (rounded: documents 40 to 40),
    which megatron would try to fill forever: a ConfigError naming ``data.split`` first, only when
    eval is on."""
    from recipes.config.schema import DataConfig, DataKind
    from recipes.train.data import build_dataset, build_tokenizer
    from recipes.train.data_checks import check_indexed_data

    def data(split: str) -> DataConfig:
        return DataConfig(kind=DataKind.indexed, paths=[corpus.prefixes["alpha"]], split=split,
                          tokenizer=str(corpus.tok_dir), cache_dir=str(tmp_path / "cache"))

    check_indexed_data(data("9,1,0"), 300, validation=True)
    valid = build_dataset(data("9,1,0"), Split.valid, tokenizer=build_tokenizer(data("9,1,0"), 300),
                          seq_length=16, num_samples=8, seed=1)
    assert len(valid) >= 8 and torch.as_tensor(valid[0]["tokens"]).shape == (16,)
    check_indexed_data(data("99,1,0"), 300)  # eval off: no validation split needed
    with pytest.raises(ConfigError, match=r"validation part gets at least one of the 40 documents") as err:
        check_indexed_data(data("99,1,0"), 300, validation=True)
    assert err.value.key == "data.split"
