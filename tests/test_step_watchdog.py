"""Collective hangs during training are bounded and named by the step (issue 34; the old bug: a
rank whose peer stalled waited in the collective for the process group's fixed 10 minutes, then
failed in gloo without saying which step)."""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import time

import pytest

from recipes.launch.step_watchdog import CollectiveTimeout, StepWatchdog
from tests.conftest import free_port

TIMEOUT_S = 3.0  # train.collective_timeout_s of the test: short, so the whole test takes seconds
WAIT = 60  # seconds the test waits for any message: a hang is a failure, not a stuck suite


def _rank(rank: int, port: int, out: "mp.Queue", release: "mp.Queue") -> None:
    """Steps 1..3, each one all_reduce; rank 1 stalls in step 2 until released."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=TIMEOUT_S))
    watchdog = StepWatchdog(TIMEOUT_S, rank, say=lambda m: out.put((rank, "said", m)))
    try:
        for step in (1, 2, 3):
            watchdog.begin(step)
            if rank == 1 and step == 2:
                release.get(timeout=WAIT)
                break
            dist.all_reduce(torch.ones(4))
            watchdog.end()
            out.put((rank, "done", step))
    except Exception as err:  # noqa: BLE001 - what the training loop does: check, then re-raise
        try:
            watchdog.check(err)
            out.put((rank, "raised", f"{type(err).__name__}: {err}"))
        except CollectiveTimeout as timeout:
            out.put((rank, "raised", f"CollectiveTimeout: {timeout}"))
    finally:
        watchdog.close()
        out.put((rank, "exit", None))


@pytest.mark.dist
def test_a_stalled_rank_ends_the_waiting_rank_in_bounded_time_naming_the_step() -> None:
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out, release)) for r in range(2)]
    for p in procs:
        p.start()
    events: list[tuple] = []
    try:
        said_by = set()
        started = None
        while not ({0, 1} <= said_by and any(e[:2] == (0, "raised") for e in events)):
            event = out.get(timeout=WAIT)
            events.append(event)
            if event[:3] == (0, "done", 1):
                started = time.monotonic()  # rank 0 enters step 2 right after
            if event[1] == "said":
                said_by.add(event[0])
        waited = time.monotonic() - started
    finally:
        release.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    message = "no progress in step 2 for 3 s (a collective is waiting for another rank)"
    said = [e for e in events if e[1] == "said"]
    assert sorted(said) == [(0, "said", f"rank 0: {message}"), (1, "said", f"rank 1: {message}")]  # once each
    raised = next(e[2] for e in events if e[:2] == (0, "raised"))
    assert raised.startswith(f"CollectiveTimeout: rank 0: {message}; raise train.collective_timeout_s"), raised
    assert (0, "done", 3) not in events and (1, "done", 1) in events
    # Bounded: the gloo timeout (3 s) plus process and queue latency, far below the old 600 s.
    assert TIMEOUT_S <= waited < 30, waited


def test_an_error_before_the_timeout_is_left_alone() -> None:
    said: list[str] = []
    watchdog = StepWatchdog(TIMEOUT_S, 0, say=said.append)
    try:
        watchdog.begin(1)
        watchdog.check(ValueError("a fast failure"))  # returns: the caller re-raises it unchanged
    finally:
        watchdog.close()
    assert said == []


def test_the_process_group_gets_train_collective_timeout_s(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from recipes.launch import distributed
    from tests.test_config import _compose

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = _compose(["train.collective_timeout_s=7.5"])
    distributed.init_process_group(distributed.Topology(0, 1, 0), cfg.train.collective_timeout_s)
    assert seen["timeout"] == dt.timedelta(seconds=7.5)
    assert _compose([]).train.collective_timeout_s == 600.0  # megatron's default: 10 minutes
