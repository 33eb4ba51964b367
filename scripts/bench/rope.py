"""Benchmark the rotary position embedding as glm5_proxy's layers run it: the ``rope`` route's
Triton kernel against the torch ops, forward + backward, side by side in one run.

Cases (bf16 on the GPU, fp32 torch ops on the CPU):

    mla_concat  MLA's query and key: ``cat(latent, rotated pe)`` for 16 query heads (the latent
                laid out as the absorbed einsum leaves it, pe a view of the query projection) and
                the key head
    indexer     the indexer's q and keys as one ``[s, 1, 33, 128]`` tensor, the first 64 channels
                rotated, the others passed through

Each entry is the median of ``--repeats`` forward + backward passes after one warm-up, with the
GB/s of the bytes the kernel must move (each input read once, each output written once, forward
and backward). ``--sweep`` also times the kernel for each of a few (rows per program, rest channels
per step, warps) choices and reports the fastest over both cases.

    cd scripts/bench && python rope.py --out runs/rope.json [--sweep]     # GPU
    python scripts/bench/rope.py --small                                   # tiny, CPU (torch)
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any, Callable

import torch

from timing import measure  # sibling module (run as a script)
from kpool_layers.mla.rope import ROPE, Rotary

SWEEP = list(itertools.product((16, 32, 64), (128, 512), (4, 8)))
"""``(BLOCK_R, BLOCK_C, NUM_WARPS)`` choices ``--sweep`` times."""


def cases(s: int, device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Callable[[], Any], int]]:
    """Each case's forward + backward step and the bytes it moves."""
    rotary = Rotary(dim=64, base=1e6, yarn=False)
    size = dtype.itemsize
    # the latent as the absorbed einsum leaves it: heads outermost in memory
    latent = torch.randn(16, s, 1, 512, device=device, dtype=dtype, requires_grad=True)
    q = torch.randn(s, 1, 16, 192, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(s, 1, 576, device=device, dtype=dtype, requires_grad=True)
    qk = torch.randn(s, 1, 33, 128, device=device, dtype=dtype, requires_grad=True)

    def mla_concat() -> None:
        rotate = rotary.bind_arange(s, device, mla_interleaved=True)
        q_pe = q.split([128, 64], dim=-1)[1]
        kv_latent, k_pe = kv.split([512, 64], dim=-1)
        query, key = rotate.concat((latent.permute(1, 2, 0, 3), kv_latent.unsqueeze(2)),
                                   (q_pe, k_pe.unsqueeze(2)))
        (query.float().sum() + key.float().sum()).backward()

    def indexer() -> None:
        rotate = rotary.bind_arange(s, device, mla_interleaved=True)
        rotate(qk).float().sum().backward()

    # forward: read latent + pe, write the concatenation; backward: read the pe's gradient, write it
    mla_bytes = size * s * (17 * 576 * 2 + 17 * 64 * 2)
    indexer_bytes = size * s * 33 * 128 * 4
    return {"mla_concat": (mla_concat, mla_bytes), "indexer": (indexer, indexer_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch choices too")
    parser.add_argument("--small", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = 16 if args.small else args.seq
    rows: list[dict[str, Any]] = []
    backends = ["torch", "triton"] if cuda else ["torch"]
    for name, (step, nbytes) in cases(s, device, dtype).items():
        for backend in backends:
            ROPE.pin(backend)
            got = measure(step, args.repeats, cuda)
            rows.append({"case": name, "backend": backend, "ms": got["ms"],
                         "gb_per_s": nbytes / got["ms"] / 1e6, "peak_mib": got["peak_mib"]})
            print(json.dumps(rows[-1]), flush=True)
    sweep: list[dict[str, Any]] = []
    if args.sweep and cuda:
        from kpool_layers.kernels import rope_triton
        chosen = (rope_triton.BLOCK_R, rope_triton.BLOCK_C, rope_triton.NUM_WARPS)
        ROPE.pin("triton")
        for block_r, block_c, warps in SWEEP:
            rope_triton.BLOCK_R, rope_triton.BLOCK_C, rope_triton.NUM_WARPS = block_r, block_c, warps
            ms = {name: measure(step, args.repeats, cuda)["ms"] for name, (step, _) in cases(s, device, dtype).items()}
            sweep.append({"block_r": block_r, "block_c": block_c, "num_warps": warps, **ms, "total_ms": sum(ms.values())})
            print(json.dumps(sweep[-1]), flush=True)
        rope_triton.BLOCK_R, rope_triton.BLOCK_C, rope_triton.NUM_WARPS = chosen
        best = min(sweep, key=lambda r: r["total_ms"])
        print(f"fastest: BLOCK_R={best['block_r']} BLOCK_C={best['block_c']} NUM_WARPS={best['num_warps']} "
              f"({best['total_ms']:.3f} ms; committed {chosen})")
    ROPE.pin(None)
    print("| case | backend | ms | GB/s |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['case']} | {row['backend']} | {row['ms']:.3f} | {row['gb_per_s']:.0f} |")
    if args.out:
        device_name = torch.cuda.get_device_name() if cuda else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "seq": s, "rows": rows, "sweep": sweep}, f,
                      indent=1)


if __name__ == "__main__":
    main()
