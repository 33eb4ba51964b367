"""Build a small real-text training corpus for benchmarks that need a loss curve to mean
something (megatron's mock data is learnt to ~0.1 in a few steps): Python source files, a
byte-level BPE tokenizer trained on them, and the indexed dataset.

    python scripts/bench/code_corpus.py --out .bench_data --mbytes 8
    python train.py data=indexed data.paths=[.bench_data/corpus_text_document] \\
        data.tokenizer=.bench_data/tokenizer.json ...

Source: the ``.py`` files under ``--source`` (default: the running interpreter's standard library),
sorted by path and concatenated until ``--mbytes`` MB, one document per file; the same
interpreter gives the same corpus. Writes ``OUT/corpus.jsonl``, ``OUT/tokenizer.json``
(``<|endoftext|>`` is the EOD token) and ``OUT/corpus_text_document.{bin,idx}`` through
``scripts/preprocess_data.py``; preprocess_data.py prints the token count. Needs the ``data`` extra (``tokenizers``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[2]
EOD = "<|endoftext|>"


def collect(source: Path, max_bytes: int) -> list[str]:
    """Texts of the ``.py`` files under ``source`` (sorted paths, test suites skipped) up to
    ``max_bytes`` UTF-8 bytes in total."""
    texts, total = [], 0
    for path in sorted(source.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        texts.append(text)
        total += len(text.encode())
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--mbytes", type=float, default=8.0, help="corpus size in MB of source text")
    parser.add_argument("--vocab-size", type=int, default=32768)
    args = parser.parse_args(argv)
    texts = collect(args.source, int(args.mbytes * 1e6))
    if not texts:
        parser.error(f"--source {args.source} has no readable .py files")
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, args.vocab_size).save(str(args.out / "tokenizer.json"))
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), "--input", str(corpus),
         "--json-key", "text", "--tokenizer", str(args.out / "tokenizer.json"),
         "--output-prefix", str(args.out / "corpus"), "--append-eod"],
        check=True,
    )
    print(f"{len(texts)} files, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB of source text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
