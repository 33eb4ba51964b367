"""Streaming I/O for checkpoint conversion: HF safetensors in and out, block-FP8, and a megatron
``torch_dist`` checkpoint written one tensor at a time.

* :class:`HFReader` - a directory with ``model.safetensors.index.json`` (or one
  ``model.safetensors``); tensors are read one at a time with plain reads
  (:class:`SafetensorsFile`: a memory map would keep every page read so far resident). FP8 e4m3
  weights with a ``weight_scale_inv`` companion (128 x 128 blocks) come back dequantized to bf16.
  The multimodal layout (``model.language_model.*``, glm5_next's ``Glm5NextForConditionalGeneration``)
  reads as the text layout (``model.*``); its vision tensors (``model.visual.*``) are refused by name.
* :class:`HFWriter` - sharded ``model-0000i-of-0000n.safetensors`` of at most ``shard_bytes``
  each plus ``model.safetensors.index.json``; every tensor goes to disk as it is added.
* :func:`mmap_large_allocations` - glibc setting so that freed tensors go back to the OS.
* :func:`save_lazy_dist_checkpoint` - writes what ``dist_checkpointing.save`` would write for a
  sharded state dict whose tensors live on the ``meta`` device, asking ``materialize(name)`` for
  each real tensor only when torch DCP writes it (serially, one at a time).
* :func:`atomic_output_dir` - conversion output goes to a temporary directory that is renamed into
  place when complete; a non-empty target is refused unless forced.
* :func:`check_stored_shapes` - every tensor a model expects is in a dist checkpoint, same shape.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

FP8_BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
                       "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}
_SAFETENSORS_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
_COPY_CHUNK = 64 * 2**20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def mmap_large_allocations(threshold: int = 2**20) -> None:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own memory map,
    which goes back to the OS when freed (a no-op without glibc). Conversion calls it at start.

    Otherwise glibc raises its mmap threshold to the size of the first freed mapped block (up to
    32 MiB). Tensors of a few MiB then come from the heap, where long-lived small objects keep
    the freed space from being returned, and RSS grows with the number of tensors converted."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight`` (e4m3) times its per-128x128-block ``scale_inv`` [ceil(r/128), ceil(c/128)]."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    return (weight.float() * scale).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 (e4m3, 128 x 128): ``(q, scale_inv)`` with ``q * scale_inv ~= weight`` and each
    block's amax mapped to the e4m3 maximum (an all-zero block gets scale 1)."""
    rows, cols = weight.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv


class SafetensorsFile:
    """One ``.safetensors`` file read tensor by tensor with plain reads (no memory map, so only the
    tensor being read is resident): the header (``u64`` length, JSON) is parsed once."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        try:
            self.entries: dict[str, dict[str, Any]] = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> dict[str, dict[str, Any]]:
        """Parse the header; raise ``ValueError`` naming the file when it, or the tensor data it
        describes, does not fit in the file (a truncated or foreign file fails here, up front)."""
        size = self.path.stat().st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise ValueError(f"{self.path}: {size} bytes, too short for a safetensors header (truncated?)")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ValueError(f"{self.path}: its header claims {length} bytes, the file has {size} (truncated "
                             "or not a safetensors file)")
        try:
            header = json.loads(self._file.read(length))
        except ValueError as err:
            raise ValueError(f"{self.path}: unreadable safetensors header ({err})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        need = self._data_start + max((e["data_offsets"][1] for e in header.values()), default=0)
        if need > size:
            raise ValueError(f"{self.path}: {size} bytes, its header describes {need} (truncated: tensor "
                             "data missing)")
        return header

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of ``name``."""
        code = self.entries[name]["dtype"]
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {code}; supported: {sorted(_SAFETENSORS_DTYPES)}")
        return _SAFETENSORS_DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``, read into fresh memory."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        if raw.numel():
            # A ctypes view, not .numpy(): that would pin the storage (it must stay resizable).
            buffer = (ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())
            self._file.seek(self._data_start + begin)
            if self._file.readinto(buffer) != end - begin:
                raise OSError(f"{self.path}: truncated tensor {name!r}")
        return raw.view(self.dtype(name)).reshape(entry["shape"])

    def close(self) -> None:
        self._file.close()


LANGUAGE_MODEL_PREFIX = "model.language_model."
"""The decoder's tensors in a multimodal checkpoint (glm5_next); ``model.`` in the text layout."""
VISION_PREFIX = "model.visual."
"""A multimodal checkpoint's vision tower, which no model here builds."""


def text_layout(stored: list[str], where: Path) -> dict[str, str]:
    """The stored tensor name of each text-layout name: a multimodal checkpoint's
    ``model.language_model.X`` reads as ``model.X`` (other names as stored). Raises naming the
    vision tensors (``model.visual.*``: not converted, and nothing is dropped silently) and any
    name both layouts would give."""
    if not any(name.startswith(LANGUAGE_MODEL_PREFIX) for name in stored):
        return {name: name for name in stored}
    vision = sorted(name for name in stored if name.startswith(VISION_PREFIX))
    if vision:
        raise ValueError(f"{where}: {len(vision)} vision tensors ({vision[:3]}{' ...' if len(vision) > 3 else ''}) "
                         f"are not converted: only the text decoder ({LANGUAGE_MODEL_PREFIX}*) is built; "
                         f"remove the {VISION_PREFIX}* tensors to convert the text model")
    names: dict[str, str] = {}
    for name in stored:
        text = "model." + name[len(LANGUAGE_MODEL_PREFIX):] if name.startswith(LANGUAGE_MODEL_PREFIX) else name
        if text in names:
            raise ValueError(f"{where}: {names[text]!r} and {name!r} are both the tensor {text!r}")
        names[text] = name
    return names


class HFReader:
    """Tensors of an HF checkpoint directory, read (and FP8-dequantized) one at a time, by their
    text-layout names (:func:`text_layout`)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        self._handles: dict[str, SafetensorsFile] = {}
        if index.is_file():
            self._file_of = json.loads(index.read_text())["weight_map"]
            for file in sorted(set(self._file_of.values())):  # every shard checked before converting
                if not (self.dir / file).is_file():
                    raise FileNotFoundError(f"{self.dir / file}: missing (listed in {index.name})")
                self._open(file)
        elif (self.dir / "model.safetensors").is_file():
            self._file_of = {name: "model.safetensors" for name in self._open("model.safetensors").entries}
        else:
            raise FileNotFoundError(f"{self.dir}: neither model.safetensors.index.json nor model.safetensors")
        self._stored = text_layout(list(self._file_of), self.dir)  # text-layout name -> stored name

    def config(self) -> dict[str, Any] | None:
        """The checkpoint's ``config.json`` (``None`` when there is none)."""
        path = self.dir / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def names(self) -> set[str]:
        """Tensor names, FP8 scales excluded (they belong to their weight)."""
        return {n for n in self._stored if not n.endswith(SCALE_SUFFIX)}

    def _open(self, file: str) -> SafetensorsFile:
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(self.dir / file)
        return self._handles[file]

    def _read(self, name: str) -> tuple[SafetensorsFile, str]:
        """The open file holding text-layout tensor ``name`` and its stored name."""
        if name not in self._stored:
            raise KeyError(f"tensor {name!r} is not in {self.dir}")
        stored = self._stored[name]
        return self._open(self._file_of[stored]), stored

    def dtype(self, name: str) -> torch.dtype:
        """The dtype :meth:`get` returns for ``name`` (bf16 for FP8 weights)."""
        if name + SCALE_SUFFIX in self._stored:
            return torch.bfloat16
        handle, stored = self._read(name)
        return handle.dtype(stored)

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (FP8 weights dequantized to bf16)."""
        handle, stored = self._read(name)
        tensor = handle.get(stored)
        scale = name + SCALE_SUFFIX
        if scale in self._stored:
            scale_handle, scale_stored = self._read(scale)
            return dequantize_fp8(tensor, scale_handle.get(scale_stored))
        return tensor

    def close(self) -> None:
        """Release the open files."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


class HFWriter:
    """Sharded safetensors + ``model.safetensors.index.json`` of at most ``shard_bytes`` of tensor
    data per shard. Every tensor is written to disk when it is added (the shard's data file); closing
    a shard prepends its header by a chunked copy, so memory holds no tensor beyond the caller's."""

    def __init__(self, directory: str | os.PathLike, shard_bytes: int = 5 * 2**30) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self._entries: dict[str, dict[str, Any]] = {}  # the open shard's header
        self._data: Any = None  # the open shard's data file
        self._pending_bytes = 0
        self._files: list[list[str]] = []
        self._written: set[str] = set()
        self._total = 0

    def _data_path(self) -> Path:
        return self.dir / f"shard-{len(self._files):05d}.data.tmp"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` to the open shard, closing it first when it would overflow."""
        if name in self._written:
            raise KeyError(f"tensor {name!r} written twice")
        if tensor.dtype not in _SAFETENSORS_CODES:
            supported = sorted(map(str, _SAFETENSORS_CODES))
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {supported}")
        size = tensor.numel() * tensor.element_size()
        if self._entries and self._pending_bytes + size > self.shard_bytes:
            self._flush()
        if self._data is None:
            self._data = open(self._data_path(), "wb")  # noqa: SIM115 - closed by _flush()
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._data.write(memoryview(raw.numpy()))
        self._entries[name] = {"dtype": _SAFETENSORS_CODES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [self._pending_bytes, self._pending_bytes + size]}
        self._written.add(name)
        self._pending_bytes += size
        self._total += size

    def _flush(self) -> None:
        """Close the open shard: ``shard-i.tmp`` = header (space-padded to 8 bytes) + data."""
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        data_path = self._data_path()
        with open(self.dir / f"shard-{len(self._files):05d}.tmp", "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, out, _COPY_CHUNK)
        data_path.unlink()
        self._files.append(list(self._entries))
        self._entries, self._data, self._pending_bytes = {}, None, 0

    def finish(self) -> list[str]:
        """Close the last shard, give every shard its final name and write the index."""
        if self._entries:
            self._flush()
        n = len(self._files)
        weight_map = {}
        names = []
        for i, tensors in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f"shard-{i:05d}.tmp", self.dir / final)
            weight_map.update({t: final for t in tensors})
            names.append(final)
        index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def _shard_sources(sharded: dict[str, Any]) -> dict[tuple[str, tuple[int, ...]], tuple[str, Callable]]:
    """(sharded key, global offset) of every ShardedTensor a state-dict entry becomes ->
    (state-dict name, a function cutting that shard out of the entry's real tensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    sources = {}
    for name, entry in sharded.items():
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            continue
        entry = copy.copy(entry)  # saving reshapes the entries' data in place

        def cut(real: torch.Tensor, key: str, offset: tuple[int, ...], entry: Any = entry) -> torch.Tensor:
            built = {"x": replace(entry, data=real)}
            apply_factories(built)
            for sh in _flatten(built):
                if sh.key == key and tuple(sh.global_offset) == offset:
                    return sh.data
            raise KeyError(f"no shard {key} at {offset}")

        built = {"x": entry}
        apply_factories(built)
        for sh in _flatten(built):
            sources[(sh.key, tuple(sh.global_offset))] = (name, cut)
    return sources


def _flatten(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _flatten(tree=v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _flatten(v)
    else:
        yield tree


def save_lazy_dist_checkpoint(sharded: dict[str, Any], directory: str | os.PathLike,
                              materialize: Callable[[str], torch.Tensor]) -> None:
    """Write the model-only dist checkpoint ``{"model": sharded}`` to ``directory``.

    ``sharded`` is ``GPTModel.sharded_state_dict()`` of a model built on ``meta`` whose tensors
    carry the dtypes to store; ``materialize(name)`` returns the real tensor of state-dict entry
    ``name`` (same shape). The result is what ``dist_checkpointing.save`` writes (torch_dist
    backend, ``common_state`` object, ``metadata.json``) and loads with resharding.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    sources = _shard_sources(sharded)
    state, common = save_preprocess({"model": dict(sharded)}, validate_access_integrity=False)
    state["common_state"] = ShardedObject(key="common_state", data=common, global_shape=(1,),
                                          global_offset=(0,), replica_id=0)
    state, _, _ = _replace_state_dict_keys_with_sharded_keys(state, True)
    pyt_state = mcore_to_pyt_state_dict(state, False)
    cache: dict[str, torch.Tensor] = {}
    written: list[torch.Tensor] = []

    class LazyPlanner(MCoreSavePlanner):
        """Resolves tensor write items by materializing their source tensor (one cached).

        torch DCP's writer keeps every tensor it wrote in a dict until the file is closed (one file:
        the whole model). Each shard is therefore handed over as a tensor of its own (a copy, or the
        source tensor itself when it is one shard) whose storage is emptied when the next one is
        asked for: the serial loader (``per_thread_copy_ahead=0``) has written it by then."""

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.tensor_data is None:
                return super().resolve_data(write_item)
            for done in written:
                done.untyped_storage().resize_(0)
            written.clear()
            key, offset = write_item.index.fqn, tuple(write_item.index.offset)
            name, cut = sources[(key, offset)]
            if name not in cache:
                cache.clear()
                cache[name] = materialize(name)
            source = cache[name]
            shard = cut(source, key, offset).reshape(write_item.tensor_data.chunk.sizes)
            if shard.numel() == source.numel() and source.untyped_storage().resizable():  # no copy
                cache.clear()
                shard = shard.contiguous()
            else:
                shard = shard.clone()
            written.append(shard)
            return shard

    Path(directory).mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(directory), thread_count=1, per_thread_copy_ahead=0)
    dcp.save(pyt_state, storage_writer=writer,
             planner=LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                                 flatten_sharded_tensors=False),
             no_dist=True)
    cache.clear()
    save_config(CheckpointingConfig("torch_dist", 1), str(directory))


def stored_dtypes(directory: str | os.PathLike) -> dict[str, torch.dtype]:
    """Sharded key -> stored dtype of every tensor in a torch_dist checkpoint."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    return {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}


@contextmanager
def atomic_output_dir(target: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """A fresh temporary directory next to ``target`` that becomes ``target`` when the block
    succeeds (and is removed when it fails). A non-empty ``target`` is refused before any work
    unless ``force``, which replaces it only once the new one is complete."""
    target = Path(target)
    if target.exists() and not force and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not empty: refusing to overwrite it "
                              "(choose another output directory, or pass --force to replace it)")
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def check_stored_shapes(sharded: dict[str, Any], directory: str | os.PathLike) -> None:
    """Raise naming every tensor of ``sharded`` (a model's sharded state dict) that the torch_dist
    checkpoint ``directory`` lacks or stores with another global shape (no padding, no cropping)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    problems = []
    for entry in sharded.values():
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            continue
        built = {"x": copy.copy(entry)}
        apply_factories(built)
        for sh in _flatten(built):
            want = tuple(sh.global_shape)
            have = getattr(stored.get(sh.key), "size", None)
            vocab = " (model.vocab_size)" if "word_embeddings" in sh.key or "output_layer" in sh.key else ""
            if have is None:
                problems.append(f"{sh.key}: not in the checkpoint")
            elif tuple(have) != want:
                problems.append(f"{sh.key}: checkpoint {tuple(have)}, model {want}{vocab}")
    if problems:
        raise ValueError(f"{directory} does not match the model config ({len(problems)} tensors): "
                         + "; ".join(sorted(set(problems))[:10]))
