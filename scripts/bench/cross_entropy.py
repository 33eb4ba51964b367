"""Benchmark the language-model loss over glm5_proxy's logits: megatron's unfused
``vocab_parallel_cross_entropy``, megatron's native fused one (``fused_vocab_parallel_cross_entropy``,
torch.compile'd; what ``train.cross_entropy_fusion`` ran before) and ours
(``kpool_layers.loss``, two Triton kernels), side by side in one run.

Logits ``[s, b, V]`` = ``[4096, 1, 154880]`` (glm5_proxy: seq 4096, micro-batch 1) in bf16, random
labels, forward + backward (the logit gradient for a random per-token loss gradient). ``ms``:
``triton.testing.do_bench`` median of forward + backward, the logits re-made from a kept copy
outside the timed region (every loss may overwrite its input); ``peak_mib``: the most allocated
beyond the logits and labels during one forward + backward; ``max_loss_diff`` / ``max_grad_diff``:
largest absolute difference from the unfused loss's loss and logit gradient. Needs CUDA.

    python scripts/bench/cross_entropy.py [--seq 4096] [--vocab 154880] [--out ce.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from timing import init_single_rank  # noqa: E402 - sibling module (run as a script)


def losses() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The three losses, ``(logits [s, b, V], labels [s, b]) -> loss [s, b]``."""
    import torch.distributed as dist
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from kpool_layers.loss import vocab_parallel_cross_entropy as ours

    group = dist.group.WORLD
    return {
        "megatron_unfused": lambda x, y: vocab_parallel_cross_entropy(x, y, tp_group=group),
        "megatron_native_fused": lambda x, y: fused_vocab_parallel_cross_entropy(x, y, group),
        "ours_triton": lambda x, y: ours(x, y, group),
    }


def run(loss_fn: Callable[..., torch.Tensor], kept: torch.Tensor, labels: torch.Tensor,
        grad_loss: torch.Tensor) -> dict[str, Any]:
    import triton.testing

    logits = kept.clone().requires_grad_()

    def step() -> None:
        loss_fn(logits * 1, labels).backward(grad_loss)  # * 1: the loss may overwrite its input

    def fresh() -> None:
        logits.grad = None

    step()  # compile / warm up
    fresh()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = loss_fn(logits * 1, labels)
    loss.backward(grad_loss)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    result = {"loss": loss.detach().clone(), "grad": logits.grad.clone()}
    fresh()
    ms = float(triton.testing.do_bench(step, grad_to_none=[logits], return_mode="median"))
    return {"ms": ms, "peak_mib": peak, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=154880)
    parser.add_argument("--out")
    args = parser.parse_args()
    init_single_rank()
    g = torch.Generator(device="cuda").manual_seed(0)
    kept = (torch.randn(args.seq, 1, args.vocab, device="cuda", generator=g) * 3).bfloat16()
    labels = torch.randint(0, args.vocab, (args.seq, 1), device="cuda", generator=g)
    grad_loss = torch.rand(args.seq, 1, device="cuda", generator=g) / args.seq
    rows, ref = {}, None
    for name, fn in losses().items():
        r = run(fn, kept, labels, grad_loss)
        ref = ref or r
        rows[name] = {"ms": r["ms"], "peak_mib": r["peak_mib"],
                      "max_loss_diff": float((r["loss"] - ref["loss"]).abs().max()),
                      "max_grad_diff": float((r["grad"].float() - ref["grad"].float()).abs().max())}
        print(f"{name:24s} {r['ms']:8.3f} ms  peak {r['peak_mib']:9.1f} MiB  "
              f"loss diff {rows[name]['max_loss_diff']:.2e}  grad diff {rows[name]['max_grad_diff']:.2e}")
    if args.out:
        meta = {"seq": args.seq, "vocab": args.vocab, "dtype": "bf16", "device": torch.cuda.get_device_name(),
                "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({"meta": meta, "losses": rows}, indent=1))


if __name__ == "__main__":
    main()
