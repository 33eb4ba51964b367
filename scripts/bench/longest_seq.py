"""The longest sequence a model trains at on one GPU (context parallel size 1): ``train.py`` runs
of a few steps at growing ``data.seq_length`` (micro batch 1), each in its own process, until one
runs out of memory (or out of time).

    python scripts/bench/longest_seq.py --seqs 32768 65536 131072 [--preset full_recompute] \\
        --out runs/longest_seq.json [-- train.py overrides ...]

Default overrides: ``experiment=glm5_proxy_h200`` (bf16), ``train.steps=2``, global batch 1;
``--preset`` adds one of :data:`PRESETS` (the chunked loss, activation recompute) before the
overrides given after ``--``.
``model.max_position_embeddings`` is raised to the sequence length where it is smaller (rotary
tables only; the proxy's default is 32768). Per length the JSON holds the status (``trained``,
``oom``, ``timeout``, ``failed``), the last step's time, tokens/s and the peak memory of the run,
and the dry run's planned memory of the same config (``planned_gib``, ``recipes/plan/memory_plan.py``);
``scripts/bench/record_result.py`` adds it to ``docs/results/longest_seq_h200.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ["experiment=glm5_proxy_h200", "train.steps=2", "train.global_batch_size=1",
            "train.micro_batch_size=1", "train.lr_warmup_steps=0", "train.save_final=false",
            "train.save_interval=0", "logging.mode=disabled"]
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError")
_CHUNKED = ["train.loss_chunk_tokens=8192"]
PRESETS = {
    "whole": [],  # megatron's output layer and loss over the whole sequence, no recompute
    "chunked_loss": _CHUNKED,  # the logits in chunks of 8192 tokens (kpool_layers/chunked_loss.py)
    "selective_recompute": _CHUNKED + ["train.recompute_granularity=selective",
                                       "train.recompute_modules=[moe,mlp]"],
    "full_recompute": _CHUNKED + ["train.recompute_granularity=full", "train.recompute_method=uniform",
                                  "train.recompute_num_layers=1"],
}
"""Named override sets for the long-context keys (``recipes/config/recompute.py``)."""


def planned_gib(cmd: list[str], env: dict[str, str]) -> float | None:
    """The dry run's largest per-GPU total (GiB) of ``cmd`` (a ``train.py`` command line); None
    if the dry run fails."""
    proc = subprocess.run([*cmd, "train.dry_run=true"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    found = re.search(r"^largest: stage \d+, ([\d.]+) GiB", proc.stdout, re.MULTILINE)
    return float(found[1]) if proc.returncode == 0 and found else None


def run_length(seq: int, overrides: list[str], timeout: int, root: Path) -> dict:
    """One ``train.py`` run at ``seq`` tokens; its status and last step's figures, with the dry
    run's planned memory of the same command line."""
    run_id = f"seq{seq}"
    cmd = [sys.executable, str(ROOT / "train.py"), *DEFAULTS, f"data.seq_length={seq}",
           f"model.max_position_embeddings={max(seq, 32768)}", *overrides]
    env = dict(os.environ, KPOOL_RUN_ROOT=str(root), KPOOL_RUN_ID=run_id, WANDB_SILENT="true")
    planned = planned_gib(cmd, dict(env, KPOOL_RUN_ID=f"{run_id}_plan"))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"seq_length": seq, "status": "timeout", "timeout_s": timeout, "planned_gib": planned}
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        status = "oom" if any(m in out for m in OOM_MARKERS) else "failed"
        errors = [line for line in out.splitlines() if "Error" in line] or out.splitlines()[-1:]
        return {"seq_length": seq, "status": status, "error": errors[-1][:300], "planned_gib": planned}
    rows = [json.loads(x) for x in (root / run_id / "metrics.jsonl").read_text().splitlines() if x]
    last = [r for r in rows if "step_time_s" in r][-1]
    return {"seq_length": seq, "status": "trained", "steps": last["step"],
            "step_s": last["step_time_s"], "tokens_per_s": last["tokens_per_s"],
            "peak_mem_gib": max(r["peak_mem_gib"] for r in rows if "peak_mem_gib" in r),
            "loss": last["loss"], "planned_gib": planned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--timeout", type=int, default=240, help="seconds per length")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="whole",
                        help="long-context keys added before the overrides (PRESETS)")
    args, extra = parser.parse_known_args()
    overrides = PRESETS[args.preset] + [x for x in extra if x != "--"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in sorted(args.seqs):
            result = run_length(seq, overrides, args.timeout, Path(tmp))
            results.append(result)
            print(json.dumps(result), flush=True)
            if result["status"] != "trained":
                break
    trained = [r["seq_length"] for r in results if r["status"] == "trained"]
    summary = {"command": " ".join(["python scripts/bench/longest_seq.py", *sys.argv[1:]]),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "date": datetime.date.today().isoformat(),
               "preset": args.preset, "overrides": DEFAULTS + overrides, "longest_trained": max(trained, default=None),
               "runs": results}
    print(f"longest sequence trained: {summary['longest_trained']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
