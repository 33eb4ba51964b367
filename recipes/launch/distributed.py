"""Process topology: ranks from torchrun or SLURM, the torch.distributed group, megatron's parallel
state, and the run id that makes every rank of one launch write into the same run directory."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kpool_layers.compat import cpu as _cpu
from recipes.launch.step_watchdog import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from recipes.config.schema import ParallelismConfig


@dataclass(frozen=True)
class Topology:
    """Where this process sits: global rank/world size and the local rank on its node."""

    rank: int
    world_size: int
    local_rank: int


def launcher_topology() -> Topology:
    """Rank and world size from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or from SLURM's srun
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) when torchrun's variables are absent; (0, 1, 0) alone."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Topology(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        return Topology(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return Topology(0, 1, 0)


def run_id() -> str:
    """An id that is identical on every rank of one launch and differs between launches.

    ``KPOOL_RUN_ID`` if set; a SLURM job (array task) id; else the torchrun agent's pid and start
    time (all ranks share that parent); else this process's start time and pid.
    """
    env = os.environ
    if env.get("KPOOL_RUN_ID"):
        return env["KPOOL_RUN_ID"]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    launcher = _launcher_process()
    stamp = _dt.datetime.fromtimestamp(launcher.create_time()).strftime("%Y-%m-%d_%H-%M-%S")
    return f"{stamp}_torchrun{launcher.pid}" if _under_torchrun() else f"{stamp}_{launcher.pid}"


def _under_torchrun() -> bool:
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def _launcher_process():  # noqa: ANN202 (psutil.Process)
    """The process that started this launch: the torchrun agent (shared by all ranks) or this one."""
    import psutil

    return psutil.Process(os.getppid()) if _under_torchrun() else psutil.Process()


def launch_start() -> float:
    """The start time (epoch seconds) of this launch, the same on every rank of a torchrun."""
    return _launcher_process().create_time()


def register_resolvers() -> None:
    """OmegaConf resolvers used by conf/config.yaml's ``hydra:`` section."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("kpool_run_id", run_id, replace=True)
    OmegaConf.register_new_resolver("kpool_rank", lambda: launcher_topology().rank, replace=True)
    OmegaConf.register_new_resolver(
        "kpool_output_subdir", lambda: ".hydra" if launcher_topology().rank == 0 else None, replace=True
    )


def device() -> torch.device:
    """This rank's device: its local GPU, or the CPU (with megatron's CUDA calls redirected)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(topo: Topology, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Start torch.distributed (NCCL on GPUs, gloo on CPU) and bind this rank to its GPU;
    ``timeout_s`` (``train.collective_timeout_s``) bounds every collective's wait for the others."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # One process needs no agreed port: a free one, so two runs on one host do not collide.
    os.environ.setdefault("MASTER_PORT", str(free_port()) if topo.world_size == 1 else "29500")
    if torch.cuda.is_available():
        torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        _cpu.install()
        backend = "gloo"
    try:
        dist.init_process_group(
            backend, rank=topo.rank, world_size=topo.world_size, timeout=_dt.timedelta(seconds=timeout_s)
        )
    except RuntimeError as err:  # torch's DistNetworkError / DistStoreError
        if "address already in use" not in str(err).lower():
            raise
        port = os.environ["MASTER_PORT"]
        raise RuntimeError(
            f"the rendezvous port {os.environ['MASTER_ADDR']}:{port} is in use (another run on "
            f"this host?): set MASTER_PORT to a free port, e.g. MASTER_PORT={free_port()} (torchrun: "
            "--master-port)") from err


def free_port() -> int:
    """A TCP port that is free on this host now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_model_parallel(parallelism: ParallelismConfig, seed: int, graph_safe_rng: bool = False) -> None:
    """megatron's parallel_state groups and the model-parallel RNG streams (``graph_safe_rng``:
    CUDA generators a captured step can register, for ``train.cuda_graph_impl``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallelism.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallelism.pipeline_model_parallel_size,
        context_parallel_size=parallelism.context_parallel_size,
        expert_model_parallel_size=parallelism.expert_model_parallel_size,
        expert_tensor_parallel_size=parallelism.expert_tensor_parallel_size,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe_rng)


def shutdown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
