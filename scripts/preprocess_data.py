"""Tokenize a JSON-lines corpus into megatron's indexed dataset format (.bin/.idx).

    python scripts/preprocess_data.py --input data.jsonl --json-key text \\
        --tokenizer TOKENIZER_DIR_OR_JSON --output-prefix out/corpus [--append-eod] [--workers N]

writes ``out/corpus_text_document.bin`` and ``.idx`` (megatron-LM's naming; pass
``out/corpus_text_document`` in ``data.paths``) with megatron-core's ``IndexedDatasetBuilder``,
one document per input line. Documents that tokenize to nothing are skipped. Use
``--append-eod`` for pretraining: the EOD token separates packed documents (see
``recipes.train.data.packed_seq_params_from_eod``).

An input that is not a JSON-lines corpus (empty, binary, not UTF-8, a line that is not a JSON
object or lacks ``--json-key`` as a string) stops with ``FILE:LINE: what is wrong`` and exit status
1, and leaves no output files: both are written under temporary names and renamed at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from a checkout: this checkout's recipes
    sys.path.insert(0, str(ROOT))

from recipes.launch import console  # noqa: E402

console.quiet()  # before megatron-core: its notes about Transformer Engine, apex and absl

import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

from recipes.train.data import load_hf_tokenizer  # noqa: E402

_worker_tokenizer = None


class InputError(ValueError):
    """The input is not a JSON-lines corpus; the message starts with ``FILE:LINE:``."""


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_hf_tokenizer(tokenizer_path)


def _encode(args: tuple[str, bool]) -> list[int]:
    """Token ids of one document's text, with EOD appended if asked."""
    text, append_eod = args
    ids = _worker_tokenizer.tokenize(text)
    if ids and append_eod:
        ids.append(_worker_tokenizer.eod)
    return ids


def _texts(path: Path, key: str) -> Iterator[str]:
    """The ``key`` text of every non-blank line; :class:`InputError` names the first bad line."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    found = False
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            if b"\0" in raw:
                raise InputError(f"{where}: binary data (a NUL byte), not JSON-lines text")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict) or key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise InputError(f"{where}: no key {key!r} (found {keys}); pick the text field "
                                 "with --json-key")
            if not isinstance(record[key], str):
                raise InputError(f"{where}: {key!r} holds a {type(record[key]).__name__}, not text")
            found = True
            yield record[key]
    if not found:
        raise InputError(f"{path}: empty (no JSON lines)")


def _encoded(args: argparse.Namespace) -> Iterable[list[int]]:
    """Token ids per document, in input order, tokenized by ``args.workers`` processes."""
    jobs = ((text, args.append_eod) for text in _texts(args.input, args.json_key))
    if args.workers <= 1:
        _init_worker(args.tokenizer)
        yield from map(_encode, jobs)
        return
    with multiprocessing.Pool(args.workers, _init_worker, (args.tokenizer,)) as pool:
        yield from pool.imap(_encode, jobs, chunksize=64)


def preprocess(args: argparse.Namespace) -> dict[str, int]:
    """Writes ``{output_prefix}_{json_key}_document.{bin,idx}``; returns the counts. Raises
    :class:`InputError` (and writes nothing) for an input that is not a JSON-lines corpus, and for
    an output that exists unless ``--force`` (checked before anything is tokenized)."""
    prefix = f"{args.output_prefix}_{args.json_key}_document"
    existing = [f"{prefix}.{ext}" for ext in ("bin", "idx") if Path(f"{prefix}.{ext}").exists()]
    if existing and not args.force:
        raise InputError(f"{existing[0]} exists: this would replace that dataset; pass --force to "
                         "replace it, or choose another --output-prefix")
    vocab_size = load_hf_tokenizer(args.tokenizer).vocab_size
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.{os.getpid()}.tmp"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(vocab_size))
    counts = {"documents": 0, "skipped_empty": 0, "tokens": 0}
    try:
        for ids in _encoded(args):
            if not ids:
                counts["skipped_empty"] += 1
                continue
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            counts["documents"] += 1
            counts["tokens"] += len(ids)
        if not counts["documents"]:
            raise InputError(f"{args.input}: no document tokenizes to any token")
        builder.finalize(f"{tmp}.idx")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    finally:
        builder.data_file.close()
        for ext in ("bin", "idx"):
            Path(f"{tmp}.{ext}").unlink(missing_ok=True)
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, required=True, help="JSON-lines file")
    parser.add_argument("--json-key", default="text", help="field holding the document text")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer dir or tokenizer.json")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.*")
    parser.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (>= 1)")
    parser.add_argument("--force", action="store_true", help="replace an existing PREFIX_KEY_document.*")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: allowed: an integer >= 1 (tokenizer processes)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        counts = preprocess(args)
    except InputError as err:
        sys.exit(f"error: {err}")
    elapsed = time.perf_counter() - start
    print(
        f"{args.output_prefix}_{args.json_key}_document: {counts['documents']} documents, "
        f"{counts['tokens']} tokens, {counts['skipped_empty']} empty skipped, {elapsed:.1f}s"
    )


if __name__ == "__main__":
    main()
