"""Tokenize a JSON-lines corpus into megatron's indexed dataset format (.bin/.idx).

    python scripts/preprocess_data.py --input data.jsonl --json-key text \\
        --tokenizer TOKENIZER_DIR_OR_JSON --output-prefix out/corpus [--append-eod] [--workers N]

writes ``out/corpus_text_document.bin`` and ``.idx`` (megatron-LM's naming; pass
``out/corpus_text_document`` in ``data.paths``) with megatron-core's ``IndexedDatasetBuilder``,
one document per input line. Documents that tokenize to nothing are skipped. Use
``--append-eod`` for pretraining: the EOD token separates packed documents (see
``recipes.data.packed_seq_params_from_eod``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from recipes.data import load_hf_tokenizer

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_hf_tokenizer(tokenizer_path)


def _encode(args: tuple[str, str, bool]) -> list[int]:
    """Token ids of one JSON line's ``key`` field, with EOD appended if asked."""
    line, key, append_eod = args
    ids = _worker_tokenizer.tokenize(json.loads(line)[key])
    if ids and append_eod:
        ids.append(_worker_tokenizer.eod)
    return ids


def _lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        yield from (line for line in f if line.strip())


def _encoded(args: argparse.Namespace) -> Iterable[list[int]]:
    """Token ids per document, in input order, tokenized by ``args.workers`` processes."""
    jobs = ((line, args.json_key, args.append_eod) for line in _lines(args.input))
    if args.workers <= 1:
        _init_worker(args.tokenizer)
        yield from map(_encode, jobs)
        return
    with multiprocessing.Pool(args.workers, _init_worker, (args.tokenizer,)) as pool:
        yield from pool.imap(_encode, jobs, chunksize=64)


def preprocess(args: argparse.Namespace) -> dict[str, int]:
    """Writes ``{output_prefix}_{json_key}_document.{bin,idx}``; returns the counts."""
    vocab_size = load_hf_tokenizer(args.tokenizer).vocab_size
    prefix = f"{args.output_prefix}_{args.json_key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab_size))
    counts = {"documents": 0, "skipped_empty": 0, "tokens": 0}
    for ids in _encoded(args):
        if not ids:
            counts["skipped_empty"] += 1
            continue
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        counts["documents"] += 1
        counts["tokens"] += len(ids)
    builder.finalize(f"{prefix}.idx")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, required=True, help="JSON-lines file")
    parser.add_argument("--json-key", default="text", help="field holding the document text")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer dir or tokenizer.json")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.*")
    parser.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    counts = preprocess(args)
    elapsed = time.perf_counter() - start
    print(
        f"{args.output_prefix}_{args.json_key}_document: {counts['documents']} documents, "
        f"{counts['tokens']} tokens, {counts['skipped_empty']} empty skipped, {elapsed:.1f}s"
    )


if __name__ == "__main__":
    main()
