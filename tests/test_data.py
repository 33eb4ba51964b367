"""recipes.train.data and scripts/preprocess_data.py on tiny local data (no network, CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from recipes.train.data import (
    ResumableBatchIterator,
    build_tokenizer,
    build_dataset,
    ensure_dataset_helpers,
    load_hf_tokenizer,
    packed_seq_params_from_eod,
)
from recipes.train.data_checks import check_indexed_data
from recipes.config.schema import ConfigError, DataConfig, DataKind

ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
ALPHA = [f"alpha document {i}: the quick brown fox jumps {i} times over the dog." for i in range(40)]
BETA = [f"beta record {i} says hello world, number {i * 7}!" for i in range(40)]


def _load_script():
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "scripts/preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> SimpleNamespace:
    """A byte-level BPE tokenizer trained on the corpus, and both corpora preprocessed."""
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(ALPHA + BETA, trainer)
    tok_dir = root / "tok"
    tok_dir.mkdir()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    script = _load_script()
    prefixes = {}
    for name, lines in (("alpha", ALPHA), ("beta", BETA)):
        jsonl = root / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines + [""]))
        script.main(["--input", str(jsonl), "--tokenizer", str(tok_dir), "--append-eod",
                     "--output-prefix", str(root / "out" / name)])
        prefixes[name] = str(root / "out" / f"{name}_text_document")
    return SimpleNamespace(root=root, tok_dir=tok_dir, prefixes=prefixes)


@pytest.fixture(scope="module")
def mock_dataset():
    cfg = DataConfig()
    return build_dataset(cfg, Split.train, tokenizer=build_tokenizer(cfg, 128), seq_length=16,
                               num_samples=64, seed=7)


class _Echo(torch.utils.data.Dataset):
    """Sample i is the tensor [i] (to see which samples a rank gets)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.tensor([i])}


def test_mock_dataset_shapes_and_seed_determinism(mock_dataset):
    it = ResumableBatchIterator(mock_dataset, micro_batch_size=4, dp_rank=0, dp_size=1)
    batch = next(it)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key in batch:
        assert batch[key].shape == (4, 16)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["tokens"].max()) < 128
    cfg = DataConfig()
    tok = build_tokenizer(cfg, 128)
    assert tok.eod == 127
    again = build_dataset(cfg, Split.train, tokenizer=tok, seq_length=16, num_samples=64, seed=7)
    other = build_dataset(cfg, Split.train, tokenizer=tok, seq_length=16, num_samples=64, seed=8)
    first = torch.stack([mock_dataset[i]["tokens"] for i in range(8)])
    assert torch.equal(first, torch.stack([again[i]["tokens"] for i in range(8)]))
    assert not torch.equal(first, torch.stack([other[i]["tokens"] for i in range(8)]))


def test_iterator_resumes_exactly(mock_dataset):
    it = ResumableBatchIterator(mock_dataset, micro_batch_size=2, dp_rank=1, dp_size=2)
    for _ in range(3):
        next(it)
    assert it.consumed_samples == 12
    expected = next(it)
    resumed = ResumableBatchIterator(mock_dataset, micro_batch_size=2, dp_rank=1, dp_size=2,
                                     consumed_samples=12)
    got = next(resumed)
    assert resumed.consumed_samples == 16
    for key in expected:
        assert torch.equal(expected[key], got[key])


def test_iterator_with_workers_matches_inline(mock_dataset):
    inline = ResumableBatchIterator(mock_dataset, micro_batch_size=2, dp_rank=0, dp_size=1)
    workers = ResumableBatchIterator(mock_dataset, micro_batch_size=2, dp_rank=0, dp_size=1,
                                     num_workers=1)
    for _ in range(2):
        assert torch.equal(next(inline)["tokens"], next(workers)["tokens"])


def test_dp_ranks_get_disjoint_samples_in_megatron_layout():
    seen = {}
    for rank in range(2):
        it = ResumableBatchIterator(_Echo(), micro_batch_size=3, dp_rank=rank, dp_size=2,
                                    consumed_samples=6)
        seen[rank] = [next(it)["tokens"].flatten().tolist() for _ in range(2)]
    assert seen[0] == [[6, 7, 8], [12, 13, 14]]
    assert seen[1] == [[9, 10, 11], [15, 16, 17]]
    it = ResumableBatchIterator(_Echo(), micro_batch_size=3, dp_rank=0, dp_size=2)
    assert len(list(it)) == 40 // 6  # stops when a full global step no longer fits
    assert it.consumed_samples == 36


def test_preprocess_writes_documents_that_decode_back(corpus):
    tok = load_hf_tokenizer(str(corpus.tok_dir))
    indexed = IndexedDataset(corpus.prefixes["alpha"])
    assert len(indexed) == len(ALPHA)  # the empty line was skipped
    for i in (0, 17, 39):
        ids = indexed[i].tolist()
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids) == ALPHA[i] + EOT


def test_preprocess_cli_with_workers_matches_in_process(corpus, tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in ALPHA))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/preprocess_data.py"), "--input", str(jsonl),
         "--json-key", "body", "--tokenizer", str(corpus.tok_dir / "tokenizer.json"),
         "--output-prefix", str(tmp_path / "c"), "--append-eod", "--workers", "2"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert f"{len(ALPHA)} documents" in out
    for ext in ("bin", "idx"):
        assert (tmp_path / f"c_body_document.{ext}").read_bytes() == Path(
            f"{corpus.prefixes['alpha']}.{ext}").read_bytes()


def test_indexed_dataset_tokens_decode_to_corpus_text(corpus, tmp_path):
    cfg = DataConfig(kind=DataKind.indexed, paths=[corpus.prefixes["alpha"]], split="1,0,0",
               tokenizer=str(corpus.tok_dir), reset_position_ids=True, reset_attention_mask=True,
               eod_mask_loss=True, cache_dir=str(tmp_path / "cache"))
    tok = build_tokenizer(cfg, vocab_size=300)
    ds = build_dataset(cfg, Split.train, tokenizer=tok, seq_length=32, num_samples=20, seed=3)
    assert len(ds) >= 20
    batch = next(ResumableBatchIterator(ds, micro_batch_size=2, dp_rank=0, dp_size=1))
    assert "attention_mask" not in batch  # documents are separated by THD cu_seqlens instead
    assert torch.all(batch["loss_mask"][batch["tokens"] == tok.eod] == 0)
    for row in batch["tokens"]:
        pieces = tok.detokenize(row.tolist()).split(EOT)
        assert len(pieces) >= 2  # 32 tokens span a document boundary
        assert any(doc.endswith(pieces[0]) for doc in ALPHA)
        assert all(piece in ALPHA for piece in pieces[1:-1])
        assert any(doc.startswith(pieces[-1]) for doc in ALPHA)


def test_blended_paths_follow_weights(corpus, tmp_path):
    cfg = DataConfig(kind=DataKind.indexed, split="1,0,0", tokenizer=str(corpus.tok_dir / "tokenizer.json"),
               paths=["0.7", corpus.prefixes["alpha"], "0.3", corpus.prefixes["beta"]],
               cache_dir=str(tmp_path / "cache"))
    ds = build_dataset(cfg, Split.train, tokenizer=build_tokenizer(cfg, 300), seq_length=16,
                             num_samples=200, seed=1)
    assert isinstance(ds, BlendedDataset)
    share_alpha = float((torch.as_tensor(ds.dataset_index[:200]) == 0).float().mean())
    assert abs(share_alpha - 0.7) < 0.02
    tok = load_hf_tokenizer(str(corpus.tok_dir))
    text = {int(ds[i]["dataset_id"]): tok.detokenize(ds[i]["tokens"].tolist()) for i in range(20)}
    assert "alpha" in text[0] or "quick" in text[0]
    assert "beta" in text[1] or "hello" in text[1]


def test_eod_from_tokenizer_config_or_known_names(corpus, tmp_path):
    tokenizer = Tokenizer.from_file(str(corpus.tok_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_hf_tokenizer(str(tmp_path)).eod == tokenizer.token_to_id(EOT)  # first known name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = load_hf_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eod == tokenizer.token_to_id("</s>") and tok.vocab_size == tokenizer.get_vocab_size()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="end-of-document token"):
        load_hf_tokenizer(str(tmp_path))


def test_tokenizer_larger_than_the_embedding_is_a_config_error(corpus):
    cfg = DataConfig(kind=DataKind.indexed, paths=[corpus.prefixes["alpha"]], tokenizer=str(corpus.tok_dir))
    assert build_tokenizer(cfg, 300).vocab_size == 300
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*model.vocab_size=299 ids \(this one has 300\)"):
        build_tokenizer(cfg, 299)


def test_indexed_needs_a_tokenizer():
    with pytest.raises(ValueError, match="needs data.tokenizer"):
        build_tokenizer(DataConfig(kind=DataKind.indexed, paths=["x"]), 128)


@pytest.mark.parametrize(
    ("tokens", "cu_seqlens"),
    [
        ([5, 1, 2, 9, 3, 9, 7, 8], [0, 4, 6, 8]),
        ([1, 9, 2, 9], [0, 2, 4]),
        ([9, 1, 2], [0, 1, 3]),
        ([1, 2, 3], [0, 3]),
    ],
)
def test_packed_seq_params_split_after_eod(tokens, cu_seqlens):
    t = torch.tensor([tokens])
    params = packed_seq_params_from_eod(t, eod_id=9)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == cu_seqlens == params.cu_seqlens_kv.tolist()
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    assert params.max_seqlen_q == params.max_seqlen_kv == max(lengths)
    # megatron's reset_position_ids restarts positions exactly at these boundaries
    _, _, position_ids = _get_ltor_masks_and_position_ids(t[0], 9, True, False, False, False)
    assert position_ids.tolist() == [p for n in lengths for p in range(n)]


def test_packed_seq_params_need_one_row():
    with pytest.raises(ValueError, match=r"\[1, s\]"):
        packed_seq_params_from_eod(torch.zeros(2, 4, dtype=torch.long), eod_id=0)


def test_missing_helpers_without_makefile_raise(monkeypatch):
    import megatron.core.datasets as mds

    if (Path(mds.__file__).parent / "Makefile").is_file():
        pytest.skip("source install: missing helpers would be compiled")
    ensure_dataset_helpers()  # the wheel's prebuilt extension
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    with pytest.raises(RuntimeError, match="reinstall the megatron-core wheel"):
        ensure_dataset_helpers()


# ----------------------------------------------------------------------------------------------
# What a new user trips over: small corpora, bad input files, datasets that do not fit the model
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_small_corpus_with_the_default_split_does_not_hang(corpus, tmp_path):
    """40 documents with split 969,30,1 leave the test split 0 documents; megatron would loop
    forever building it (at 100% CPU). Only the train split is built."""
    cfg = DataConfig(kind=DataKind.indexed, paths=[corpus.prefixes["alpha"]], split="969,30,1",
               tokenizer=str(corpus.tok_dir), cache_dir=str(tmp_path / "cache"))
    ds = build_dataset(cfg, Split.train, tokenizer=build_tokenizer(cfg, 300), seq_length=16,
                             num_samples=20, seed=1)
    assert len(ds) >= 20


def _indexed(prefix: str, split: str = "969,30,1") -> DataConfig:
    return DataConfig(kind=DataKind.indexed, paths=[prefix], split=split)


def test_split_without_train_documents_names_data_split(corpus):
    check_indexed_data(_indexed(corpus.prefixes["alpha"]), 300)
    with pytest.raises(ConfigError, match=r"data.split='0,1,0'.*40 documents") as err:
        check_indexed_data(_indexed(corpus.prefixes["alpha"], "0,1,0"), 300)
    assert err.value.key == "data.split"


def test_token_ids_beyond_vocab_size_name_model_vocab_size(corpus):
    with pytest.raises(ConfigError, match=r"model.vocab_size=256.*largest token id") as err:
        check_indexed_data(_indexed(corpus.prefixes["alpha"]), 256)
    assert err.value.key == "model.vocab_size" and "alpha_text_document.bin" in str(err.value)


@pytest.mark.parametrize("damage,named", [("bin", ".bin holds"), ("idx", ".idx is truncated"),
                                          ("missing", ".idx does not exist")])
def test_truncated_or_missing_files_are_named(corpus, tmp_path, damage, named):
    prefix = tmp_path / "copy"
    for ext in ("bin", "idx"):
        data = Path(f"{corpus.prefixes['alpha']}.{ext}").read_bytes()
        Path(f"{prefix}.{ext}").write_bytes(data[: len(data) // 2] if ext == damage else data)
    if damage == "missing":
        Path(f"{prefix}.idx").unlink()
    with pytest.raises(ConfigError, match=re.escape(named)) as err:
        check_indexed_data(_indexed(str(prefix)), 300)
    assert err.value.key == "data.paths" and str(prefix) in str(err.value)


@pytest.mark.parametrize("content,error", [
    (b"", r"in.jsonl: empty"),
    (b'{"text": "ok"}\n\x00\x01binary\n', r"in.jsonl:2: binary data"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"in.jsonl:2: not UTF-8"),
    (b'{"text": "ok"}\n\n{"body": "x"}\n', r"in.jsonl:3: no key 'text' \(found \['body'\]\)"),
    (b'{"text": "ok"}\nnot json\n', r"in.jsonl:2: not JSON"),
    (b'{"text": 5}\n', r"in.jsonl:1: 'text' holds a int"),
])
def test_preprocess_rejects_bad_input_with_file_and_line(corpus, tmp_path, content, error):
    (tmp_path / "in.jsonl").write_bytes(content)
    with pytest.raises(SystemExit) as exited:
        _load_script().main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(corpus.tok_dir),
                             "--output-prefix", str(tmp_path / "out" / "c")])
    assert re.search(error, str(exited.value.code)), exited.value.code
    assert str(exited.value.code).startswith("error: ")
    assert not list((tmp_path / "out").iterdir())  # no partial .bin/.idx
