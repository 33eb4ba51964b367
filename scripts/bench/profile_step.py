"""Profile training steps of a composed config and print where the time goes.

    python scripts/bench/profile_step.py experiment=glm5_proxy_h200 [overrides...] [--steps 2]

Builds the model exactly as ``train.py`` does (recipes.loop internals), runs one warm-up step and
``--steps`` profiled steps with ``torch.profiler``, prints the top operators by self device time
(self CPU time on CPU) and the per-step wall time.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from recipes import data as data_lib
from recipes import distributed, loop
from recipes.distributed import register_resolvers
from recipes.schema import register_configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    args, overrides = parser.parse_known_args()
    register_resolvers()
    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=overrides + ["logging.mode=disabled"])
    os.environ.setdefault("KPOOL_RUN_ID", "profile")
    distributed.init_process_group(distributed.launcher_topology())
    trainer = loop._build(cfg)
    tokenizer = data_lib.build_tokenizer(cfg.data, cfg.model.vocab_size)
    batches = loop._batches(cfg, 0, tokenizer)
    eod_id = loop.packed_eod_id(cfg, tokenizer)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fwd_bwd = get_forward_backward_func()
    device = distributed.device()

    def step() -> float:
        start = time.perf_counter()
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        fwd_bwd(forward_step_func=partial(loop.forward_step, device, eod_id),
                data_iterator=batches,
                model=[trainer.model], num_microbatches=trainer.num_microbatches,
                seq_length=cfg.data.seq_length, micro_batch_size=cfg.train.micro_batch_size,
                forward_only=False)
        trainer.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    print(f"warm-up step {step():.2f} s")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        times = [step() for _ in range(args.steps)]
    print("profiled steps (s):", " ".join(f"{t:.2f}" for t in times))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    distributed.shutdown()


if __name__ == "__main__":
    main()
