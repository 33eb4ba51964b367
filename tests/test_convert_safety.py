"""Issue #14, conversion: atomic output, no silent overwrite, shapes checked, model config found in
the checkpoint, source recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from recipes.checkpoint.manifest import verify
from scripts.convert_checkpoint import export_hf, import_hf
from tests.test_hf_interop import save_tiny


@pytest.fixture
def imported(tmp_path: Path, single_rank_parallel_state) -> tuple[Path, Path]:
    """(HF dir, its import) of the tiny model, imported with ``--model glm5_tiny``."""
    hf_dir = save_tiny(tmp_path / "hf", index_n_heads=4)
    import_hf(hf_dir, tmp_path / "ckpt", model="glm5_tiny")
    return hf_dir, tmp_path / "ckpt"


def test_import_refuses_a_non_empty_target_and_force_replaces_it_atomically(
        imported: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, ckpt = imported
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    with pytest.raises(FileExistsError, match="--force"):
        import_hf(hf_dir, ckpt, model="glm5_tiny")
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
    import_hf(hf_dir, ckpt, model="glm5_tiny", force=True)
    assert verify(ckpt) is not None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_import_without_config_json_uses_model_and_records_its_source(
        tmp_path: Path, single_rank_parallel_state) -> None:
    hf_dir = save_tiny(tmp_path / "hf", index_n_heads=4)
    (hf_dir / "config.json").unlink()
    with pytest.raises(ValueError, match="--model is required"):
        import_hf(hf_dir, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    import_hf(hf_dir, tmp_path / "ckpt", model="glm5_tiny")
    record = json.loads((tmp_path / "ckpt" / "conversion.json").read_text())
    assert record["direction"] == "import" and record["source"] == str(hf_dir.resolve())
    assert record["code_version"] and verify(tmp_path / "ckpt")["config"]["model"]["hidden_size"] == 128


def test_export_refuses_a_model_of_other_shapes_instead_of_padding(
        imported: tuple[Path, Path], tmp_path: Path) -> None:
    _, ckpt = imported
    bigger = tmp_path / "bigger.yaml"
    tiny = (Path(__file__).resolve().parents[1] / "conf/model/glm5_tiny.yaml").read_text()
    bigger.write_text(tiny.replace("vocab_size: 512", "vocab_size: 1024"))
    with pytest.raises(ValueError, match=r"embedding\.word_embeddings\.weight: checkpoint \(512, 128\), "
                                         r"model \(1024, 128\) \(model\.vocab_size\)"):
        export_hf(ckpt, tmp_path / "bad", model=str(bigger))
    assert not (tmp_path / "bad").exists()
    export_hf(ckpt, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert record["direction"] == "export" and record["source"] == str(ckpt.resolve())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 512


def test_export_of_a_corrupted_checkpoint_names_the_file(imported: tuple[Path, Path], tmp_path: Path) -> None:
    _, ckpt = imported
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match=f"{shard.name}: checksum mismatch"):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
