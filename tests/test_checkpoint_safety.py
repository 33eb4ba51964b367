"""Issue #14: never lose, corrupt or silently ignore a checkpoint.

Each test is a failure scenario the recipes must prevent. Training runs in this process
(``recipes.loop.run`` on a composed config: tiny model, fp32, a few steps) so that a scenario
costs seconds, not a fresh interpreter.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from hydra import compose, initialize_config_dir

from recipes.checkpoint.manifest import CheckpointError, verify, write_manifest
from recipes.launch.distributed import register_resolvers
from recipes.config.schema import ConfigError, register_configs
from tests.conftest import free_port

CONF = Path(__file__).resolve().parents[1] / "conf"
FAST = ["model=glm5_tiny", "precision=fp32", "data.seq_length=32", "logging.mode=disabled",
        "train.lr_warmup_steps=0", "train.micro_batch_size=2", "train.global_batch_size=2",
        "precision.drift.interval=0"]
register_resolvers()
register_configs()

Train = Callable[..., str]
shutil_usage = type(shutil.disk_usage("/"))


def _run(monkeypatch: pytest.MonkeyPatch, run_dir: Path, overrides: tuple[str, ...]) -> None:
    """``recipes.loop.run`` on the composed config, as one rank with a free rendezvous port."""
    from recipes.loop import run

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*FAST, *overrides])
    run(cfg, run_dir, list(overrides))


@pytest.fixture
def train(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Train:
    """``train(run_dir, *overrides)`` trains in this process and returns its stdout (also in
    ``train.out`` when it raised)."""
    def go(run_dir: Path, *overrides: str) -> str:
        capsys.readouterr()
        try:
            _run(monkeypatch, run_dir, overrides)
        finally:
            go.out = capsys.readouterr().out
        return go.out

    go.out = ""
    return go


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run that kept iter_1..iter_3 (trained once, copied by the tests)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        _run(monkeypatch, run_dir, ("train.steps=3", "train.save_interval=1", "train.keep_checkpoints=3"))
    return run_dir


@pytest.fixture
def run_copy(three_checkpoints: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(three_checkpoints, tmp_path / "run")
    return tmp_path / "run"


# 1. Pruning and `latest` belong to the run that owns the directory.

def test_fresh_run_into_a_directory_with_checkpoints_is_refused_files_untouched(
        run_copy: Path, train: Train, tmp_path: Path) -> None:
    root = run_copy / "checkpoints"
    before = _snapshot(root)
    with pytest.raises(CheckpointError) as err:
        train(tmp_path / "other", "train.steps=1", f"train.save={root}", "train.resume=none")
    for fix in ("another run id", "train.resume=auto", "train.overwrite=true"):
        assert fix in str(err.value)
    assert _snapshot(root) == before


def test_overwrite_never_prunes_another_runs_checkpoints_nor_latest(
        run_copy: Path, train: Train, tmp_path: Path) -> None:
    """resume=none into a dir with another run's later iter_* must neither prune each new
    checkpoint right after it is written nor leave ``latest`` naming a deleted directory."""
    root = run_copy / "checkpoints"
    for step in (3, 2, 1):  # the other run's checkpoints are later than ours
        os.replace(root / f"iter_{step:07d}", root / f"iter_{step + 4:07d}")
    theirs = {"iter_0000005", "iter_0000006", "iter_0000007"}

    def their_files(snapshot: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        return {k: v for k, v in snapshot.items() if k.split("/")[0] in theirs}

    before = their_files(_snapshot(root))
    train(tmp_path / "other", "train.steps=2", "train.save_interval=1", "train.keep_checkpoints=1",
          f"train.save={root}", "train.resume=none", "train.overwrite=true")
    assert {p.name for p in root.glob("iter_*")} == theirs | {"iter_0000002"}  # ours pruned to keep=1
    assert their_files(_snapshot(root)) == before
    assert (root / "latest").read_text() == "iter_0000002"


def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path: Path) -> None:
    from recipes.checkpoint.store import LATEST, prune

    for step in (1, 2, 3):
        ckpt = tmp_path / f"iter_{step:07d}"
        ckpt.mkdir()
        (ckpt / "data").write_text(str(step))
        write_manifest(ckpt, config={}, lineage="mine", step=step)
    other = tmp_path / "iter_0000009"
    other.mkdir()
    write_manifest(other, config={}, lineage="someone else", step=9)
    (tmp_path / LATEST).write_text("iter_0000001")  # e.g. set back by hand to an older checkpoint
    removed = prune(tmp_path, keep=1, lineage="mine")
    assert [p.name for p in removed] == ["iter_0000002"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000001", "iter_0000003", "iter_0000009"]


# 2. Resume takes the newest complete checkpoint and says which and why; never a silent restart.

def test_dangling_latest_resumes_the_newest_complete_checkpoint_and_says_so(run_copy: Path, train: Train) -> None:
    (run_copy / "checkpoints" / "latest").write_text("iter_0000009")
    out = train(run_copy, "train.steps=4")
    assert "'iter_0000009', which does not exist" in out
    assert "resumed from" in out and "at step 3" in out


def test_corrupted_checkpoint_is_named_and_the_previous_one_is_used(run_copy: Path, train: Train) -> None:
    root = run_copy / "checkpoints"
    shard = root / "iter_0000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Explicit resume: an error naming the file, offering the previous checkpoint.
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: checksum mismatch.*iter_0000002"):
        train(run_copy, "train.steps=4", f"train.resume={root / 'iter_0000003'}")
    # auto: names it and resumes from the previous complete one.
    out = train(run_copy, "train.steps=4")
    assert "__0_0.distcp: checksum mismatch" in out and "at step 2" in out


def test_checkpoint_that_fails_to_load_is_named_and_the_previous_one_is_used(run_copy: Path, train: Train) -> None:
    """A checkpoint without a manifest (written before manifests) can only fail in the loader."""
    ckpt = run_copy / "checkpoints" / "iter_0000003"
    (ckpt / "kpool_manifest.json").unlink()
    (ckpt / "__0_0.distcp").write_bytes(b"")
    out = train(run_copy, "train.steps=4")
    assert f"checkpoint {ckpt} is unusable" in out and "resuming from" in out and "at step 2" in out


def test_truncated_or_missing_files_everywhere_is_an_error_not_a_restart(run_copy: Path, train: Train) -> None:
    root = run_copy / "checkpoints"
    for ckpt in root.glob("iter_*"):
        shard = ckpt / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    (root / "iter_0000001" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        train(run_copy, "train.steps=4")
    assert "truncated" in str(err.value) and "missing" in str(err.value)
    assert not (run_copy / "metrics.jsonl").read_text().count('"step": 4')


# 3. Integrity: manifest with sizes, checksums, config and code version.

def test_manifest_records_config_and_code_version_and_catches_flipped_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 10)
    write_manifest(tmp_path, config={"model": {"hidden_size": 8}}, lineage="L", step=7)
    manifest = verify(tmp_path)
    assert manifest["config"] == {"model": {"hidden_size": 8}} and manifest["step"] == 7
    assert manifest["code_version"] and set(manifest["files"]) == {"a.bin", "sub/b.bin"}
    (tmp_path / "sub" / "b.bin").write_bytes(b"z" * 10)
    with pytest.raises(CheckpointError, match=r"sub/b\.bin: checksum mismatch"):
        verify(tmp_path)


# 4. Strict loads and the LR schedule on resume.

@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a model fails the test: the error must come before it."""
    import recipes.loop

    def build(*args: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(recipes.loop, "build_gpt_model", build)


def test_resume_with_other_shapes_names_every_key_before_the_build(run_copy: Path, train: Train,
                                                                   no_build: None) -> None:
    with pytest.raises(CheckpointError) as err:
        train(run_copy, "train.steps=4", "model.hidden_size=64", "model.vocab_size=256", "precision=bf16")
    message = str(err.value)
    for key in ("model.hidden_size: checkpoint 128, now 64", "model.vocab_size", "precision.dtype"):
        assert key in message


def test_missing_tensors_are_an_error_not_dropped(run_copy: Path, train: Train, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.checkpoint import integrity as checkpoint_integrity

    ckpt = run_copy / "checkpoints" / "iter_0000003"
    (ckpt / "kpool_manifest.json").unlink()  # a pre-manifest checkpoint: only the loader can tell
    monkeypatch.setattr(checkpoint_integrity, "_expects_manifest", lambda _: False)  # nor the marker
    with pytest.raises(CheckpointError, match="missing in the checkpoint: .*mtp"):
        train(tmp_path / "load", "train.steps=1", "model.mtp_num_layers=1", f"train.load={ckpt}")


def test_resume_with_more_steps_replans_the_lr_schedule_and_says_so(run_copy: Path, train: Train) -> None:
    out = train(run_copy, "train.steps=6", "train.resume=auto")
    assert "train.steps changed 3 -> 6" in out
    rows = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    lr4 = next(r["lr"] for r in rows if r["step"] == 4)
    expected = 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * 4 / 6))  # cosine over 6 steps
    assert lr4 == pytest.approx(expected, rel=1e-6)
    # 8. metrics.jsonl holds every step once after the resume.
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


# 5. (conversion: tests/test_convert_safety.py) export reads the model config from the manifest.

def test_export_of_a_training_checkpoint_needs_no_model_flag(
        three_checkpoints: Path, tmp_path: Path, single_rank_parallel_state) -> None:
    pytest.importorskip("safetensors")
    from scripts.convert_checkpoint import export_hf

    ckpt = three_checkpoints / "checkpoints" / "iter_0000003"
    export_hf(ckpt, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 4
    assert json.loads((tmp_path / "hf" / "conversion.json").read_text())["source"] == str(ckpt.resolve())


# 6. Non-finite loss or gradients.

def test_nan_stops_at_that_step_without_saving_and_result_json_stays_json(train: Train, tmp_path: Path) -> None:
    from recipes.train.nonfinite import NonFiniteError

    run_dir = tmp_path / "nan"
    with pytest.raises(NonFiniteError, match="at step 2"):
        train(run_dir, "train.steps=4", "train.save_interval=1", "train.lr=1e30", "train.min_lr=0")
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000001"]
    assert (root / "latest").read_text() == "iter_0000001"
    result = json.loads((run_dir / "result.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert result["status"] == "failed" and "non-finite" in result["error"]


def test_nonfinite_skip_skips_updates_then_stops(train: Train, tmp_path: Path) -> None:
    from recipes.train.nonfinite import NonFiniteError

    with pytest.raises(NonFiniteError, match="at step 3"):
        train(tmp_path / "skip", "train.steps=4", "train.lr=1e30", "train.min_lr=0", "train.nonfinite_skip=1")
    assert "step 2: non-finite loss or gradients, update skipped" in train.out


def test_result_json_writes_null_for_nan(tmp_path: Path) -> None:
    from recipes.launch.result import RunResult

    RunResult("completed", None, ["train.steps=1"], float("nan"), 1).write(tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["final_loss"] is None
    assert RunResult.read(tmp_path) == RunResult("completed", None, ["train.steps=1"], None, 1)
    assert RunResult.read(tmp_path / "missing") is None


# 7. Preflight before the model is built.

def test_zero_ffn_size_fails_before_the_build_not_in_the_final_save(train: Train, tmp_path: Path,
                                                                    no_build: None) -> None:
    with pytest.raises(ConfigError, match="model.ffn_hidden_size=0"):
        train(tmp_path / "ffn", "train.steps=1", "model.ffn_hidden_size=0")
    assert not (tmp_path / "ffn" / "checkpoints").exists()


def test_unwritable_or_full_save_directory_fails_first(train: Train, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.plan import preflight

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="train.save=.*writable"):
        train(tmp_path / "ro", "train.steps=1", f"train.save={blocker / 'ckpt'}")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _: shutil_usage(total=10**12, used=10**12, free=1000))
    with pytest.raises(ConfigError, match="room for one checkpoint: ~0.0"):
        train(tmp_path / "full", "train.steps=1")


def test_checkpoint_size_estimate_matches_a_real_checkpoint(three_checkpoints: Path) -> None:
    from recipes.plan.preflight import checkpoint_bytes
    from recipes.config.typed import to_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=FAST))
    real = sum(p.stat().st_size for p in (three_checkpoints / "checkpoints" / "iter_0000003").rglob("*"))
    assert 0.8 < checkpoint_bytes(cfg) / real < 1.25


# 8. Sweeps, Ctrl-C, preemption exit status, no orphaned writer, no duplicate metrics.

def test_ctrl_c_checkpoints_exits_nonzero_and_resume_continues(train: Train, tmp_path: Path) -> None:
    run_dir = tmp_path / "ctrlc"

    def interrupt_after_first_step() -> None:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when launched in the background (nohup, &)
    threading.Thread(target=interrupt_after_first_step, daemon=True).start()
    with pytest.raises(SystemExit) as stop:
        train(run_dir, "train.steps=50")
    assert isinstance(stop.value.code, str) and "resume with" in stop.value.code.lower()
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "preempted"
    stopped = result["steps"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"iter_{stopped:07d}"
    train(run_dir, f"train.steps={stopped + 2}")
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))


def test_checkpoint_writer_runs_in_process(train: Train, tmp_path: Path) -> None:
    """After kill -9 nothing may stay behind: the writer starts no manager/resource-tracker process."""
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # earlier tests' helpers
    train(tmp_path / "w", "train.steps=1")
    assert isinstance(filesystem_async._results_queue, queue.Queue)
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


def test_sweep_jobs_get_their_own_save_directory(tmp_path: Path) -> None:
    """Jobs of a sweep with one train.save neither share, prune nor resume each other's
    checkpoints."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, read_write

    from recipes.checkpoint.resume import checkpoint_root

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"train.save={tmp_path / 'shared'}"],
                      return_hydra_config=True)
    job_dir = tmp_path / "sweep" / "model.dsa_indexer_kpool=2"
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    try:
        for mode in (RunMode.MULTIRUN, RunMode.RUN):
            with read_write(cfg.hydra):
                cfg.hydra.mode, cfg.hydra.sweep.dir = mode, str(tmp_path / "sweep")
            HydraConfig.instance().set_config(cfg)
            task.train.save = str(tmp_path / "shared")
            expected = tmp_path / "shared" / ("model.dsa_indexer_kpool=2" if mode == RunMode.MULTIRUN else "")
            assert checkpoint_root(task, job_dir) == expected
            task.train.save = "${oc.env:HOME}/ckpt"  # named per job by the user: kept as given
            assert checkpoint_root(task, job_dir) == Path(os.environ["HOME"]) / "ckpt"
    finally:
        HydraConfig.instance().cfg = None
