"""Training data for the recipes: tokenizers, megatron-core GPT datasets and a resumable,
data-parallel batch iterator.

Everything dataset-related is megatron-core's (``GPTDataset``/``MockGPTDataset`` through
``BlendedMegatronDatasetBuilder``); this module only wires a data config into it.

Tokenizers
    ``kind="mock"`` without a tokenizer uses megatron's null tokenizer (``library="null-text"``)
    with the model's vocab size; its EOD id is ``vocab_size - 1``. A local Hugging Face tokenizer
    (a directory holding ``tokenizer.json``, or the file itself) is wrapped in megatron's
    :class:`~megatron.core.tokenizers.text.models.GPTTokenizer`. megatron's own ``huggingface``
    library needs ``transformers``, which this project does not install, so the library object
    under the megatron tokenizer is :class:`TokenizersLibrary`, a thin adapter over the
    ``tokenizers`` package (the same Rust tokenizer ``transformers``' fast tokenizers run).

C++ dataset helpers
    ``GPTDataset`` builds its sample index with ``megatron.core.datasets.helpers_cpp``. The
    megatron-core wheel ships it prebuilt, so a fresh venv needs nothing. A source checkout of
    Megatron-LM has a Makefile instead; :func:`ensure_dataset_helpers` then compiles it once with
    megatron's ``compile_helpers()`` (needs g++ and ``pybind11``) on rank 0 while the other ranks
    wait. A wheel whose extension is missing or broken raises with the fix.

Multi-rank construction
    ``BlendedMegatronDatasetBuilder`` builds on global rank 0 first (writing the index cache),
    calls ``torch.distributed.barrier()``, then builds on the other ranks, which load the cache.
    Every rank builds its own dataset here; ``cache_dir`` must be on storage all nodes see.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import Split, compile_helpers, get_blend_from_list
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase
from megatron.core.tokenizers.text.libraries.abstract_tokenizer import (
    MegatronTokenizerTextAbstract,
)
from megatron.core.tokenizers.text.models import GPTTokenizer
from megatron.core.utils import get_batch_on_this_cp_rank

from recipes.config.schema import ConfigError, DataConfig, DataKind

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Tried in order when the tokenizer directory has no tokenizer_config.json naming an eos_token.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class TokenizersLibrary(MegatronTokenizerTextAbstract):
    """megatron tokenizer-library adapter over a ``tokenizers.Tokenizer`` (``tokenizer.json``).

    Encoding applies the tokenizer's post-processor (as ``AutoTokenizer(text).input_ids`` does);
    decoding keeps special tokens (megatron's default). The EOD id is the ``eos_token`` of a
    ``tokenizer_config.json`` next to ``tokenizer.json`` or else the first of
    ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` in the vocabulary.
    """

    def __init__(self, path: str) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tokenizer = _tokenizers_module(path).Tokenizer.from_file(str(file))
        self.eos_token = _eos_token(file.parent, self.tokenizer)

    def text_to_tokens(self, text: str) -> list[str]:
        return self.tokenizer.encode(text).tokens

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self.tokenizer.decode(self.tokens_to_ids(tokens), skip_special_tokens=False)

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def text_to_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def ids_to_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def add_special_tokens(self, special_tokens: list[str] | dict[str, str]) -> int:
        """Adds special tokens (a list, or a dict whose values are tokens); returns how many."""
        tokens = list(special_tokens.values()) if isinstance(special_tokens, dict) else special_tokens
        return self.tokenizer.add_special_tokens(tokens)

    @property
    def eos(self) -> int:
        return self.tokenizer.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> list[str]:
        return [self.tokenizer.id_to_token(i) for i in range(self.vocab_size)]

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.tokenizer.get_vocab(with_added_tokens=True).items()}


def _tokenizers_module(path: str) -> Any:
    """The ``tokenizers`` package, imported only when a tokenizer is loaded: mock data without
    ``data.tokenizer`` (and ``pip install .`` without extras) never needs it."""
    try:
        return importlib.import_module("tokenizers")
    except ModuleNotFoundError as err:
        raise ConfigError(
            "data.tokenizer", path,
            "a tokenizer needs the `tokenizers` package: pip install 'kpool-recipes[data]' "
            "(or leave data.tokenizer unset with data=mock)",
        ) from err


def _eos_token(directory: Path, tokenizer: Tokenizer) -> str:
    """The end-of-document token of a Hugging Face tokenizer directory (see TokenizersLibrary)."""
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        eos = json.loads(config_file.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if eos is not None:
            return eos
    for token in _EOD_CANDIDATES:
        if tokenizer.token_to_id(token) is not None:
            return token
    raise ValueError(
        f"cannot find the end-of-document token of the tokenizer in {directory}: add "
        f"tokenizer_config.json with eos_token, or one of {_EOD_CANDIDATES} to the vocabulary"
    )


class LocalHFTokenizer(GPTTokenizer):
    """megatron's GPT tokenizer over :class:`TokenizersLibrary` (no ``transformers`` needed)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, {"library": "tokenizers", "model_type": "gpt", "chat_template": None})

    def _restore_model(self, **kwargs: Any) -> TokenizersLibrary:
        return TokenizersLibrary(self.path)


def load_hf_tokenizer(path: str) -> LocalHFTokenizer:
    """The megatron tokenizer for a local Hugging Face tokenizer directory or tokenizer.json."""
    return LocalHFTokenizer(str(Path(path).resolve()))


def build_tokenizer(data_cfg: DataConfig, vocab_size: int) -> MegatronTokenizerBase:
    """The tokenizer ``data_cfg`` names, or for ``kind="mock"`` without one megatron's null
    tokenizer of ``vocab_size`` ids (EOD = ``vocab_size - 1``). A named tokenizer with more ids
    than the model's embedding is a :class:`ConfigError`."""
    if data_cfg.tokenizer is not None:
        tokenizer = load_hf_tokenizer(data_cfg.tokenizer)
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(
                "data.tokenizer", data_cfg.tokenizer,
                f"a tokenizer of at most model.vocab_size={vocab_size} ids (this one has "
                f"{tokenizer.vocab_size}); or raise model.vocab_size",
            )
        return tokenizer
    if data_cfg.kind not in (DataKind.mock, DataKind.rollout):  # rollout records hold token ids
        raise ValueError(f"data.kind={data_cfg.kind!r} needs data.tokenizer")
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=vocab_size
    )


def ensure_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.helpers_cpp`` importable (see the module docstring)."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError as err:
        package_dir = Path(importlib.import_module("megatron.core.datasets").__file__).parent
        if not (package_dir / "Makefile").is_file():
            raise RuntimeError(
                f"megatron-core's C++ dataset helpers are missing from {package_dir} and there is "
                "no Makefile to build them; reinstall the megatron-core wheel for this Python "
                "(it ships helpers_cpp prebuilt)"
            ) from err
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        compile_helpers()
    if distributed:
        dist.barrier()
    importlib.invalidate_caches()
    importlib.import_module("megatron.core.datasets.helpers_cpp")


def build_dataset(
    data_cfg: DataConfig,
    which: Split,
    *,
    tokenizer: MegatronTokenizerBase,
    seq_length: int,
    num_samples: int,
    seed: int,
) -> torch.utils.data.Dataset:
    """Split ``which`` (megatron's ``Split.train`` or ``Split.valid``) of megatron's GPT dataset
    with at least ``num_samples`` samples.

    ``kind="mock"``: ``MockGPTDataset`` (synthetic documents ending in EOD; megatron splits its
    documents 1:1:1, so the validation split is the middle third). ``kind="indexed"``:
    ``GPTDataset`` over ``paths`` (megatron blend list; weights sample the prefixes in proportion)
    split by ``split``: the training and validation splits hold disjoint documents. Only the
    requested split is built. Items are dicts of ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` of length ``seq_length`` (no dense ``attention_mask``: with
    ``reset_attention_mask`` the loop runs each row as packed THD documents, see
    :func:`packed_seq_params_from_eod`). Call on every rank (collective when torch.distributed is
    initialized). An indexed ``split`` without a part for ``which`` is a :class:`ConfigError`
    naming ``data.split`` (:mod:`recipes.config.rules` refuses a missing validation part first).
    """
    indexed = data_cfg.kind == DataKind.indexed
    if indexed and not data_cfg.paths:
        raise ValueError("data.kind='indexed' needs data.paths")
    ensure_dataset_helpers()
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=get_blend_from_list(list(data_cfg.paths)) if indexed else None,
        split=data_cfg.split if indexed else None,
        path_to_cache=data_cfg.cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=data_cfg.reset_position_ids,
        reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss,
        create_attention_mask=False,
    )
    bounds = config.split_matrix[which.value]
    if bounds is None:
        raise ConfigError("data.split", data_cfg.split,
                          f"a split with a non-zero {which.name} part (e.g. 969,30,1)")
    # only the requested split: an empty other split would never finish building
    config.split_matrix = [bounds if s is which else None for s in Split]
    dataset_cls = GPTDataset if indexed else MockGPTDataset
    sizes = [num_samples if s is which else 0 for s in Split]
    return BlendedMegatronDatasetBuilder(dataset_cls, sizes, lambda: True, config).build()[which.value]


class _RankBatches(torch.utils.data.Sampler[list[int]]):
    """Index lists of one dp rank's micro batches, from global sample ``start`` on."""

    def __init__(self, length: int, start: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.length, self.start = length, start
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.length - self.start) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        for begin in range(self.start, self.start + len(self) * step, step):
            first = begin + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))


class ResumableBatchIterator(Iterator[dict[str, torch.Tensor]]):
    """Deterministic, resumable micro batches of one data-parallel rank.

    The global sample order is the dataset's index order (megatron's datasets are already
    shuffled by seed). Each step consumes ``micro_batch_size * dp_size`` samples: sample ``i`` goes
    to dp rank ``(i // micro_batch_size) % dp_size`` (megatron-LM's pretraining sampler layout), so
    ranks see disjoint samples. :attr:`consumed_samples` counts global samples handed out so far;
    checkpoint it and pass it back to resume with exactly the next batch. Iteration stops when a
    full global step no longer fits in the dataset. ``num_workers > 0`` loads in DataLoader
    worker processes; prefetched batches are not counted as consumed.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        num_workers: int = 0,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if micro_batch_size < 1 or consumed_samples < 0:
            raise ValueError("micro_batch_size must be >= 1 and consumed_samples >= 0")
        self._consumed = consumed_samples
        self._global_batch = micro_batch_size * dp_size
        sampler = _RankBatches(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
        self._batches = iter(
            torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)
        )

    @property
    def consumed_samples(self) -> int:
        """Global samples (all dp ranks) consumed so far."""
        return self._consumed

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._batches)
        self._consumed += self._global_batch
        return batch


def packed_seq_params_from_eod(tokens: torch.Tensor, eod_id: int) -> PackedSeqParams:
    """THD ``PackedSeqParams`` for a packed micro batch of one row, split after each EOD token.

    A document ends with (and includes) its EOD token; the next starts right after it. These are
    exactly the boundaries at which megatron's ``reset_position_ids`` restarts ``position_ids`` at
    0 (and ``reset_attention_mask`` blocks attention), so use both with this: position ids
    restarting per document, attention confined to each document by ``cu_seqlens``. Documents
    must have been written with EOD (``preprocess_data.py --append-eod``); the mock dataset adds
    it. Returns int32 ``cu_seqlens`` ``[0, ..., s]`` for q and kv and their max segment length.
    """
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"packed sequences need tokens of shape [1, s], got {tuple(tokens.shape)}")
    seq_len = tokens.shape[1]
    ends = (tokens[0] == eod_id).nonzero().flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=ends.dtype, device=ends.device), ends])
    if bounds[-1] != seq_len:
        bounds = torch.cat([bounds, bounds.new_tensor([seq_len])])
    cu_seqlens = bounds.to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )



def context_parallel_slice(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This context-parallel rank's part of a micro batch ``{key: [b, s, ...]}``: megatron's
    load-balanced per-sequence split (``get_batch_on_this_cp_rank`` with per-sequence balancing;
    rank ``r`` keeps chunks ``r`` and ``2 * CP - 1 - r`` of ``2 * CP``), the order
    :mod:`kpool_layers.dsa.context_parallel` assumes. Packed rows split the same way (documents may
    straddle ranks; build their ``PackedSeqParams`` from the whole row first). A new dict (the
    batch itself without CP)."""
    if ps.get_context_parallel_world_size() == 1:
        return batch
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=ps.get_context_parallel_group(),
                                     use_per_sequence_balancing=True)
