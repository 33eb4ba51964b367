"""Per-step scalars: console line, ``metrics.jsonl`` in the run dir, and Weights & Biases.

Only the logging rank (global rank 0, which is on the last pipeline stage's data-parallel rank 0
after the loss is broadcast) writes and prints; every rank keeps the step lines in its log file. ``logging.mode=disabled`` creates no wandb files at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from recipes.config.schema import LoggingConfig, WandbMode
from recipes.launch.console import say

H200_BF16_TFLOPS = 756.0
"""Dense bf16 matmul rate measured on one H200, TFLOP/s: what ``mfu_matmul`` divides by on an H200
(``mfu`` divides by the GPU's spec dense bf16 peak, 989 for an H200: recipes/plan/peak_flops.py)."""


@dataclass(frozen=True)
class FlopModel:
    """Model FLOPs per token for a GLM-5.x decoder (forward + backward = 3x forward).

    forward per token = 2 * active parameters (all GEMMs)
      + per layer: 2 * heads * (qk_dim + v_latent) * keys attended   (absorbed sparse MLA)
      + per computing layer: 2 * index_heads * index_dim * keys scored   (lightning indexer)
      + per KDA layer: kda_heads * (6 D^2 + 10 C D)                      (chunked delta rule)
      + per mHC block: 2 * (N^2 h + N h)                 (stream mixing, 2 blocks per layer)
    with keys attended = min(topk, s/2) and keys scored = s/2 (causal average); ``num_layers``
    counts the DSA layers. The KDA term is the chunked (WY) delta rule with chunks of C = 64
    tokens and head size D per token and head: the intra-chunk ``k k^T`` and ``q k^T`` blocks
    (2 C D each), ``w = A (beta k)`` and ``u = A (beta v)`` (2 C D each), the inter-chunk
    ``u - w S``, ``S += k^T v_new`` and ``q S`` with the D x D state (2 D^2 each) and the
    intra-chunk output ``(q k^T) v_new`` (2 C D); the triangular inverse (C^2 / 3 per token) and
    the elementwise gates are not counted. Its projections are in ``active_params``. With mHC
    (``hc_streams`` N > 0, ``hc_blocks`` = 2 per decoder layer) each block mixes the streams,
    ``comb^T @ streams`` (N^2 h multiply-adds per token), and adds ``post (x) block output``
    (N h); the ``pre``-weighted block input (N h) and the Sinkhorn iterations on N x N are
    not counted; the mHC projection is in ``active_params``.
    """

    active_params: int
    num_layers: int
    heads: int
    qk_dim: int
    v_dim: int
    topk: int
    index_heads: int
    index_dim: int
    index_layers: int
    kda_layers: int = 0
    kda_heads: int = 0
    kda_head_dim: int = 0
    kda_chunk: int = 64
    hc_streams: int = 0
    hc_blocks: int = 0
    hidden_size: int = 0

    def per_token(self, seq_length: int) -> float:
        attended = min(self.topk, seq_length / 2)
        fwd = 2 * self.active_params
        d = self.kda_head_dim
        fwd += self.kda_layers * self.kda_heads * (6 * d * d + 10 * self.kda_chunk * d)
        fwd += 2 * self.num_layers * self.heads * (self.qk_dim + self.v_dim) * attended
        fwd += 2 * self.index_layers * self.index_heads * self.index_dim * (seq_length / 2)
        n = self.hc_streams
        fwd += 2 * self.hc_blocks * (n * n + n) * self.hidden_size
        return 3 * fwd


VAL_LOSS = "val/loss"
"""The validation loss's key (``train.eval_interval``, :mod:`recipes.train.evaluate`);
``val/ppl`` is its exponential."""

WANDB_SECTIONS = {
    "loss": "train", "grad_norm": "train", "lr": "train",
    "tokens_per_s": "throughput", "step_time_s": "throughput", "tflops_per_gpu": "throughput",
    "mfu": "throughput", "mfu_matmul": "throughput", "peak_mem_gib": "memory",
}
"""wandb panel section of each flat ``metrics.jsonl`` key; keys holding a ``/`` (``dsa/...``) keep
their name, other keys go under ``train/``."""


def wandb_key(key: str) -> str:
    """The wandb name of a ``metrics.jsonl`` key: ``loss`` -> ``train/loss``, ``tokens_per_s`` ->
    ``throughput/tokens_per_s``, ``peak_mem_gib`` -> ``memory/peak_mem_gib``, ``dsa/...`` as is."""
    return key if "/" in key else f"{WANDB_SECTIONS.get(key, 'train')}/{key}"


class MetricsLogger:
    """Writes step records; a no-op on non-logging ranks."""

    def __init__(self, run_dir: Path, logging_cfg: LoggingConfig, full_config: dict[str, Any],
                 enabled: bool, resume_step: int = 0, group: Optional[str] = None) -> None:
        """``resume_step``: the step the run continues from; records of later steps that an
        earlier, unfinished attempt logged are dropped from ``metrics.jsonl``. ``group``: the
        wandb group (the sweep's id for the jobs of a sweep)."""
        self.enabled = enabled
        self.run_dir = run_dir
        self._jsonl = None
        self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _truncate_after(run_dir / "metrics.jsonl", resume_step)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the run, closed by close()
        if logging_cfg.mode is not WandbMode.disabled:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                mode=logging_cfg.mode.value, project=logging_cfg.project, entity=logging_cfg.entity,
                name=logging_cfg.run_name or run_dir.name, dir=str(run_dir),
                tags=list(logging_cfg.tags), config=full_config, id=_wandb_id(run_dir),
                resume="allow", group=group,
            )

    def log(self, step: int, scalars: dict[str, float], console: Optional[str] = None) -> None:
        """``scalars`` of ``step`` to ``metrics.jsonl`` and wandb (the logging rank); ``console``
        (the step's line) printed by the logging rank and kept in every rank's log file
        (:func:`recipes.launch.console.say`)."""
        if self.enabled:
            self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
            if self._wandb is not None:
                self._wandb.log({wandb_key(k): v for k, v in scalars.items()}, step=step)
        if console:
            say(console, show=self.enabled)

    def update_config(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the wandb run config (e.g. the precision map)."""
        if self._wandb is not None:
            self._wandb.config.update(values, allow_val_change=True)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A wandb ``Table`` under ``key`` at ``step`` (wandb only; scalars go through :meth:`log`)."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def set_summary(self, key: str, value: Any) -> None:
        if self._wandb is not None:
            self._wandb.summary[key] = value

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step``; drops a line cut short by a kill."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
        except (ValueError, AttributeError):
            continue  # a line cut by the kill that interrupted the run
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)  # a kill during the trim leaves the old file whole


def _wandb_id(run_dir: Path) -> str:
    """A stable wandb id per run dir so a resumed run appends to the same wandb run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


_PROC_STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak measured by :func:`peak_memory_gib` afresh (each job of a sweep that runs in
    one process): the accelerator's peak allocation, and on Linux the process's peak RSS
    (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: the peak stays the process's lifetime peak


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory (GiB) since :func:`reset_peak_memory`; on CPU the
    process's peak RSS (``VmHWM`` on Linux, else ``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if _PROC_STATUS.is_file():
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
