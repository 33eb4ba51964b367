"""``convert_checkpoint.py verify``: logit parity of transformers and our model on one HF
checkpoint (``recipes.hf.verify``), run in process through the CLI's ``main`` (exit code and the
printed figures): a round trip passes with and without ``--ckpt``, unpacked and packed; a
checkpoint whose tensor was perturbed beyond the bound fails with its figures printed; bad inputs
are one-line errors naming the flag or file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from scripts.convert_checkpoint import import_hf, main  # noqa: E402
from tests.test_hf_interop import TINY, safetensors_of, save_tiny  # noqa: E402

SEQ = 32  # > index_topk 16: the indexer's selection is exercised


def run_verify(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """Exit code and stdout + stderr of ``convert_checkpoint.py verify ARGS``."""
    capsys.readouterr()  # drop what came before
    try:
        main(["verify", *args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
        if not isinstance(exit_.code, int):
            print(exit_.code)
    out = capsys.readouterr()
    return code, out.out + out.err


def figure(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}\s+([0-9.e+-]+)", text, re.M).group(1))


def test_round_trip_passes_with_and_without_ckpt(tmp_path: Path, single_rank_parallel_state,
                                                 capsys: pytest.CaptureFixture) -> None:
    hf_dir = save_tiny(tmp_path / "hf", index_topk_freq=2, index_skip_topk_offset=1)
    code, out = run_verify(capsys, "--hf", str(hf_dir), "--tokens", str(2 * SEQ), "--seq-len", str(SEQ))
    assert code == 0 and re.search(r"^PASS$", out, re.M), out
    assert "transformers GlmMoeDsaForCausalLM vs ours" in out and "mapped in memory" in out
    assert "top-1 agree    64/64 (100.00%)" in out
    # The bound printed is 2 * 8 * 2^-24 * sqrt((14 * 4 layers + 2) * 256) * max |logit|.
    max_logit = float(re.search(r"max \|logit\| ([0-9.e+-]+)", out).group(1))
    assert figure(out, "bound") == pytest.approx(16 * 2**-24 * (58 * 256) ** 0.5 * max_logit, rel=1e-3)
    assert figure(out, "max |Δlogit|  ") < figure(out, "bound") / 10  # measured 5e-7 against 1.2e-4

    import_hf(hf_dir, tmp_path / "ckpt")
    code, out = run_verify(capsys, "--hf", str(hf_dir), "--ckpt", str(tmp_path / "ckpt"), "--packed",
                           "--tokens", str(2 * SEQ), "--seq-len", str(SEQ), "--seed", "3")
    assert code == 0 and re.search(r"^PASS$", out, re.M), out
    assert "packed as THD documents" in out and f"--ckpt {tmp_path / 'ckpt'}" in out


def test_perturbed_checkpoint_fails_with_its_figures(tmp_path: Path, single_rank_parallel_state,
                                                     capsys: pytest.CaptureFixture) -> None:
    hf_dir = save_tiny(tmp_path / "hf")
    # The megatron checkpoint of the same weights but one: the last layer's shared-expert down
    # projection (every token passes through it) scaled by 1 + 1e-2 moves the logits by 1.5e-3,
    # 14x the bound (1.1e-4 at max |logit| 0.92). Measured: 1 + 1e-3 gives 1.5e-4 (fails, just),
    # 1 + 1e-5 gives 1.6e-6 (passes).
    shutil.copytree(hf_dir, tmp_path / "hf_perturbed")
    tensors = load_file(hf_dir / "model.safetensors")
    name = "model.layers.3.mlp.shared_experts.down_proj.weight"
    tensors[name] = tensors[name] * (1 + 1e-2)
    save_file(tensors, tmp_path / "hf_perturbed" / "model.safetensors", metadata={"format": "pt"})
    import_hf(tmp_path / "hf_perturbed", tmp_path / "ckpt")
    args = ["--hf", str(hf_dir), "--ckpt", str(tmp_path / "ckpt"), "--tokens", str(2 * SEQ), "--seq-len", str(SEQ)]
    code, out = run_verify(capsys, *args)
    assert code == 1, out
    delta, bound = figure(out, "max |Δlogit|  "), figure(out, "bound")
    assert delta > bound and f"FAIL: max |Δlogit| {delta:.3e} > bound {bound:.3e}" in out
    assert "mean |Δlogit|" in out and "top-1 agree" in out and "over the bound: " in out
    assert "top-k tie" not in out  # every position moves: not the tie signature
    code, out = run_verify(capsys, *args, "--max-delta", "1.0")  # the override
    assert code == 0 and "bound          1.000e+00  (--max-delta)" in out, out


def test_errors_name_the_flag_or_file(tmp_path: Path, single_rank_parallel_state,
                                      capsys: pytest.CaptureFixture) -> None:
    code, out = run_verify(capsys, "--hf", str(tmp_path / "absent"))
    assert code == 1 and f"--hf {tmp_path / 'absent'}: no such HF checkpoint directory" in out

    hf_dir = save_tiny(tmp_path / "hf")
    code, out = run_verify(capsys, "--hf", str(hf_dir), "--tokens", "50", "--seq-len", str(SEQ))
    assert code == 1 and "--tokens 50: must be a positive multiple of --seq-len 32" in out
    code, out = run_verify(capsys, "--hf", str(hf_dir), "--ckpt", str(tmp_path / "nockpt"))
    assert code == 1 and f"--ckpt {tmp_path / 'nockpt'}: no such checkpoint directory" in out

    other = save_tiny(tmp_path / "other", index_topk=8, num_hidden_layers=3)
    import_hf(other, tmp_path / "other_ckpt")
    code, out = run_verify(capsys, "--hf", str(hf_dir), "--ckpt", str(tmp_path / "other_ckpt"))
    assert code == 1 and [line for line in out.splitlines() if "error" in line] == [out.strip()], out
    assert f"--ckpt {tmp_path / 'other_ckpt'} is another model than --hf {hf_dir / 'config.json'} (2 keys)" in out
    assert "num_layers: checkpoint 3, config.json 4" in out and "dsa_indexer_topk: checkpoint 8, config.json 16" in out

    config = json.loads((hf_dir / "config.json").read_text())
    for key, value, message in [("model_type", "llama", "model_type='llama' has no transformers reference for "
                                 "verify; allowed: glm_moe_dsa, glm5_next_text"),
                                ("n_group", 8, "HF config n_group/topk_group=(8, 1) is not supported")]:
        (hf_dir / "config.json").write_text(json.dumps({**config, key: value}))
        code, out = run_verify(capsys, "--hf", str(hf_dir))
        assert code == 1 and message in out and len(out.strip().splitlines()) == 1, out
        assert out.startswith("error: ValueError: "), out


def test_train_checkpoint_and_its_export_agree(tmp_path: Path, single_rank_parallel_state,
                                               capsys: pytest.CaptureFixture) -> None:
    """A checkpoint ``train.py`` wrote, against its own export. glm5_tiny's 4 indexer heads leave
    many keys with a ReLU score of exactly 0 after one step, so at seq_len 32 > index_topk 16 the
    two implementations break top-k ties differently at a few positions (measured: 15 of 64, the
    others at 3.6e-7); at seq_len 16 the selection is dense and the rest of the model agrees."""
    from scripts.convert_checkpoint import export_hf
    from tests.train_runner import run_train

    run_train(tmp_path, "run", ["model=glm5_tiny", "model.mla_latent_norm_epsilon=1e-6", "precision=fp32",
                                "data.seq_length=32", "train.steps=1", "train.lr_warmup_steps=0",
                                "logging.mode=disabled", "train.micro_batch_size=2", "train.global_batch_size=2"])
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000001"
    export_hf(ckpt, tmp_path / "hf")
    code, out = run_verify(capsys, "--hf", str(tmp_path / "hf"), "--ckpt", str(ckpt), "--tokens", "64", "--seq-len", "16")
    assert code == 0 and re.search(r"^PASS$", out, re.M) and "is not exercised" in out, out
    code, out = run_verify(capsys, "--hf", str(tmp_path / "hf"), "--ckpt", str(ckpt), "--tokens", "64", "--seq-len", "32")
    assert code == 1 and "top-k tie broken differently" in out, out


GLM5_NEXT_LAYERS = {  # (layer_types, hc_mult)
    "dsa_hc1": (["indexed_attention"] * 4, 1),
    "kda_dsa_hc4": (["linear_attention", "indexed_attention"] * 2, 4),
}


def save_glm5_next(path: Path, seed: int = 0, layers: str = "dsa_hc1") -> Path:
    """A random tiny ``Glm5NextTextModel`` (``GLM5_NEXT_LAYERS[layers]``: all layers
    ``indexed_attention`` with one mHC stream, or KDA / DSA alternating with 4 streams; KPool 4
    with the tail) in the causal-LM layout the import reads: ``model.``-prefixed tensors and an
    ``lm_head.weight``."""
    layer_types, hc_mult = GLM5_NEXT_LAYERS[layers]
    cfg = transformers.Glm5NextTextConfig(
        **{k: v for k, v in TINY.items() if k not in ("qk_rope_head_dim", "rope_parameters", "first_k_dense_replace")},
        index_kpool=4, index_kpool_always_select_tail=True, layer_types=layer_types,
        mlp_layer_types=["dense"] + ["sparse"] * 3, hc_mult=hc_mult, linear_num_heads=4, linear_head_dim=16,
        pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Glm5NextTextModel(cfg).float()
    model.save_pretrained(path / "base")
    tensors = {f"model.{k}": v for k, v in load_file(path / "base" / "model.safetensors").items()}
    tensors["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    shutil.move(path / "base" / "config.json", path / "config.json")
    shutil.rmtree(path / "base")
    return path


@pytest.mark.parametrize("layers", list(GLM5_NEXT_LAYERS))
def test_glm5_next_round_trip_passes(tmp_path: Path, single_rank_parallel_state, layers: str) -> None:
    from scripts.convert_checkpoint import verify_hf

    hf_dir = save_glm5_next(tmp_path / "hf", layers=layers)
    report = verify_hf(hf_dir, tokens=2 * SEQ, seq_len=SEQ)
    assert report.passed, report.lines()
    import_hf(hf_dir, tmp_path / "ckpt")
    report = verify_hf(hf_dir, tmp_path / "ckpt", tokens=2 * SEQ, seq_len=SEQ, packed=True)
    assert report.passed, report.lines()


def test_transformers_side_loads_every_tensor_or_names_it(tmp_path: Path) -> None:
    """The glm5_next family loads the causal-LM layout (``lm_head.weight`` is read by its logits
    function, not by ``Glm5NextTextModel``); a tensor transformers would drop or leave at its initial
    value is a KeyError naming it."""
    from recipes.hf.io import HFReader
    from recipes.hf.verify import FAMILIES, load_transformers, read_hf_config

    hf_dir = save_glm5_next(tmp_path / "hf")
    config, fam = read_hf_config(hf_dir), FAMILIES["glm5_next_text"]
    reader = HFReader(hf_dir)
    model = load_transformers(hf_dir, config, fam, reader, 4)
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = fam.logits(model, ids, reader, config)
    assert logits.shape == (1, 8, 512) and torch.isfinite(logits).all()
    reader.close()
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    del tensors["model.layers.2.post_attention_layernorm.weight"]
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"unexpected \['model.layers.0.self_attn.bogus.weight'\].*missing .*"
                                        r"layers.2.post_attention_layernorm.weight"):
        load_transformers(hf_dir, config, fam, HFReader(hf_dir), 4)


H = TINY["hidden_size"]
MTP_TENSORS = {  # the DeepSeek-V3-layout MTP layer a checkpoint stores after its 4 decoder layers
    "model.layers.4.enorm.weight": (H,), "model.layers.4.hnorm.weight": (H,),
    "model.layers.4.eh_proj.weight": (H, 2 * H), "model.layers.4.shared_head.norm.weight": (H,),
    "model.layers.4.self_attn.q_a_proj.weight": (TINY["q_lora_rank"], H),
    "model.layers.4.mlp.gate.weight": (TINY["n_routed_experts"], H),
}


@pytest.mark.parametrize("config_field", [False, True], ids=["tensors_only", "num_nextn_predict_layers"])
def test_glm5_next_mtp_layer_converts_only_when_skipped(tmp_path: Path, single_rank_parallel_state,
                                                        capsys: pytest.CaptureFixture, config_field: bool) -> None:
    """GLM-5.3's checkpoint stores an MTP layer (``model.layers.45.*``) that transformers'
    ``Glm5NextTextModel`` ignores and our glm5_next model does not build: import and verify name it
    and ``--skip-mtp``; with the flag the import leaves out exactly those tensors (listed in
    conversion.json), its export is the checkpoint without them bit for bit, and verify passes."""
    from scripts.convert_checkpoint import export_hf, verify_hf

    hf_dir = save_glm5_next(tmp_path / "hf", layers="kda_dsa_hc4")
    plain = load_file(hf_dir / "model.safetensors")
    save_file({**plain, **{k: torch.randn(shape) for k, shape in MTP_TENSORS.items()}},
              hf_dir / "model.safetensors", metadata={"format": "pt"})
    if config_field:
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "refused")])
    message = str(refused.value.code)
    assert "--skip-mtp converts without the checkpoint's MTP layers" in message, message
    assert ("num_nextn_predict_layers=1" if config_field else
            "6 of the unknown tensors belong to layers past the model's 4 (model.layers.4.*") in message
    assert not (tmp_path / "refused").exists()
    code, out = run_verify(capsys, "--hf", str(hf_dir), "--tokens", str(2 * SEQ), "--seq-len", str(SEQ))
    assert code == 1 and "--skip-mtp" in out, out

    main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "ckpt"), "--skip-mtp"])
    assert "--skip-mtp: left out 6 tensors of layers past the model's 4" in capsys.readouterr().out
    record = json.loads((tmp_path / "ckpt" / "conversion.json").read_text())
    assert record["skipped_mtp_tensors"] == sorted(MTP_TENSORS) and record["model"]["mtp_num_layers"] == 0
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = safetensors_of(tmp_path / "out")
    assert sorted(exported) == sorted(plain) and all(torch.equal(exported[k], v) for k, v in plain.items())
    for ckpt in (None, tmp_path / "ckpt"):
        report = verify_hf(hf_dir, ckpt, skip_mtp=True, tokens=2 * SEQ, seq_len=SEQ)
        assert report.passed, report.lines()


def test_skip_mtp_derives_a_model_without_mtp_and_refuses_one_with() -> None:
    from recipes.hf.config import model_config_from_hf
    from scripts.convert_checkpoint import model_group

    config = {**transformers.GlmMoeDsaConfig(**TINY).to_dict(), "num_nextn_predict_layers": 1}
    assert model_config_from_hf(config, "x")["mtp_num_layers"] == 1
    assert model_config_from_hf(config, "x", skip_mtp=True)["mtp_num_layers"] == 0
    with pytest.raises(ValueError, match="--skip-mtp with --model glm5: its model.mtp_num_layers is 1"):
        model_group("glm5", skip_mtp=True)
