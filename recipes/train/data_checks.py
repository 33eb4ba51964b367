"""Checks of ``data.kind=indexed`` datasets before any rank builds them: each prefix's ``.bin`` and
``.idx`` exist and agree (a truncated file is named), the train split of ``data.split`` (and with
``train.eval_interval`` > 0 its validation split: megatron would never finish building an empty
one) gets at least one document of each prefix, and no token id reaches ``model.vocab_size``.

Each failure is a :class:`recipes.config.schema.ConfigError` naming the key to change and the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list

from recipes.config.schema import ConfigError, DataConfig, DataKind

_CHUNK = 1 << 26
"""Token ids read at once when scanning a ``.bin`` for its largest id."""


def train_split(split: str, part: int = 0) -> tuple[float, float]:
    """The train part (``part`` 1: the validation part) of ``data.split`` as megatron's
    (begin, end) fractions of the documents."""
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[part] or (0.0, 0.0)


def _open(prefix: str) -> IndexedDataset:
    """The indexed dataset at ``prefix``; missing, truncated or mismatched files are named."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise ConfigError("data.paths", prefix, f"prefixes of existing .bin/.idx pairs ({path} does "
                              "not exist; scripts/preprocess_data.py writes PREFIX.bin and PREFIX.idx)")
    try:
        dataset = IndexedDataset(prefix)
    except Exception as err:  # numpy/struct errors of a cut-off index
        raise ConfigError("data.paths", prefix, f"a complete index: {idx} is truncated or not a "
                          f"megatron index ({type(err).__name__}: {err})") from err
    expected = int(dataset.sequence_lengths.sum(dtype=np.int64)) * dataset.index.dtype_size
    if bin_.stat().st_size != expected:
        raise ConfigError("data.paths", prefix, f"a complete .bin/.idx pair: {bin_} holds "
                          f"{bin_.stat().st_size} bytes but {idx} describes {expected} (truncated, or "
                          "the two come from different preprocessing runs)")
    return dataset


def _max_token_id(prefix: str, dtype: np.dtype) -> int:
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    return max((int(tokens[i:i + _CHUNK].max()) for i in range(0, len(tokens), _CHUNK)), default=-1)


def check_indexed_data(data_cfg: DataConfig, vocab_size: int, validation: bool = False) -> None:
    """Raise :class:`ConfigError` if the indexed datasets of ``data_cfg`` cannot train a model of
    ``vocab_size`` ids (``validation``: and be evaluated on their validation split; see the module
    doc). Reads every ``.bin`` once (memory-mapped)."""
    if data_cfg.kind != DataKind.indexed:
        return
    prefixes, _ = get_blend_from_list(list(data_cfg.paths))
    begin, end = train_split(data_cfg.split)
    for prefix in prefixes:
        dataset = _open(prefix)
        documents = len(dataset.sequence_lengths)
        train_docs = int(round(end * documents)) - int(round(begin * documents))
        if train_docs < 1:
            raise ConfigError("data.split", data_cfg.split, f"a split whose train part gets at least one "
                              f"of the {documents} documents of {prefix} (e.g. data.split=1,0,0: "
                              "the recipes train on the train split only)")
        if validation:
            v_begin, v_end = train_split(data_cfg.split, 1)
            if int(round(v_end * documents)) - int(round(v_begin * documents)) < 1:
                raise ConfigError("data.split", data_cfg.split, f"a split whose validation part gets at "
                                  f"least one of the {documents} documents of {prefix} with "
                                  "train.eval_interval > 0 (e.g. data.split=9,1,0); or train.eval_interval=0")
        largest = _max_token_id(prefix, dataset.index.dtype)
        if largest >= vocab_size:
            raise ConfigError("model.vocab_size", vocab_size, f"more than the largest token id of "
                              f"{prefix}.bin ({largest}); or a dataset made with a tokenizer of at most "
                              f"{vocab_size} ids")
