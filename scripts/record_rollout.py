"""Write rollout records (docs/replay.md) from our own model or a transformers GLM-5.x model, for
tests and for users without a serving engine at hand.

    python scripts/record_rollout.py --out rollouts/ [--num-samples 8] [--min-length 16]
        [--max-length 64] [--prompt-length 4] [--seed 0] [OVERRIDE ...]
    python scripts/record_rollout.py --hf HF_DIR --out rollouts/ [sample flags]

``OVERRIDE``: train.py's Hydra overrides for the model, precision and weights (``model=glm5_tiny
precision=fp32 data.seq_length=128 train.load=CKPT``). The samples are random token sequences
(lengths uniform in ``[min, max]``, ids below the vocabulary's last id); the loss mask covers the
tokens after the first ``--prompt-length``. The model is built as ``train.py`` builds it (same
seed, or ``train.load``'s weights) and runs the rows ``data=rollout`` packs from these records,
so a run of ``train.py data=rollout data.rollout_dir=OUT`` with the same overrides starts from
the recorded model.

``--hf HF_DIR``: the records come from the transformers ``glm_moe_dsa`` / ``glm5_next`` / ``glm5_next_text`` model in
``HF_DIR`` (float32, each sample alone), its indexers' top-k and routers' experts captured with
forward hooks (:mod:`recipes.replay.hf_recorder`, which documents the index mapping); no overrides.
Train on them with the import of the same checkpoint (``scripts/convert_checkpoint.py import``,
``train.load``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from kpool_layers.compat import cpu as _cpu  # noqa: E402
from recipes.launch import distributed  # noqa: E402
from recipes.replay.hf_recorder import load_hf_model, record_hf_rollouts, text_config  # noqa: E402
from recipes.replay.recorder import build_recording_model, record_rollouts  # noqa: E402
from recipes.config.schema import register_configs  # noqa: E402
from recipes.config.typed import to_config  # noqa: E402


def _samples(args: argparse.Namespace, vocab_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(args.seed)
    tokens, masks = [], []
    for _ in range(args.num_samples):
        n = int(torch.randint(args.min_length, args.max_length + 1, (), generator=gen))
        tokens.append(torch.randint(0, vocab_size - 1, (n,), generator=gen))
        masks.append(torch.arange(n) >= max(args.prompt_length, 1))
    return tokens, masks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf", type=Path, default=None,
                        help="record from this transformers glm_moe_dsa / glm5_next / glm5_next_text checkpoint directory")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if not 2 <= args.min_length <= args.max_length:
        parser.error("--min-length must be >= 2 and <= --max-length")
    if args.hf is not None:
        if args.overrides:
            parser.error(f"--hf takes no overrides (the model is the checkpoint's), got {args.overrides}")
        try:
            model = load_hf_model(args.hf)
        except (OSError, ValueError) as err:
            parser.error(str(err))
        tokens, masks = _samples(args, text_config(model).vocab_size)
        files = record_hf_rollouts(model, tokens, args.out, masks)
        print(f"wrote {len(files)} rollout records to {args.out}")
        return
    _cpu.install()
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["logging=none", *args.overrides]))
    if args.max_length > cfg.data.seq_length:
        parser.error(f"--max-length {args.max_length} > data.seq_length {cfg.data.seq_length}")
    distributed.init_process_group(distributed.launcher_topology())
    try:
        model = build_recording_model(cfg)
        tokens, masks = _samples(args, cfg.model.vocab_size)
        files = record_rollouts(cfg, model, tokens, args.out, masks)
    finally:
        dist.destroy_process_group()
    print(f"wrote {len(files)} rollout records to {args.out}")


if __name__ == "__main__":
    main()
