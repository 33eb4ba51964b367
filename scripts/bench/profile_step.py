"""Profile training steps of a composed config and print where the time goes.

    python scripts/bench/profile_step.py experiment=glm5_proxy_h200 [overrides...] [--steps 2] \
        [--out step.json] [--peak-tflops 756]

Builds the model exactly as ``train.py`` does (recipes.loop internals), runs one warm-up step, then
``--steps`` timed steps without the profiler (step time, tokens/s, model TFLOP/s from
:class:`recipes.observe.metrics.FlopModel`: sparse attention counts top-k keys per query, not s; peak
memory; MFU as ``mfu`` against ``--peak-tflops``, by default 756, the H200's measured dense bf16
matmul rate, i.e. the training log's ``mfu_matmul``, and as ``mfu_spec`` against the GPU's spec dense
bf16 peak from :mod:`recipes.plan.peak_flops`, i.e. the training log's ``mfu``, where the table knows
the GPU) and ``--steps`` profiled steps with ``torch.profiler`` (GPU kernels run per step and per
micro-batch, ``launches_*``; the host's calls that queue work, ``host_launches_*``: kernel, graph,
copy and memset launches, which differ once a CUDA graph replays the step; the top operators by
self device time, self CPU time on CPU). With ``train.cuda_graph_impl=full_iteration`` the warm-up
runs ``train.cuda_graph_warmup_steps`` eager steps and the capture. With
``--sync-sites`` one more step runs under CUDA's sync debug mode and the host synchronizations
are counted by call site (the innermost frames in this project and megatron). With
``--ops-by-module`` one more step runs under :class:`tests.op_counts.OwnOps`: the aten ops (each at
least one kernel; Triton kernels are not aten ops and are not in it) by the class of the module
whose own code ran them, forward and backward. ``--without NAME..`` builds without launch-saving
choices (``multi_tensor``: megatron's per-tensor grad-norm / clip; ``wgrad_fusion``: weight
gradients added by DDP's hook; ``fused_router``: megatron's routing; ``serving_quant_kernel``: the
serving index quantization as torch ops; ``local_dispatch``: megatron's allgather dispatch with its
host syncs; ``rope_kernel``: the rotary and its concatenations as torch ops) to measure them side
by side. ``--by-shape`` records the operators' input shapes in
the profiled steps and adds the top operators by (name, input shapes), which tells the GEMMs of one
linear from another's. ``device_ms_per_step`` sums the GPU time of every kernel, copy and memset.
``peak_gib`` is the peak allocated by tensors over the timed steps, which leaves out a CUDA
graph's private memory pool; ``peak_reserved_gib`` is the most the caching allocator held over
the timed steps (it keeps what the warm-up reserved), graph pools included.
``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import traceback
import warnings
from typing import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType

import recipes.config.megatron
import kpool_layers.compat.multi_tensor
from recipes.launch import distributed
from recipes.train.cuda_graph import capture_stream
from recipes.plan.dry_run import flop_model
from recipes.plan.peak_flops import spec_peak
from recipes.config.schema import Config, CudaGraphImpl
from timing import TrainerStep, compose_config  # sibling module (run as a script)


LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"}
"""Host API calls that each put work on a CUDA stream (a graph launch replays many kernels)."""


def _switch_off_multi_tensor() -> None:
    kpool_layers.compat.multi_tensor.install = lambda: False  # megatron's per-tensor grad-norm / clip loops


def _switch_off_wgrad_fusion() -> None:
    recipes.config.megatron._wgrad_fusion = lambda ddp: False  # weight grads through DDP's add


def _switch_off_fused_router() -> None:
    import kpool_layers.moe.router
    kpool_layers.moe.router.uncovered = lambda router: "profile_step --without fused_router"


def _switch_off_serving_quant_kernel() -> None:
    import kpool_layers.kernels.serving_quant_triton as kernel
    kernel.supports = lambda x: False  # fp8.serving_index_quant's torch ops


def _switch_off_local_dispatch() -> None:
    import kpool_layers.moe.layer
    kpool_layers.moe.layer.local_dispatch = lambda config, dispatcher: "profile_step --without"


def _switch_off_rope_kernel() -> None:
    from kpool_layers.mla.rope import ROPE
    ROPE.pin("torch")  # the rotary as torch ops, its concatenations as cats


WITHOUT: dict[str, Callable[[], None]] = {
    "multi_tensor": _switch_off_multi_tensor,
    "wgrad_fusion": _switch_off_wgrad_fusion,
    "fused_router": _switch_off_fused_router,
    "serving_quant_kernel": _switch_off_serving_quant_kernel,
    "local_dispatch": _switch_off_local_dispatch,
    "rope_kernel": _switch_off_rope_kernel,
}
"""Launch-saving build choices ``--without`` switches off, to measure each side by side with the
same command (the step without them)."""


def sync_sites(step: Callable[[], float], frames: int = 2) -> dict[str, int]:
    """Host synchronizations during one ``step`` by call site (``file:line`` of the innermost
    ``frames`` frames in kpool_layers/, recipes/ or megatron/), most frequent first."""
    counts: collections.Counter[str] = collections.Counter()

    def record(message: Warning | str, *_args: object, **_kwargs: object) -> None:
        if "synchroniz" not in str(message):  # other warnings raised during the step
            return
        ours = [f for f in traceback.extract_stack()
                if any(part in f.filename for part in ("kpool_layers", "recipes", "megatron"))]
        counts[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in ours[::-1][:frames])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(counts.most_common())


def ops_by_module(step: Callable[[], float], model: torch.nn.Module) -> dict[str, int]:
    """aten ops of one ``step`` by ``"<module class> fwd|bwd"`` (:class:`tests.op_counts.OwnOps`
    attributes each op to the innermost module whose own code ran it), most first."""
    from tests.op_counts import OwnOps

    modules = dict(model.named_modules())
    with OwnOps(model) as ops:
        step()
    counts: collections.Counter[str] = collections.Counter()
    for (name, phase), n in ops.counts.items():
        counts[f"{type(modules[name]).__name__ if name in modules else name} {phase}"] += n
    return dict(counts.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--sync-sites", action="store_true",
                        help="count host synchronizations of one more step by call site (CUDA)")
    parser.add_argument("--ops-by-module", action="store_true",
                        help="count the aten ops of one more step by module class")
    parser.add_argument("--by-shape", action="store_true",
                        help="record input shapes and list the top operators by (name, shapes)")
    parser.add_argument("--peak-tflops", type=float, default=756.0,
                        help="the GPU's dense bf16 rate for MFU (H200 measured: 756)")
    parser.add_argument("--without", nargs="+", default=[], choices=sorted(WITHOUT),
                        help="build without these launch-saving choices (the step before them)")
    args, overrides = parser.parse_known_args()
    for name in args.without:
        WITHOUT[name]()
    cfg = compose_config(overrides + ["logging.mode=disabled"])
    os.environ.setdefault("KPOOL_RUN_ID", "profile")
    distributed.init_process_group(distributed.launcher_topology())
    with capture_stream(cfg.train):  # a graphed run builds and steps on the capture stream
        profile(cfg, args, overrides)
    distributed.shutdown()


def profile(cfg: Config, args: argparse.Namespace, overrides: list[str]) -> None:
    """Build ``cfg``'s trainer, run the warm-up, timed and profiled steps, print and write the
    figures (module docstring)."""
    step = TrainerStep(cfg)
    trainer, device = step.trainer, step.device

    graphed = cfg.train.cuda_graph_impl is not CudaGraphImpl.none
    for _ in range(1 + (cfg.train.cuda_graph_warmup_steps if graphed else 0)):  # + the capture
        print(f"warm-up step {step():.2f} s")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    plain = [step() for _ in range(args.steps)]
    step_s = statistics.median(plain)
    tokens = cfg.train.global_batch_size * cfg.data.seq_length
    tflops = tokens * flop_model(cfg).per_token(cfg.data.seq_length) / step_s / 1e12
    spec = spec_peak(torch.cuda.get_device_name()) if device.type == "cuda" else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=args.by_shape) as prof:
        times = [step() for _ in range(args.steps)]
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    launches = len(device_events) / args.steps
    host_launches = sum(1 for e in prof.events() if e.name in LAUNCH_CALLS) / args.steps
    figures = {
        "step_s": step_s, "tokens_per_s": tokens / step_s, "model_tflops": tflops,
        "mfu": tflops / args.peak_tflops, "peak_tflops": args.peak_tflops,
        "mfu_spec": tflops / spec if spec else None, "spec_peak_tflops": spec,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
        "launches_per_step": launches,
        "launches_per_microbatch": launches / trainer.num_microbatches,
        "host_launches_per_step": host_launches,
        "host_launches_per_microbatch": host_launches / trainer.num_microbatches,
        "device_ms_per_step": sum(e.device_time_total for e in device_events) / 1e3 / args.steps,
        "profiled_steps_s": times, "overrides": overrides, "without": args.without,
    }
    if args.sync_sites and device.type == "cuda":
        figures["host_syncs_by_site"] = sync_sites(step)
        figures["host_syncs_per_step"] = sum(figures["host_syncs_by_site"].values())
        print(json.dumps(figures["host_syncs_by_site"], indent=1))
    if args.ops_by_module:
        figures["ops_by_module_per_step"] = ops_by_module(step, trainer.model)
        print(json.dumps(figures["ops_by_module_per_step"], indent=1))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    figures["top_ops"] = [
        {"name": e.key, "self_device_ms": e.self_device_time_total / 1e3 / args.steps,
         "count_per_step": e.count / args.steps}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:args.rows]]
    if args.by_shape:
        own = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        figures["top_ops_by_shape"] = [
            {"name": e.key, "input_shapes": str(e.input_shapes),
             "self_device_ms": e.self_device_time_total / 1e3 / args.steps, "count_per_step": e.count / args.steps}
            for e in sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.input_shapes),
                            key=lambda e: -getattr(e, own))[:args.rows]]
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=args.rows))
    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items() if isinstance(v, float)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=1))
    step.close()


if __name__ == "__main__":
    main()
