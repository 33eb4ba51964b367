"""Benchmark the precision profiles: same model, data and seed, ``--steps`` training steps each
under ``bf16``, ``fp8`` and ``serving_match`` through ``train.py``.

Per profile: median step time (first ``--warmup`` steps and drift-measured steps left out) and its
ratio to bf16, first / final loss, top-k overlap (and exact rows, score error) against the
``serving`` reference averaged over layers and over the measured steps, and the drift overhead
(median measured-step time / median step time - 1) and that cost per step at the default interval
of 50 (column ``@50``; at interval I it is the measured-step overhead / I).
A profile whose run fails is reported with its error and the others still run; one stopped by
``--time-limit`` is summarised over the steps it finished (status ``partial``).

    python scripts/bench/precision.py --out runs/bench_precision.json                  # H200, glm5_proxy, torch backend
    python scripts/bench/precision.py --small --out /tmp/bench_precision.json          # tiny, CPU, emulate backend
    python scripts/bench/precision.py --profiles bf16 fp8 --gpus 0 1 --out ...          # two profiles at once
    python scripts/bench/precision.py --experiment glm5_width_h200 --profiles bf16 fp8 fp8_bf16_backward \
        --gpus 0 1 2 --out ...                     # GLM-5 width; fp8 with and without the FP8 backward

Prints a table and writes JSON to ``--out``; run dirs go to ``--runs`` (default: next to --out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from recipes.config.schema import DriftConfig

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ("bf16", "fp8", "serving_match")
VARIANTS = {"fp8_bf16_backward": ("fp8", ["precision.fp8_backward=bf16"])}
"""Runs ``--profiles`` also accepts beside the profiles: a profile with overrides (the fp8 profile
with its backward in BF16, straight-through, to compare the FP8 backward with)."""
DEFAULT_DRIFT_INTERVAL = DriftConfig().interval
"""The default ``precision.drift.interval``: the drift overhead is also reported per step at it."""


def _overrides(args: argparse.Namespace, profile: str) -> list[str]:
    profile, variant = VARIANTS.get(profile, (profile, []))
    common = [
        f"precision={profile}", *variant, f"train.steps={args.steps}", f"train.seed={args.seed}",
        f"precision.drift.interval={args.drift_interval}", "precision.drift.reference=serving",
        f"logging.mode={args.logging_mode}", "train.resume=none", "train.save_final=false",
        *args.override,
    ]
    if profile != "bf16":
        common.append(f"precision.backend={args.backend}")
    if args.small:
        return ["model=glm5_tiny", "model.dsa_indexer_head_dim=128", "data.seq_length=128",
                f"train.lr_warmup_steps={min(3, args.steps - 1)}", *common]
    return [f"experiment={args.experiment}", f"data.seq_length={args.seq_length}",
            f"train.lr_warmup_steps={min(5, args.steps - 1)}", *common]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(args: argparse.Namespace, profile: str, runs: Path, gpu: Optional[str] = None) -> dict[str, Any]:
    env = dict(os.environ, KPOOL_RUN_ROOT=str(runs), KPOOL_RUN_ID=f"precision_{profile}",
               WANDB_SILENT="true", MASTER_PORT=str(_free_port()))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    run_dir = runs / f"precision_{profile}"
    # each run its own dataset index cache: concurrent runs must not build the same files
    cmd = [sys.executable, str(ROOT / "train.py"), *_overrides(args, profile), f"data.cache_dir={run_dir}/data_cache"]
    metrics = run_dir / "metrics.jsonl"
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.time_limit)
    except subprocess.TimeoutExpired:
        if not metrics.exists() or not metrics.read_text().strip():
            return {"profile": profile, "status": "failed", "error": f"no step within {args.time_limit} s"}
        return {"profile": profile, "status": "partial", **summarise(metrics, args)}
    if proc.returncode != 0:
        return {"profile": profile, "status": "failed", "error": (proc.stderr or proc.stdout)[-2000:]}
    return {"profile": profile, "status": "completed", **summarise(metrics, args)}


def run_profiles(args: argparse.Namespace, runs: Path) -> list[dict[str, Any]]:
    """Every profile's result in ``args.profiles`` order. With ``--gpus`` the profiles are dealt
    round-robin to the GPUs; each GPU runs its share in turn, the GPUs at the same time."""
    if not args.gpus:
        return [_run(args, profile, runs) for profile in args.profiles]
    shares = {gpu: args.profiles[i::len(args.gpus)] for i, gpu in enumerate(args.gpus)}
    with concurrent.futures.ThreadPoolExecutor(len(args.gpus)) as pool:
        done = pool.map(lambda item: [_run(args, p, runs, item[0]) for p in item[1]], shares.items())
        by_profile = {r["profile"]: r for share in done for r in share}
    return [by_profile[p] for p in args.profiles]


def summarise(metrics_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Step time, losses and drift from a run's ``metrics.jsonl``."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    drift = [r for r in records if "dsa/topk_overlap" in r]
    measured = {r["step"] for r in drift}
    plain = [r["step_time_s"] for s, r in steps.items() if s > args.warmup and s not in measured]
    with_drift = [steps[s]["step_time_s"] for s in measured if s in steps and s > args.warmup]
    step_time = statistics.median(plain) if plain else float("nan")
    out: dict[str, Any] = {
        "step_time_s": step_time,
        "first_loss": steps[min(steps)]["loss"],
        "final_loss": steps[max(steps)]["loss"],
        "steps_done": max(steps),
        "losses": [steps[s]["loss"] for s in sorted(steps)],
        "drift_steps": sorted(measured),
        "overlap_by_step": [[r["step"], r["dsa/topk_overlap"]] for r in drift],
    }
    for key in ("topk_overlap", "topk_exact_rows", "score_rel_err", "boundary_tie_frac"):
        values = [r[f"dsa/{key}"] for r in drift]
        out[key] = statistics.fmean(values) if values else float("nan")
    out["drift_overhead"] = (statistics.median(with_drift) / step_time - 1) if with_drift else float("nan")
    out["drift_overhead_at_default_interval"] = out["drift_overhead"] / DEFAULT_DRIFT_INTERVAL
    return out


def table(results: list[dict[str, Any]]) -> str:
    base: Optional[float] = next((r["step_time_s"] for r in results
                                  if r["profile"] == "bf16" and r["status"] != "failed"), None)
    lines = [f"{'profile':<14} {'step s':>8} {'vs bf16':>8} {'loss 0':>8} {'loss N':>8} "
             f"{'overlap':>8} {'exact':>7} {'score err':>9} {'drift +':>8} {f'@{DEFAULT_DRIFT_INTERVAL}':>6}"]
    for r in results:
        if r["status"] == "failed":
            lines.append(f"{r['profile']:<14} FAILED: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        ratio = r["step_time_s"] / base if base else float("nan")
        lines.append(f"{r['profile']:<14} {r['step_time_s']:>8.3f} {ratio:>8.2f} {r['first_loss']:>8.4f} "
                     f"{r['final_loss']:>8.4f} {r['topk_overlap']:>8.4f} {r['topk_exact_rows']:>7.4f} "
                     f"{r['score_rel_err']:>9.2e} {r['drift_overhead']:>8.1%} "
                     f"{r['drift_overhead_at_default_interval']:>6.2%}"
                     + ("" if r["status"] == "completed" else f"  (stopped at step {r['steps_done']})"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--runs", type=Path, default=None, help="run dirs (default: <out dir>/precision_runs)")
    parser.add_argument("--small", action="store_true", help="glm5_tiny on CPU with the emulate backend")
    parser.add_argument("--steps", type=int, default=None, help="steps per profile (default 200; 6 with --small)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--experiment", default="glm5_proxy_h200",
                        help="the experiment preset of the runs without --small (default glm5_proxy_h200)")
    parser.add_argument("--drift-interval", type=int, default=None, help="default 50; 2 with --small")
    parser.add_argument("--backend", default=None, help="FP8 backend (default torch; emulate with --small)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 3; 1 with --small)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=[*PROFILES, *VARIANTS])
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per profile run; a run stopped by it is summarised over its finished steps")
    parser.add_argument("--logging-mode", default="disabled", choices=("disabled", "offline", "online"),
                        help="wandb mode of the runs (offline: scripts/drift_report.py can read them)")
    parser.add_argument("--gpus", nargs="+", default=None,
                        help="run the profiles concurrently, one GPU each (CUDA_VISIBLE_DEVICES ids)")
    parser.add_argument("--override", nargs="*", default=[], help="extra train.py overrides for every profile")
    args = parser.parse_args(argv)
    small = args.small
    args.steps = args.steps or (6 if small else 200)
    args.drift_interval = args.drift_interval or (2 if small else DEFAULT_DRIFT_INTERVAL)
    args.backend = args.backend or ("emulate" if small else "torch")
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 3)
    runs = args.runs or args.out.parent / "precision_runs"
    results = run_profiles(args, runs)
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "results": results, "table": text}, indent=1))
    return 0 if all(r["status"] == "completed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
