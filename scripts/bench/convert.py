"""Conversion time and peak memory on a synthetic GLM-5-shaped HF checkpoint.

    python scripts/bench/convert.py --model glm5_proxy --dir /tmp/convert_bench [--out result.json]

Writes random bf16 tensors for every HF tensor of ``--model`` (names and shapes from the mapping,
one tensor in memory at a time), then runs ``import`` and ``export`` each in a fresh process and
reports wall time and peak RSS (``VmHWM``) of each against the checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def write_synthetic(model: str, directory: Path) -> int:
    """Random bf16 HF checkpoint for conf/model/<model>.yaml; returns its size in bytes."""
    import torch

    from recipes.hf.config import hf_config_from_model
    from recipes.hf.io import HFWriter
    from recipes.hf.mapping import build_mapping
    from scripts.convert_checkpoint import meta_sharded_state_dict, model_group

    cfg = model_group(model)
    _, shapes = meta_sharded_state_dict(cfg)
    writer = HFWriter(directory, shard_bytes=2**30)
    mapping = build_mapping(cfg)
    aliases_of: dict[str, list[str]] = {}
    for alias, target in mapping.aliases.items():
        aliases_of.setdefault(target, []).append(alias)
    for m in mapping.maps:
        meta = torch.empty(shapes[m.megatron], device="meta")
        for name, part in zip(m.hf, m.conversion.to_hf(meta), strict=True):
            tensor = (torch.randn(part.shape) * 0.02).to(torch.bfloat16)
            for out in [name, *aliases_of.get(name, [])]:
                writer.add(out, tensor)
    writer.finish()
    (directory / "config.json").write_text(json.dumps(hf_config_from_model(cfg, "bfloat16")))
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def run(args: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS (GiB) of ``convert_checkpoint.py args`` in a child process.

    The peak is the child's ``VmHWM`` (Linux): ``ru_maxrss`` would not do, as Linux keeps across
    ``exec`` the RSS the forked child inherited from this process (the synthetic writer's)."""
    script = str(ROOT / "scripts" / "convert_checkpoint.py")
    child = ("import re, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
             "print('PEAK_RSS_KIB', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # ours is taken by this process
    proc = subprocess.run([sys.executable, "-c", child, script, *args], check=True, cwd=ROOT,
                          capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    peak_kib = int(proc.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0])
    return {"seconds": round(seconds, 1), "peak_rss_gib": round(peak_kib / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="glm5_proxy")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/convert_bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    hf = args.dir / "hf"
    size = write_synthetic(args.model, hf)
    result = {"model": args.model, "hf_gib": round(size / 2**30, 2),
              "import": run(["import", "--hf", str(hf), "--out", str(args.dir / "ckpt")]),
              "export": run(["export", "--ckpt", str(args.dir / "ckpt"), "--hf-out", str(args.dir / "out")])}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
