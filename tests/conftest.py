"""Test setup: the CPU shim for megatron-core (no-op on GPUs) and single-process model parallel
state for layer tests."""

from __future__ import annotations

import os

import pytest
import torch

from kpool_layers.compat import cpu as _cpu
from recipes.launch.distributed import free_port  # noqa: F401 - tests import it from here

_cpu.install()


@pytest.fixture
def single_rank_parallel_state(monkeypatch: pytest.MonkeyPatch):
    """A one-process gloo (or NCCL) group with megatron's parallel state at TP=PP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not dist.is_initialized()
    if created:
        monkeypatch.setenv("MASTER_ADDR", os.environ.get("MASTER_ADDR", "127.0.0.1"))
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1
        )
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=torch.cuda.is_available())
    yield ps
    ps.destroy_model_parallel()
    if created:  # later tests see a process without a default group, as a user would
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _reset_moe_aux_loss_scale():
    """megatron's MoE aux-loss scale is a class global: a backward outside its schedules leaves a
    0-dim tensor there that the schedules' ``copy_`` of a [1] scale then rejects. Every test starts
    and ends without one, as a fresh process does."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.fixture(autouse=True)
def _restore_environ():
    """Every test ends with the environment it started with: code under test sets variables
    (``KPOOL_RUN_ID`` when a run is selected, ``MASTER_ADDR``/``MASTER_PORT`` at process-group
    start) and a later test's subprocess (e.g. an sbatch job, which exports its environment) must
    not inherit them; ``monkeypatch.delenv`` of an absent key records nothing to undo."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)
