"""Ranks agree before they work (issue 34): ranks with different configs stop together, naming
every differing key, instead of hanging in a collective or dying in gloo."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from recipes.launch.rank_agreement import differing_keys
from tests.conftest import free_port
from tests.train_runner import run_train

TIMEOUT = 120  # seconds for a whole test: a hang shows up as a failure, not a stuck suite


def _rank(rank: int, port: int, config: dict, timeout_s: float, out: "mp.Queue") -> None:
    import torch.distributed as dist

    from recipes.launch.rank_agreement import check_ranks_agree

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        check_ranks_agree(config, timeout_s=timeout_s)
        out.put((rank, "ok"))
    except RuntimeError as err:
        out.put((rank, str(err)))
    finally:
        dist.destroy_process_group()


def _two_ranks(configs: list[dict], timeout_s: float = 60.0) -> dict[int, str]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, configs[r], timeout_s, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=TIMEOUT) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.dist
def test_same_config_passes_and_different_configs_stop_every_rank_naming_the_keys() -> None:
    same = {"train": {"steps": 5, "lr": 0.003}, "model": {"num_layers": 2}}
    assert _two_ranks([same, same]) == {0: "ok", 1: "ok"}
    other = {"train": {"steps": 3, "lr": 0.003}, "model": {"num_layers": 2}, "extra": {"k": 1}}
    results = _two_ranks([same, other])
    for rank in (0, 1):
        assert "composed different configs" in results[rank]
        assert "train.steps: rank 0=5, rank 1=3" in results[rank]
        assert "extra.k: rank 0='<missing>', rank 1=1" in results[rank]
        assert "train.lr" not in results[rank] and "model.num_layers" not in results[rank]


def test_differing_keys_lists_only_keys_that_differ() -> None:
    flats = [{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 2, "c": None}]
    assert differing_keys(flats) == {"b": [2, 3, 2], "c": ["<missing>", "<missing>", None]}


@pytest.mark.dist
def test_torchrun_ranks_with_different_configs_stop_before_training(tmp_path: Path) -> None:
    """The old bug: ranks with different configs (``train.steps`` 5 and 3) hung in a collective
    one of them never reached. Here each rank's ``train.seed`` and ``logging.run_name`` come from
    its ``RANK``."""
    proc = run_train(tmp_path, "mismatch", [
        "model=glm5_tiny", "precision=fp32", "data.seq_length=32", "logging.mode=disabled",
        "train.lr_warmup_steps=0", "train.micro_batch_size=1", "train.global_batch_size=2",
        "train.steps=3", "precision.drift.interval=0", "train.seed=${oc.env:RANK}",
        "logging.run_name=r${oc.env:RANK}"], nproc=2, check=False, timeout=TIMEOUT * 3)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "2 differing key(s)" in out, out[-4000:]
    assert "train.seed: rank 0=0, rank 1=1" in out
    assert "logging.run_name: rank 0='r0', rank 1='r1'" in out
    assert "step     1/" not in out  # stopped before the first step


def _silent_rank(rank: int, port: int, out: "mp.Queue") -> None:
    """A rank that joins the process group and never reaches the comparison."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out.get(timeout=TIMEOUT)  # until the other rank has given up


@pytest.mark.dist
def test_a_rank_that_never_arrives_is_a_bounded_error_not_a_hang() -> None:
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), ctx.Queue()
    port = free_port()
    waiting = ctx.Process(target=_rank, args=(0, port, {"x": 1}, 3.0, out))
    silent = ctx.Process(target=_silent_rank, args=(1, port, release))
    waiting.start()
    silent.start()
    try:
        rank, message = out.get(timeout=TIMEOUT)
        assert rank == 0 and "not every rank reached the config comparison within 3 s" in message
    finally:
        release.put(None)
        for p in (waiting, silent):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
