"""Rollout replay (docs/replay.md): the record validator, packing onto THD rows, the config
rules, and replay itself: records written by the model replay to a logprob gap of exactly 0 in
fp32 with identical selections, and perturbed records change the loss (replay is not ignored)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.replay.dataset import RolloutDataset, model_layers, pack_row, packed_seq_params_from_starts
from recipes.replay.records import ModelLayers, RecordError, RolloutRecord, read_record, write_record
from recipes.config.schema import ConfigError
from recipes.config.rules import validate
from recipes.config.typed import to_config
from tests.test_config import _compose
from tests.train_runner import ROOT, metrics, run_train, subprocess_env

TINY = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64"]


def _layers() -> ModelLayers:
    return model_layers(to_config(_compose(TINY)).model)


def _valid(s: int, layers: ModelLayers, seed: int = 0) -> dict:
    """A valid record's tensors for ``layers``: query i selects keys 0..min(i, W-1)."""
    gen = torch.Generator().manual_seed(seed)
    w = layers.topk_width
    slots = torch.arange(w).expand(s, w)
    topk = torch.where(slots <= torch.arange(s).unsqueeze(1), slots, -1)
    experts = torch.stack([torch.randperm(layers.num_experts, generator=gen)[:layers.router_topk]
                           for _ in range(s)])
    return dict(tokens=torch.randint(0, layers.vocab_size, (s,), generator=gen),
                loss_mask=torch.arange(s) >= 3, logprobs=-torch.rand(s, generator=gen),
                topk={n: topk.clone() for n in layers.topk_layers},
                experts={n: experts.clone() for n in layers.moe_layers}, facts=dict(layers.facts))


def test_a_valid_record_reads_back(tmp_path: Path) -> None:
    layers = _layers()
    parts = _valid(12, layers)
    write_record(tmp_path / "r.safetensors", **parts)
    record = read_record(tmp_path / "r.safetensors", layers, require_topk=True, require_experts=True)
    assert torch.equal(record.tokens, parts["tokens"]) and torch.equal(record.loss_mask, parts["loss_mask"])
    assert sorted(record.topk) == [1, 2, 3, 4] and sorted(record.experts) == [2, 3, 4]
    assert torch.equal(record.topk[2], parts["topk"][2]) and torch.equal(record.experts[3], parts["experts"][3])


def _break(name: str, parts: dict) -> None:
    if name == "token":
        parts["tokens"][5] = 512
    elif name == "future_key":
        parts["topk"][3][4, 7] = 5
    elif name == "below_minus_one":
        parts["topk"][1][6, 0] = -2
    elif name == "topk_width":
        parts["topk"][2] = parts["topk"][2][:, :8]
    elif name == "missing_layer":
        del parts["topk"][4]
    elif name == "extra_layer":
        parts["experts"][1] = parts["experts"][2]
    elif name == "expert_range":
        parts["experts"][4][9, 1] = 8
    elif name == "expert_repeat":
        parts["experts"][2][3] = torch.tensor([5, 5])
    elif name == "logprob":
        parts["logprobs"][8] = 0.5
    elif name == "loss_mask":
        parts["loss_mask"] = parts["loss_mask"].to(torch.int64)
        parts["loss_mask"][2] = 2
    elif name == "other_model":
        parts["facts"]["num_layers"] = "6"
    elif name == "other_kpool":
        parts["facts"]["dsa_indexer_kpool"] = "4"


# (what is broken, the key the error names, the row it names or None, words of the message)
BROKEN = [
    ("token", "tokens", 5, "outside [0, 512)"),
    ("future_key", "indexer_topk.layer_3", 4, "after the query"),
    ("below_minus_one", "indexer_topk.layer_1", 6, "< -1"),
    ("topk_width", "indexer_topk.layer_2", None, "[s, W]=[12, 16]"),
    ("missing_layer", "indexer_topk.layer_*", None, "layers [1, 2, 3]"),
    ("extra_layer", "routed_experts.layer_*", None, "layers [1, 2, 3, 4]"),
    ("expert_range", "routed_experts.layer_4", 9, "outside [0, 8)"),
    ("expert_repeat", "routed_experts.layer_2", 3, "repeat"),
    ("logprob", "logprobs", 8, "log-probability"),
    ("loss_mask", "loss_mask", 2, "not 0 or 1"),
    ("other_model", "metadata num_layers", None, "records of another model"),
    ("other_kpool", "metadata dsa_indexer_kpool", None, "KPool records of another dsa_indexer_kpool"),
]


@pytest.mark.parametrize("name,key,row,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_every_validation_error_names_file_key_and_row(tmp_path: Path, name: str, key: str,
                                                       row: int | None, words: str) -> None:
    layers = _layers()
    parts = _valid(12, layers)
    _break(name, parts)
    path = tmp_path / f"{name}.safetensors"
    write_record(path, **parts)
    with pytest.raises(RecordError) as err:
        read_record(path, layers)
    assert (err.value.path, err.value.key, err.value.row) == (str(path), key, row)
    message = str(err.value)
    assert str(path) in message and key in message and words in message
    if row is not None:
        assert f"row {row}" in message


def test_an_unreadable_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "torn.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(RecordError, match="torn.safetensors: \\(file\\): not a readable safetensors"):
        read_record(path, _layers())


def test_replay_needs_its_layers_in_every_record(tmp_path: Path) -> None:
    """A record without routing may train without router replay, never with it."""
    layers = _layers()
    parts = _valid(10, layers)
    parts["experts"] = {}
    write_record(tmp_path / "r.safetensors", **parts)
    assert read_record(tmp_path / "r.safetensors", layers).experts == {}
    with pytest.raises(RecordError, match="routed_experts.layer_"):
        read_record(tmp_path / "r.safetensors", layers, require_experts=True)


def test_packing_rebases_indices_onto_the_row() -> None:
    layers = _layers()
    first, second = _valid(10, layers, seed=1), _valid(7, layers, seed=2)
    records = [RolloutRecord(p["tokens"], p["loss_mask"], p["logprobs"], p["topk"], p["experts"])
               for p in (first, second)]
    row = pack_row(records, 20, layers)
    assert torch.equal(row["tokens"][:17], torch.cat([first["tokens"], second["tokens"]]))
    assert torch.equal(row["labels"][:9], first["tokens"][1:]) and row["labels"][9] == 0
    assert torch.equal(row["loss_mask"][:10], torch.cat([first["loss_mask"][1:], torch.tensor([False])]).float())
    assert torch.equal(row["rollout_logprobs"][10:16], second["logprobs"][1:])
    assert row["has_rollout_logprobs"].tolist() == [True] * 9 + [False] + [True] * 6 + [False] * 4
    topk = row["indexer_topk.layer_2"]
    want = second["topk"][2]
    assert torch.equal(topk[10:17], torch.where(want < 0, want, want + 10))
    assert torch.equal(topk[:10], first["topk"][2]) and (topk[17:] == -1).all()
    assert torch.equal(row["routed_experts.layer_3"][10:17], second["experts"][3])
    assert torch.equal(row["position_ids"], torch.cat([torch.arange(10), torch.arange(7), torch.arange(3)]))
    packed = packed_seq_params_from_starts(row["sample_starts"].unsqueeze(0))
    assert packed.cu_seqlens_q.tolist() == [0, 10, 17, 20] and packed.max_seqlen_q == 10


@pytest.mark.parametrize("overrides,key", [
    (["model.dsa_topk_replay=true"], "model.dsa_topk_replay"),
    (["model.moe_router_replay=true"], "model.moe_router_replay"),
    (["data=rollout"], "data.rollout_dir"),
    (["data=rollout", "data.rollout_dir=x", "model.mtp_num_layers=1"], "model.mtp_num_layers"),
    (["data=rollout", "data.rollout_dir=x", "train.micro_batch_size=2"], "train.micro_batch_size"),
])
def test_replay_config_errors_name_the_key(overrides: list[str], key: str) -> None:
    cfg = _compose(TINY + overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, cfg.parallelism.nodes * cfg.parallelism.gpus_per_node * 2)
    assert err.value.key == key


def test_too_few_rows_and_missing_records_are_config_errors(tmp_path: Path) -> None:
    cfg = to_config(_compose(TINY + ["data=rollout", f"data.rollout_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match="data.rollout_dir"):
        RolloutDataset(cfg)
    write_record(tmp_path / "a.safetensors", **_valid(40, _layers()))
    write_record(tmp_path / "b.safetensors", **_valid(40, _layers()))
    assert len(RolloutDataset(cfg)) == 2  # 40 + 40 > 64: one sample per row
    with pytest.raises(ConfigError, match="train.steps"):
        RolloutDataset(cfg, min_rows=3)
    write_record(tmp_path / "c.safetensors", **_valid(65, _layers()))
    with pytest.raises(ConfigError, match="data.seq_length"):
        RolloutDataset(cfg)


def _record(out: Path, *extra: str) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "record_rollout.py"), "--out", str(out),
           "--num-samples", "6", "--min-length", "12", "--max-length", "40", *extra, *TINY]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


REPLAY = TINY + ["data=rollout", "train.steps=1", "train.lr_warmup_steps=0", "train.global_batch_size=2",
                 "train.micro_batch_size=1", "train.save_final=false", "logging.mode=disabled",
                 "precision.drift.interval=1", "model.dsa_topk_replay=true", "model.moe_router_replay=true"]


def _forward_loss(cfg, model, row: dict) -> torch.Tensor:
    from recipes.replay.step import RolloutStep

    step = RolloutStep(cfg, model)
    step.begin(measure=False)
    batch = {k: v.unsqueeze(0) for k, v in row.items()}
    packed = step.prepare(batch)
    with torch.enable_grad():
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                     packed_seq_params=packed).detach()


@pytest.mark.parametrize("family", ["indexer_topk", "routed_experts"])
def test_perturbed_records_change_the_loss(tmp_path: Path, single_rank_parallel_state, family: str) -> None:
    """Replay is not silently ignored: the same row with perturbed recorded selections (top-k:
    each query keeps only its own key; experts: each shifted to the next) gives other losses,
    and the unperturbed record reproduces its logprobs bit for bit."""
    from recipes.replay.recorder import build_recording_model, record_rollouts

    overrides = ["data=rollout", f"data.rollout_dir={tmp_path}", "model.dsa_topk_replay=true",
                 "model.moe_router_replay=true"]
    cfg = to_config(_compose(TINY + overrides))
    model = build_recording_model(cfg)
    gen = torch.Generator().manual_seed(0)
    record_rollouts(cfg, model, [torch.randint(0, 511, (30,), generator=gen) for _ in range(2)], tmp_path)
    model.config.dsa_topk_replay = True  # every layer reads the one config: now replay
    dataset = RolloutDataset(cfg)
    row = dataset[0]
    loss = _forward_loss(cfg, model, row)
    mask = row["has_rollout_logprobs"]
    assert torch.equal(-loss[0][mask], row["rollout_logprobs"][mask]), (-loss[0][mask] - row["rollout_logprobs"][mask]).abs().max()
    perturbed = dict(row)
    for key in [k for k in row if k.startswith(family)]:
        idx = row[key]
        if family == "indexer_topk":
            own = torch.arange(idx.shape[0]).unsqueeze(1)
            perturbed[key] = torch.where(torch.arange(idx.shape[1]) == 0, own, -1)
        else:
            perturbed[key] = (idx + 1) % cfg.model.num_moe_experts
    other = _forward_loss(cfg, model, perturbed)
    changed = (other[0] - loss[0]).abs()[row["sample_tokens"]]
    assert changed.max() > 1e-3, changed.max()


def test_replay_with_indexshare_and_indexer_loss(tmp_path: Path, single_rank_parallel_state) -> None:
    """IndexShare records only the computing layers (skip layers take their source's replayed
    indices) and the indexer loss runs on the replayed keys; the recorded logprobs come back bit
    for bit (the same forward) and every computing layer records its KL."""
    from kpool_layers.mla.attention import collect_indexer_losses
    from recipes.replay.recorder import build_recording_model, record_rollouts

    overrides = ["data=rollout", f"data.rollout_dir={tmp_path}", "model.dsa_topk_replay=true",
                 "model.moe_router_replay=true", "model.dsa_indexer_topk_freq=2",
                 "model.dsa_indexer_loss_coeff=0.01", "model.dsa_indexer_use_sparse_loss=true"]
    cfg = to_config(_compose(TINY + overrides))
    model = build_recording_model(cfg)
    gen = torch.Generator().manual_seed(1)
    record_rollouts(cfg, model, [torch.randint(0, 511, (25,), generator=gen) for _ in range(2)], tmp_path)
    collect_indexer_losses(model)
    model.config.dsa_topk_replay = True
    dataset = RolloutDataset(cfg)
    assert sorted(dataset.records[0].topk) == [1, 3]
    row = dataset[0]
    loss = _forward_loss(cfg, model, row)
    mask = row["has_rollout_logprobs"]
    assert torch.equal(-loss[0][mask], row["rollout_logprobs"][mask])
    assert sorted(collect_indexer_losses(model)) == ["decoder.layers.0.self_attention",
                                                     "decoder.layers.2.self_attention"]


def test_without_replay_the_overlaps_name_the_layers_that_differ(tmp_path: Path,
                                                                 single_rank_parallel_state) -> None:
    """Replay off, measured step: the model attends and routes by itself (the loss ignores the
    records) and the per-layer overlaps show which layers' records it does not reproduce: layer 3's
    top-k and layer 4's experts are perturbed, every other layer's overlap stays exactly 1."""
    from recipes.replay.recorder import build_recording_model, record_rollouts
    from recipes.replay.step import RolloutStep

    cfg = to_config(_compose(TINY + ["data=rollout", f"data.rollout_dir={tmp_path}"]))
    model = build_recording_model(cfg)
    gen = torch.Generator().manual_seed(2)
    record_rollouts(cfg, model, [torch.randint(0, 511, (30,), generator=gen) for _ in range(2)], tmp_path)
    row = RolloutDataset(cfg)[0]
    perturbed = dict(row)
    idx = row["indexer_topk.layer_3"]
    perturbed["indexer_topk.layer_3"] = torch.where(torch.arange(idx.shape[1]) == 0,
                                                    torch.arange(idx.shape[0]).unsqueeze(1), -1)
    perturbed["routed_experts.layer_4"] = (row["routed_experts.layer_4"] + 1) % cfg.model.num_moe_experts
    losses, scalars = [], []
    for batch_row in (row, perturbed):
        step = RolloutStep(cfg, model)
        step.begin(measure=True)
        batch = {k: v.unsqueeze(0) for k, v in batch_row.items()}
        with torch.enable_grad():
            losses.append(model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                                packed_seq_params=step.prepare(batch)).detach())
        scalars.append(step.end([], torch.device("cpu")))
    assert torch.equal(losses[0], losses[1])
    assert all(scalars[0][f"dsa/replay_topk_overlap/layer_{n}"] == 1.0 for n in (1, 2, 3, 4))
    assert all(scalars[0][f"moe/replay_expert_overlap/layer_{n}"] == 1.0 for n in (2, 3, 4))
    assert [scalars[1][f"dsa/replay_topk_overlap/layer_{n}"] < 1.0 for n in (1, 2, 3, 4)] == [False, False, True, False]
    assert [scalars[1][f"moe/replay_expert_overlap/layer_{n}"] < 1.0 for n in (2, 3, 4)] == [False, False, True]


def test_train_refuses_a_bad_record_before_the_build(tmp_path: Path) -> None:
    """train.py with a record of an out-of-range expert fails naming the file, key and row."""
    layers = _layers()
    for i in range(2):
        parts = _valid(20, layers, seed=i)
        if i == 1:
            parts["experts"][3][7, 0] = 9
        write_record(tmp_path / f"r{i}.safetensors", **parts)
    proc = run_train(tmp_path, "bad", REPLAY + [f"data.rollout_dir={tmp_path}"], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"{tmp_path / 'r1.safetensors'}: routed_experts.layer_3 row 7" in out, out[-3000:]
    assert "moe.router" not in out  # the precision table, printed after the build, is not


@pytest.mark.gpu
def test_own_records_replay_with_zero_gap_in_bf16_on_gpu(tmp_path: Path) -> None:
    """On a GPU in bf16 with the Triton DSA kernels: the training forward of a replayed row is the
    recording forward repeated (same weights, same rows, replayed routing and top-k), so with the
    deterministic forward kernels the precision map reports, the gap is exactly 0 and the
    recorded top-k is the model's own."""
    gpu = ["model=glm5_tiny", "precision=bf16", "model.dsa_kernels=triton", "data.seq_length=256"]
    cmd = [sys.executable, str(ROOT / "scripts" / "record_rollout.py"), "--out", str(tmp_path / "rollouts"),
           "--num-samples", "8", "--min-length", "32", "--max-length", "200", *gpu]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_train(tmp_path, "replay_gpu", gpu + [o for o in REPLAY if not o.startswith(("model=", "precision=", "data.seq_length"))]
              + [f"data.rollout_dir={tmp_path / 'rollouts'}"])
    row = next(r for r in metrics(tmp_path / "replay_gpu") if "rollout/logprob_abs_diff" in r)
    assert row["rollout/logprob_abs_diff"] == 0.0 and row["rollout/kl"] == 0.0
    # The top-k was recorded in the replayed forward itself; the experts in the forward before it,
    # whose hidden states differ by roundings (the padding's routing), so their overlap is not pinned.
    assert row["dsa/replay_topk_overlap"] == 1.0
