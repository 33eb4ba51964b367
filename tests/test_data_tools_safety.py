"""Data tools never overwrite without ``--force`` and fail in one line naming the file (issue 34)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.hf.convert_checks import (
    ConversionInputError,
    check_export_paths,
    check_single_checkpoint,
    one_line,
)
from tests.test_data import ALPHA, _load_script, corpus  # noqa: F401
from tests.test_drift import _load_report_module


def test_preprocess_refuses_to_replace_a_dataset_without_force(corpus, tmp_path: Path) -> None:  # noqa: F811
    """The old bug: a second run with the same --output-prefix replaced the dataset, exit 0."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in ALPHA))
    args = ["--input", str(jsonl), "--tokenizer", str(corpus.tok_dir), "--output-prefix", str(tmp_path / "d")]
    _load_script().main(args)
    bin_file = tmp_path / "d_text_document.bin"
    before = (bin_file.read_bytes(), bin_file.stat().st_mtime_ns)
    jsonl.write_text(json.dumps({"text": "other text"}) + "\n")
    with pytest.raises(SystemExit) as exited:
        _load_script().main(args)
    assert str(exited.value.code).startswith(f"error: {bin_file} exists") and "--force" in str(exited.value.code)
    assert (bin_file.read_bytes(), bin_file.stat().st_mtime_ns) == before
    _load_script().main(args + ["--force"])
    assert bin_file.read_bytes() != before[0]


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_preprocess_refuses_fewer_than_one_worker(workers: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        _load_script().parse_args(["--input", "x", "--tokenizer", "t", "--output-prefix", "p", "--workers", workers])
    assert exited.value.code == 2
    assert f"--workers {workers}: allowed: an integer >= 1" in capsys.readouterr().err


def test_export_refuses_to_write_into_its_own_checkpoint(tmp_path: Path) -> None:
    """The old bug: ``export --ckpt X --hf-out X --force`` replaced the checkpoint by its export."""
    ckpt = tmp_path / "iter_0000003"
    ckpt.mkdir()
    for hf_out, says in ((ckpt, "is --ckpt"), (ckpt / "hf", "is inside --ckpt"), (tmp_path, "--ckpt .* is inside --hf-out")):
        with pytest.raises(ConversionInputError, match=says):
            check_export_paths(ckpt, hf_out)
    check_export_paths(ckpt, tmp_path / "hf")  # a sibling is fine


def test_export_of_a_run_dir_or_checkpoint_root_names_the_checkpoint_to_pass(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        (root / f"iter_{step:07d}").mkdir(parents=True)
    (root / "latest").write_text("iter_0000002")
    with pytest.raises(ConversionInputError, match=f"is a run directory, not one checkpoint: .*--ckpt {root}/iter_0000002"):
        check_single_checkpoint(tmp_path / "run")
    (root / "latest").write_bytes(b"\xff\xfe")  # malformed latest: the newest checkpoint is offered
    with pytest.raises(ConversionInputError, match=f"is a checkpoint root, .*--ckpt {root}/iter_0000004"):
        check_single_checkpoint(root)
    with pytest.raises(ConversionInputError, match="no such checkpoint directory"):
        check_single_checkpoint(tmp_path / "absent")
    check_single_checkpoint(root / "iter_0000004")


def test_one_line_errors_name_the_file() -> None:
    err = PermissionError(13, "Permission denied")
    err.filename = "/out/dir"
    assert one_line(err) == "error: PermissionError: [Errno 13] Permission denied: '/out/dir'"
    wrapped = RuntimeError("Traceback (most recent call last):\n  File x\nValueError: shard /c/0.distcp truncated")
    assert one_line(wrapped) == "error: RuntimeError: ValueError: shard /c/0.distcp truncated"


@pytest.mark.parametrize("command,flag", [("import", "--out"), ("export", "--hf-out")])
def test_an_unwritable_output_is_named_by_its_flag_not_the_temp_dir(command: str, flag: str,
                                                                     tmp_path: Path) -> None:
    """The old bug: an output below a file failed with a traceback naming ``.<name>.tmp-<pid>``,
    a directory the user never gave."""
    from scripts.convert_checkpoint import main

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker / "converted"
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    args = (["import", "--hf", str(tmp_path), "--out", str(out)] if command == "import"
            else ["export", "--ckpt", str(ckpt), "--hf-out", str(out)])
    with pytest.raises(SystemExit) as exited:
        main(args)
    message = str(exited.value.code)
    assert message == (f"error: ConversionInputError: {flag} {out}: cannot create it, {blocker} is a "
                       f"file, not a directory; choose another {flag}")
    assert ".tmp" not in message and not any(p.name.startswith(".") for p in tmp_path.iterdir())


@pytest.mark.parametrize("content,line", [
    (b'{"step": 1, "loss": 2.0}\n\x00\x01\xffbinary\n{"step": 2}\n', 2),
    (b'{"step": 1}\nnot json\n{"step": 2}\n', 2),
    (b'{"step": 1}\n[1, 2]\n', 2),
    (b'{"step": "one"}\n', 1),
])
def test_drift_report_names_file_and_line_of_a_malformed_metrics_jsonl(
        tmp_path: Path, content: bytes, line: int) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(content)
    with pytest.raises(SystemExit) as exited:
        _load_report_module().main([str(tmp_path)])
    assert str(exited.value.code).startswith(f"error: {tmp_path / 'metrics.jsonl'}:{line}: ")


def test_truncated_or_missing_shards_are_named_before_converting(tmp_path: Path) -> None:
    """The old bug: a 4-byte or truncated shard was a raw traceback (``struct.error``) found
    mid-conversion; a missing shard failed only when its first tensor was read."""
    import torch
    from safetensors.torch import save_file

    from recipes.hf.io import HFReader, SafetensorsFile

    save_file({"a": torch.ones(64), "b": torch.zeros(8)}, str(tmp_path / "s1.safetensors"))
    save_file({"c": torch.ones(4)}, str(tmp_path / "s2.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert HFReader(tmp_path).get("c").tolist() == [1.0] * 4
    full = (tmp_path / "s1.safetensors").read_bytes()
    (tmp_path / "s1.safetensors").write_bytes(full[:4])
    with pytest.raises(ValueError, match=r"s1.safetensors: 4 bytes, too short"):
        SafetensorsFile(tmp_path / "s1.safetensors")
    (tmp_path / "s1.safetensors").write_bytes(full[:-16])  # the last 4 floats of "b" cut off
    with pytest.raises(ValueError, match=rf"s1.safetensors: {len(full) - 16} bytes, its header describes {len(full)}"):
        HFReader(tmp_path)  # at open, before any tensor is converted
    (tmp_path / "s1.safetensors").write_bytes(full)
    (tmp_path / "s2.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"s2.safetensors: missing \(listed in model.safetensors.index.json\)"):
        HFReader(tmp_path)


def test_a_yaml_that_is_not_a_model_config_is_named(tmp_path: Path) -> None:
    from scripts.convert_checkpoint import model_group

    train_yaml = Path(__file__).resolve().parents[1] / "conf" / "train" / "default.yaml"
    with pytest.raises(ValueError, match=rf"--model {train_yaml}: not a model config \(Key 'steps' not in"):
        model_group(str(train_yaml))


def test_drift_report_with_an_unmatched_prefix_names_the_prefixes_found(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "dsa/topk_overlap/layer_1": 0.9}) + "\n")
    assert _load_report_module().main([str(tmp_path), "--prefix", "dsx"]) == 0
    err = capsys.readouterr().err
    assert "no 'dsx/<metric>/layer_<i>' keys in" in err and "per-layer prefixes found: dsa (--prefix)" in err
