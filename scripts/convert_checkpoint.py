"""Convert GLM-5.x checkpoints between Hugging Face safetensors and our megatron dist checkpoints.

    python scripts/convert_checkpoint.py import --hf DIR [--model NAME|FILE.yaml] --out CKPT [--skip-mtp] [--force]
    python scripts/convert_checkpoint.py export --ckpt CKPT --hf-out DIR [--model NAME|FILE.yaml] [--fp8] [--force]
    python scripts/convert_checkpoint.py verify --hf DIR [--ckpt CKPT] [--tokens N] [--seq-len S] [--packed] [--max-delta X] [--skip-mtp]

``import`` writes a torch_dist checkpoint with full (unsharded) tensors, which megatron's
``dist_checkpointing`` reshards on load to any TP/PP/EP: ``python train.py model=NAME
train.load=CKPT`` (weights only). Without ``--model`` the ``model`` group is derived from the HF
``config.json`` and printed (``--model`` is required when there is no config.json); it is saved as
``CKPT/model.yaml`` and in the checkpoint's manifest (``kpool_manifest.json``, with checksums).
``export`` verifies the checkpoint's manifest, takes the model config from it (training
checkpoints too) or from ``model.yaml`` when ``--model`` is not given, and checks every stored
tensor shape (vocab included) against that model before writing anything.

Output goes to a temporary directory renamed into place when complete; a non-empty output
directory is refused unless ``--force``. Both outputs hold ``conversion.json`` naming their source.
Both directions stream: one tensor (import) or one HF layer (export) is in memory at a time;
tensors are written to disk as they come. A checkpoint's MTP layers (``model.layers.{n}.*`` past
the decoder's ``n``) that the model does not build are an error naming them; ``--skip-mtp`` converts
without them (the model gets ``mtp_num_layers: 0``; GLM-5.3's ``model.layers.45.*``, which
transformers' ``Glm5NextTextModel`` ignores too), prints how many tensors it left out and lists them
in ``conversion.json``. ``verify`` runs the same tokens through transformers'
model of ``--hf`` and ours (weights from ``--ckpt``, or ``--hf`` mapped in memory) on CPU in
float32, prints max / mean |Δlogit| and top-1 agreement, and exits 1 when max |Δlogit| exceeds the
bound (``recipes.hf.verify``). See docs/hf_interop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recipes.launch import console  # noqa: E402

console.quiet()  # before megatron-core: its notes about Transformer Engine, apex and absl

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from kpool_layers.compat import cpu as _cpu  # noqa: E402
from recipes.hf.config import hf_config_from_model, model_config_from_hf  # noqa: E402
from recipes.hf.io import (  # noqa: E402
    HFReader,
    HFWriter,
    atomic_output_dir,
    check_stored_shapes,
    mmap_large_allocations,
    quantize_fp8,
    save_lazy_dist_checkpoint,
    stored_dtypes,
)
from recipes.hf.mapping import Mapping, TensorMap, build_mapping, check_hf_names  # noqa: E402
from recipes.launch.distributed import free_port  # noqa: E402
from recipes.checkpoint.manifest import code_version, verify, write_manifest  # noqa: E402
from recipes.hf.convert_checks import (check_export_paths, check_output_dir,  # noqa: E402
                                       check_single_checkpoint, one_line)
from recipes.config.schema import Config, ModelConfig  # noqa: E402
from recipes.hf.verify import DEFAULT_SEQ_LEN, DEFAULT_TOKENS, Report, family, read_hf_config  # noqa: E402
from recipes.hf.verify import verify as verify_logits  # noqa: E402

MODEL_YAML = "model.yaml"
CONVERSION_JSON = "conversion.json"
FP8_WEIGHTS = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|wq_b|wk|gate_proj|up_proj|down_proj)\.weight$")
"""HF tensors ``export --fp8`` stores as block FP8 (the linears of attention, indexer and MLPs);
embeddings, norms, router, indexer head weights, MTP ``eh_proj`` and KPool tensors stay as they are."""


def model_group(model: str | None, hf_config: dict[str, Any] | None = None, name: str = "hf_import",
                skip_mtp: bool = False) -> DictConfig:
    """The typed ``model`` group: ``conf/model/<model>.yaml``, a yaml file, or derived from
    ``hf_config`` (without MTP layers with ``skip_mtp``, which a ``--model`` with MTP layers refuses)."""
    schema = OmegaConf.structured(ModelConfig)
    if model is None:
        if hf_config is None:
            raise ValueError("--model is required: no HF config.json, checkpoint manifest or model.yaml "
                             "to derive the model config from")
        return OmegaConf.merge(schema, model_config_from_hf(hf_config, name, skip_mtp))
    cfg = _model_file(model, schema)
    if skip_mtp and cfg.mtp_num_layers:
        raise ValueError(f"--skip-mtp with --model {model}: its model.mtp_num_layers is {cfg.mtp_num_layers}; "
                         "pass a model with mtp_num_layers 0 or leave out --skip-mtp")
    return cfg


def _model_file(model: str, schema: DictConfig) -> DictConfig:
    """``schema`` merged with the yaml file ``model``, else with ``conf/model/<model>.yaml``."""
    path = Path(model)
    if not path.is_file():
        path = ROOT / "conf" / "model" / f"{model}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"--model {model}: neither a yaml file nor conf/model/{model}.yaml")
    try:
        return OmegaConf.merge(schema, OmegaConf.load(path))
    except OmegaConfBaseException as err:
        raise ValueError(f"--model {path}: not a model config ({str(err).splitlines()[0]}); pass a "
                         "conf/model name or a yaml file of the model group") from err


def init_single_rank() -> None:
    """A one-process gloo group and megatron parallel state at TP = PP = EP = 1 (if none yet)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _cpu.install()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))  # another converter may hold a fixed one
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234)


def meta_sharded_state_dict(model_cfg: DictConfig) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """``GPTModel.sharded_state_dict()`` of the model built on ``meta`` at TP = PP = EP = 1, and
    the shape of every state-dict tensor (expert shards carry an extra leading axis)."""
    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model, meta_init
    from recipes.config.typed import to_config

    init_single_rank()
    cfg = to_config(OmegaConf.merge(OmegaConf.structured(Config),
                                    {"model": model_cfg, "precision": {"dtype": "fp32"}}))
    tcfg = to_transformer_config(cfg)
    with meta_init(tcfg):
        model = build_gpt_model(cfg, tcfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return model.sharded_state_dict(), shapes


def _tensor_entries(sharded: dict[str, Any], mapping: Mapping) -> dict[str, TensorMap]:
    """Map every tensor entry of ``sharded`` to its TensorMap; raise naming any mismatch."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    tensors = {k for k, v in sharded.items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    by_name = {m.megatron: m for m in mapping.maps}
    if tensors != set(by_name):
        raise KeyError(f"model and mapping disagree: model only {sorted(tensors - set(by_name))}, "
                       f"mapping only {sorted(set(by_name) - tensors)}")
    return by_name


def _with_data(entry: Any, data: torch.Tensor) -> Any:
    """``entry`` (ShardedTensor or factory) over ``data`` instead of its own tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        return replace(entry, data=data, dtype=data.dtype)
    return replace(entry, data=data)


def _record_source(directory: Path, direction: str, source: str | os.PathLike, model_cfg: DictConfig,
                   **extra: Any) -> None:
    """``conversion.json``: what this directory was converted from, by which code, when."""
    record = {"direction": direction, "source": str(Path(source).resolve()), "code_version": code_version(),
              "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": OmegaConf.to_container(model_cfg, enum_to_str=True), **extra}
    (directory / CONVERSION_JSON).write_text(json.dumps(record, indent=1) + "\n")


def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, model: str | None = None,
              force: bool = False, skip_mtp: bool = False) -> DictConfig:
    """HF checkpoint directory -> megatron dist checkpoint ``out``; returns the ``model`` group.
    ``skip_mtp``: the checkpoint's MTP layers are left out (and listed in ``conversion.json``)."""
    check_output_dir(out, "--out")
    with atomic_output_dir(out, force) as tmp:
        return _import_into(hf_dir, tmp, model, skip_mtp)


def _import_into(hf_dir: str | os.PathLike, out: Path, model: str | None, skip_mtp: bool) -> DictConfig:
    reader = HFReader(hf_dir)
    model_cfg = model_group(model, reader.config(), skip_mtp=skip_mtp)
    if model is None:
        print(f"model config derived from {Path(hf_dir) / 'config.json'}:\n{OmegaConf.to_yaml(model_cfg)}")
    mapping = build_mapping(model_cfg)
    present = reader.names()
    skipped = check_hf_names(mapping, present, skip_mtp)
    if skip_mtp:
        print(f"--skip-mtp: left out {len(skipped)} tensors of layers past the model's {mapping.layers}"
              f"{' (listed in ' + CONVERSION_JSON + ')' if skipped else ' (the checkpoint has none)'}")
    for alias, target in mapping.aliases.items():
        if alias in present and not torch.equal(reader.get(alias), reader.get(target)):
            raise ValueError(f"{alias} differs from {target}; megatron's MTP shares that tensor")
    for name, (shape, _) in mapping.inert.items():
        if name in present and tuple(reader.get(name).shape) != shape:
            raise ValueError(f"{name}: shape {tuple(reader.get(name).shape)}, expected {shape}")
    sharded, shapes = meta_sharded_state_dict(model_cfg)
    by_name = _tensor_entries(sharded, mapping)
    dtypes = {name: reader.dtype(m.hf[0]) for name, m in by_name.items()}
    for name in by_name:
        sharded[name] = _with_data(sharded[name], torch.empty(shapes[name], dtype=dtypes[name], device="meta"))

    def materialize(name: str) -> torch.Tensor:
        m = by_name[name]
        tensor = m.conversion.to_megatron([reader.get(h) for h in m.hf])
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{m.hf} -> {name}: shape {tuple(tensor.shape)}, the model expects {shapes[name]}")
        return tensor.to(dtypes[name])

    save_lazy_dist_checkpoint(sharded, out, materialize)
    reader.close()
    (out / MODEL_YAML).write_text(OmegaConf.to_yaml(model_cfg))
    _record_source(out, "import", hf_dir, model_cfg, **({"skipped_mtp_tensors": skipped} if skip_mtp else {}))
    write_manifest(out, config={"model": OmegaConf.to_container(model_cfg, enum_to_str=True)},
                   lineage=f"import-{uuid.uuid4().hex}", step=0)
    return model_cfg


def _hf_group(name: str) -> str:
    """Export groups (loaded together): one per HF layer; a tensor outside the layers (embedding,
    output layer, final norm) is a group of its own."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match.group(0) if match else name


def _export_group(writer: HFWriter, ckpt: str | os.PathLike, maps: list[TensorMap], sharded: dict[str, Any],
                  shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                  aliases_of: dict[str, list[str]], fp8: bool, dtype_counts: dict[torch.dtype, int]) -> None:
    """Load the megatron tensors of ``maps`` from the dist checkpoint and write their HF tensors
    (and aliases); each is released once written, and nothing outlives the call."""
    from megatron.core import dist_checkpointing

    request = {}
    for m in maps:
        entry = sharded[m.megatron]
        request[m.megatron] = _with_data(entry, torch.empty(entry.data.shape, dtype=dtypes[entry.key]))
    loaded = dist_checkpointing.load({"model": request}, str(ckpt))["model"]
    request.clear()
    for m in maps:
        megatron = loaded.pop(m.megatron).reshape(shapes[m.megatron])
        for hf_name, tensor in zip(m.hf, m.conversion.to_hf(megatron), strict=True):
            dtype_counts[tensor.dtype] = dtype_counts.get(tensor.dtype, 0) + tensor.numel()
            for name in [hf_name, *aliases_of.get(hf_name, [])]:
                if fp8 and tensor.dim() == 2 and FP8_WEIGHTS.search(name):
                    q, scale_inv = quantize_fp8(tensor)
                    writer.add(name, q)
                    writer.add(name[: -len("weight")] + "weight_scale_inv", scale_inv)
                else:
                    writer.add(name, tensor)


def checkpoint_model_group(ckpt: str | os.PathLike, model: str | None) -> DictConfig:
    """``--model`` if given, else the model config in the checkpoint's manifest, else its
    ``model.yaml``; the checkpoint's files are verified against its manifest first."""
    manifest = verify(ckpt)
    if model is not None:
        return model_group(model)
    saved = (manifest or {}).get("config", {}).get("model")
    if saved is not None:
        return OmegaConf.merge(OmegaConf.structured(ModelConfig), saved)
    yaml = Path(ckpt) / MODEL_YAML
    return model_group(str(yaml) if yaml.is_file() else None)


def export_hf(ckpt: str | os.PathLike, hf_out: str | os.PathLike, model: str | None = None,
              fp8: bool = False, shard_bytes: int = 5 * 2**30, force: bool = False) -> None:
    """Megatron dist checkpoint -> HF directory (sharded safetensors, index, config.json), one
    group (:func:`_hf_group`) in memory at a time."""
    check_export_paths(ckpt, hf_out)
    check_single_checkpoint(ckpt)
    check_output_dir(hf_out, "--hf-out")
    with atomic_output_dir(hf_out, force) as tmp:
        _export_into(ckpt, tmp, model, fp8, shard_bytes)


def _export_into(ckpt: str | os.PathLike, hf_out: Path, model: str | None, fp8: bool, shard_bytes: int) -> None:
    model_cfg = checkpoint_model_group(ckpt, model)
    mapping = build_mapping(model_cfg)
    sharded, shapes = meta_sharded_state_dict(model_cfg)
    _tensor_entries(sharded, mapping)
    check_stored_shapes(sharded, ckpt)
    dtypes = stored_dtypes(ckpt)
    aliases_of: dict[str, list[str]] = {}
    for alias, target in mapping.aliases.items():
        aliases_of.setdefault(target, []).append(alias)
    groups: dict[str, list[TensorMap]] = {}
    for m in mapping.maps:
        groups.setdefault(_hf_group(m.hf[0]), []).append(m)

    writer = HFWriter(hf_out, shard_bytes)
    dtype_counts: dict[torch.dtype, int] = {}
    for maps in groups.values():
        _export_group(writer, ckpt, maps, sharded, shapes, dtypes, aliases_of, fp8, dtype_counts)
    main_dtype = max(dtype_counts, key=dtype_counts.get)
    for name, (shape, value) in mapping.inert.items():
        writer.add(name, torch.full(shape, value, dtype=main_dtype))
    writer.finish()
    config = hf_config_from_model(model_cfg, str(main_dtype).removeprefix("torch."))
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    (hf_out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _record_source(hf_out, "export", ckpt, model_cfg, fp8=fp8)


def verify_hf(hf_dir: str | os.PathLike, ckpt: str | os.PathLike | None = None, model: str | None = None,
              skip_mtp: bool = False, **options: Any) -> Report:
    """``verify``: the model config (``--model``, else the checkpoint's, else derived from
    ``--hf``'s config.json, without MTP layers with ``skip_mtp``), then
    :func:`recipes.hf.verify.verify` with ``options``."""
    import transformers

    transformers.utils.logging.set_verbosity_error()  # its load report and progress bars
    transformers.utils.logging.disable_progress_bar()
    hf_config = read_hf_config(hf_dir)
    family(hf_config, hf_dir)
    if ckpt is not None:
        check_single_checkpoint(ckpt)
        model_cfg = checkpoint_model_group(ckpt, model)
    else:
        model_cfg = model_group(model, hf_config, skip_mtp=skip_mtp)
    init_single_rank()
    return verify_logits(hf_dir, model_cfg, ckpt, skip_mtp=skip_mtp, **options)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF safetensors -> megatron dist checkpoint")
    imp.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    imp.add_argument("--model", help="conf/model name or yaml file (default: derived from config.json)")
    imp.add_argument("--out", required=True, help="dist checkpoint directory to write")
    imp.add_argument("--force", action="store_true", help="replace a non-empty --out")
    imp.add_argument("--skip-mtp", action="store_true",
                     help="convert without the checkpoint's MTP layers (model.layers.N+ past the decoder)")
    exp = sub.add_parser("export", help="megatron dist checkpoint -> HF safetensors")
    exp.add_argument("--ckpt", required=True, help="dist checkpoint directory (e.g. .../iter_0000100)")
    exp.add_argument("--hf-out", required=True, help="HF directory to write")
    exp.add_argument("--model", help="conf/model name or yaml file (default: from the checkpoint)")
    exp.add_argument("--force", action="store_true", help="replace a non-empty --hf-out")
    exp.add_argument("--fp8", action="store_true", help="write block-FP8 (e4m3, 128x128 weight_scale_inv)")
    exp.add_argument("--shard-gb", type=float, default=5.0, help="max safetensors shard size")
    ver = sub.add_parser("verify", help="logit parity of transformers and our model on the same tokens (CPU, fp32)")
    ver.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ver.add_argument("--ckpt", help="megatron checkpoint (train.py or import; default: --hf mapped in memory)")
    ver.add_argument("--model", help="conf/model name or yaml file (default: from --ckpt, else config.json)")
    ver.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens in the batch (a multiple of --seq-len)")
    ver.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    ver.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ver.add_argument("--packed", action="store_true", help="our model sees the sequences as THD documents of one row")
    ver.add_argument("--max-delta", type=float, help="bound on max |Δlogit| (default: derived, printed)")
    ver.add_argument("--skip-mtp", action="store_true",
                     help="leave out the checkpoint's MTP layers, as import --skip-mtp does (they do not change the logits)")
    args = parser.parse_args(argv)
    mmap_large_allocations()
    try:
        if args.command == "import":
            import_hf(args.hf, args.out, args.model, args.force, args.skip_mtp)
        elif args.command == "verify":
            report = verify_hf(args.hf, args.ckpt, args.model, tokens=args.tokens, seq_len=args.seq_len,
                               seed=args.seed, packed=args.packed, max_delta=args.max_delta,
                               skip_mtp=args.skip_mtp)
        else:
            export_hf(args.ckpt, args.hf_out, args.model, args.fp8, int(args.shard_gb * 2**30), args.force)
    except Exception as err:  # noqa: BLE001 (every failure of a conversion: one line naming its file)
        sys.exit(one_line(err))
    if args.command == "verify" and not report.passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
