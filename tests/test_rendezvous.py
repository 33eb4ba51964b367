"""Two runs on one host must not collide on the rendezvous port (torch's default 29500)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from recipes.launch import distributed
from recipes.launch.distributed import Topology


@pytest.fixture
def port_in_use() -> Iterator[int]:
    """29500 held as another run's rendezvous store holds it (or some port, if 29500 already is)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", 29500))
        except OSError:  # already taken by someone else: also fine
            sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_single_process_picks_a_free_port(monkeypatch: pytest.MonkeyPatch, port_in_use: int) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    distributed.init_process_group(Topology(0, 1, 0))
    try:
        assert os.environ["MASTER_PORT"] not in ("29500", str(port_in_use))
    finally:
        dist.destroy_process_group()


def test_port_in_use_names_master_port(monkeypatch: pytest.MonkeyPatch, port_in_use: int) -> None:
    monkeypatch.setenv("MASTER_PORT", str(port_in_use))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError, match=rf"127.0.0.1:{port_in_use} is in use .* set MASTER_PORT"):
        distributed.init_process_group(Topology(0, 1, 0))
