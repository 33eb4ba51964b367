"""The dry run's memory plan beside the memory one training step takes: per decoder layer, the
logits and the step's peak, for any composed config (one process, one GPU or CPU).

    python scripts/bench/activation_memory.py experiment=glm5_proxy_h200 data.seq_length=32768 \\
        train.global_batch_size=1 [overrides...] [--out mem.json]

Builds the trainer as ``train.py`` does, runs one warm-up step (the optimizer state and gradient
buffers exist after it), then one measured step. Per decoder layer of this rank's stage it
reports, in bytes per token of the micro batch (``micro_batch_size * seq_length / CP``):

* ``saved``: the tensors autograd saves for backward while the layer's forward runs (each storage
  counted once, at its first save, parameters never; ``torch.autograd.graph.saved_tensors_hooks``),
  on any device;
* ``allocated``: on CUDA, how much ``torch.cuda.memory_allocated`` grows over the layer's forward
  (its saved tensors and its output, the next layer's input; tensors a custom autograd function
  keeps outside ``save_for_backward`` included);
* ``planned``: :func:`recipes.plan.memory_plan.layer_activation_bytes`, the plan's figure.

The rest of the forward (embedding, final norm, output layer and loss) is reported the same way
beside the plan's logits term. On CUDA the step's peak above what was allocated before it
(``max_memory_allocated`` minus the static weights, gradients and optimizer state) is set beside
the plan's activations, and the static part beside the plan's weights + grads + optimizer. The
plan is checked with one micro batch in flight (PP = 1); run with ``train.global_batch_size`` equal
to ``train.micro_batch_size`` times the data-parallel size.

On CUDA ``--peak-sites N`` records the allocations of both steps
(``torch.cuda.memory._record_memory_history``) and lists the ``N`` call sites holding the most
memory at the highest point (where a step ran out of memory, the last one before it; the
out-of-memory error is reported): the tensors allocated since the build and alive at that moment,
grouped by their innermost frame in this project or megatron-core (``file:line function``).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from recipes.launch import distributed
from recipes.plan import memory_plan
from timing import TrainerStep, compose_config  # sibling module (run as a script)

GIB = 2**30


class SavedBytes:
    """Bytes of the storages autograd saves, attributed to the decoder layer whose forward is
    running (``None``: outside every layer); each storage counted once, the parameters' storages
    (``model``'s, which the plan counts as weights) never."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_layer: dict[Optional[int], int] = {}
        self.current: Optional[int] = None
        self._seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen and storage.nbytes():
            self._seen.add(storage.data_ptr())
            self.by_layer[self.current] = self.by_layer.get(self.current, 0) + storage.nbytes()
        return tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            yield


def instrument(layers: torch.nn.ModuleList, saved: SavedBytes, cuda: bool) -> dict[int, int]:
    """Forward hooks on each layer: sets ``saved.current`` and records the growth of allocated
    memory over the layer's first forward (later calls, activation recompute during backward, are
    not recorded). Returns the growth per layer index (filled as the forward runs)."""
    growth: dict[int, int] = {}
    start: dict[int, int] = {}

    def pre(index: int, _module: torch.nn.Module, _args: Any) -> None:
        if index not in growth:
            saved.current = index
            start[index] = torch.cuda.memory_allocated() if cuda else 0

    def post(index: int, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if index not in growth and index in start:
            growth[index] = (torch.cuda.memory_allocated() if cuda else 0) - start[index]
            saved.current = None

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(partial(pre, i))
        layer.register_forward_hook(partial(post, i))
    return growth


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in this project or megatron-core, ``file:line function``."""
    for frame in frames:
        name = frame["filename"]
        if any(part in name for part in ("kpool_layers/", "recipes/", "megatron/", "scripts/")):
            return f"{'/'.join(Path(name).parts[-2:])}:{frame['line']} {frame['name']}"
    return "other"


def alive_at_peak(snapshot: dict[str, Any], rows: int) -> dict[str, float]:
    """GiB alive at the highest point of the recorded trace (``torch.cuda.memory._snapshot()``),
    of the blocks allocated while recording, by :func:`_site`; the ``rows`` largest."""
    events = [e for trace in snapshot["device_traces"] for e in trace
              if e["action"] in ("alloc", "free_completed")]
    live: dict[int, dict[str, Any]] = {}
    total = best = 0
    best_live: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    by_site: dict[str, float] = {}
    for event in best_live.values():
        site = _site(event.get("frames", []))
        by_site[site] = by_site.get(site, 0.0) + event["size"] / GIB
    return dict(sorted(by_site.items(), key=lambda kv: -kv[1])[:rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--peak-sites", type=int, default=0,
                        help="CUDA: list this many call sites by memory alive at the step's peak")
    args, overrides = parser.parse_known_args()
    cfg = compose_config(overrides + ["logging.mode=disabled"])
    os.environ.setdefault("KPOOL_RUN_ID", "activation_memory")
    distributed.init_process_group(distributed.launcher_topology())
    step = TrainerStep(cfg)
    trainer, cuda = step.trainer, step.device.type == "cuda"
    model = trainer.model
    inner = model
    while hasattr(inner, "module"):  # DDP, then Float16Module, around the GPTModel
        inner = inner.module

    sites = bool(args.peak_sites and cuda)
    if sites:  # from the warm-up on: a step that runs out of memory is analysed too
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    saved = SavedBytes(model)
    layers = inner.decoder.layers
    growth: dict[int, int] = {}
    static = peak = None
    oom = None
    try:
        step()  # warm-up: kernels compiled, gradient buffers and optimizer state allocated
        growth = instrument(layers, saved, cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            static = torch.cuda.memory_allocated()
        with saved.recording():
            step()
        peak = torch.cuda.max_memory_allocated() if cuda else None
    except torch.OutOfMemoryError as err:
        oom = str(err).splitlines()[0]
        traceback.print_exc()
    at_peak = alive_at_peak(torch.cuda.memory._snapshot(), args.peak_sites) if sites else None
    if sites:
        torch.cuda.memory._record_memory_history(enabled=None)

    stages = memory_plan.plan(cfg, inner)  # the whole model when PP = TP = 1
    stage = stages[0] if len(stages) == 1 else None
    tokens = cfg.train.micro_batch_size * cfg.data.seq_length // cfg.parallelism.context_parallel_size
    moe = [getattr(layer.mlp, "router", None) is not None for layer in layers]
    rows = []
    for i, layer in enumerate(layers):
        number = layer.layer_number
        rows.append({
            "layer": number, "attention": type(layer.self_attention).__name__, "moe": moe[i],
            "saved": saved.by_layer.get(i, 0) / tokens,
            "allocated": growth.get(i, 0) / tokens if cuda else None,
            "planned": memory_plan.layer_activation_bytes(cfg, number, moe[i])})
    figures: dict[str, Any] = {
        "overrides": overrides, "tokens": tokens, "layers": rows,
        "outside_layers_saved_gib": saved.by_layer.get(None, 0) / GIB,
        "planned_logits_gib": stage.logits if stage else None,
        "planned_activations_gib": stage.activations if stage else None,
        "planned_static_gib": (stage.weights + stage.grads + stage.optimizer) if stage else None,
        "planned_total_gib": stage.total if stage else None,
        "out_of_memory": oom,
        "measured_static_gib": static / GIB if peak is not None else None,
        "measured_activations_gib": (peak - static) / GIB if peak is not None else None,
        "measured_peak_gib": peak / GIB if peak is not None else None,
    }
    if at_peak is not None:
        figures["alive_at_peak_gib_by_site"] = at_peak
        for site, gib in at_peak.items():
            print(f"at peak {gib:8.3f} GiB  {site}")
    if peak is not None and stage:
        figures["peak_over_plan"] = figures["measured_peak_gib"] / stage.total
    for row in rows:
        print(f"layer {row['layer']:3d} {row['attention']:24s} moe={row['moe']!s:5s} "
              f"saved {row['saved']:10.0f} B/token  allocated "
              f"{row['allocated'] if row['allocated'] is not None else float('nan'):10.0f}  planned {row['planned']:10.0f}")
    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items() if isinstance(v, float)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=1))
    step.close()
    distributed.shutdown()


if __name__ == "__main__":
    main()
