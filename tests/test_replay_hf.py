"""Rollout records from a transformers GLM-5 model (``scripts/record_rollout.py --hf``,
``recipes/replay/hf_recorder.py``): a tiny random ``glm_moe_dsa`` checkpoint, imported with
``convert_checkpoint.py``'s import, recorded by transformers and replayed in our model: the
attention reads exactly HF's selection, the routers HF's experts, and the logprob gap is within
fp32 reordering (the two models compute the same function in other op orders)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from recipes.replay.dataset import RolloutDataset  # noqa: E402
from recipes.replay.hf_recorder import HFCapture, load_hf_model, to_record_topk  # noqa: E402
from recipes.config.typed import to_config  # noqa: E402
from tests.test_config import _compose  # noqa: E402
from tests.test_replay import TINY  # noqa: E402
from tests.train_runner import ROOT, subprocess_env  # noqa: E402

HF_GAP_TOL = 1e-5
"""Same selections and routing: the models differ only in op order (HF's dense masked attention
vs our gathered sparse one, fused vs split projections), i.e. reordered fp32 sums. A reordered sum
of n terms moves by at most (n - 1) * eps * sum|terms| (Higham, 2nd ed., section 4.2), in practice
~sqrt(n) * eps (random-walk roundings): with n <= 256 here, ~2e-6 relative per op, ~1e-6 on a
logprob of ~6 through 4 layers (|d logp| <= 2 max|d logit|); tests/test_hf_interop.py measures a
4.6e-7 logit error. A lost selection moves logprobs by >= 1e-3 (tests/test_replay.py)."""


def hf_checkpoint(root: Path) -> tuple[Path, Path, list[str]]:
    """A tiny random glm_moe_dsa checkpoint (glm5_tiny's shapes) and its import: (HF dir, import,
    train.py overrides that build and load it)."""
    from scripts.convert_checkpoint import import_hf
    from tests.test_hf_interop import save_tiny

    hf_dir = save_tiny(root / "hf", index_n_heads=4)
    import_hf(hf_dir, root / "ckpt", model="glm5_tiny")
    # transformers' glm_moe_dsa builds its MLA latent norms with eps 1e-6 (docs/hf_interop.md)
    return hf_dir, root / "ckpt", [f"train.load={root / 'ckpt'}", "model.mla_latent_norm_epsilon=1e-6"]


def replay_first_row(cfg, dataset: RolloutDataset) -> tuple[dict, torch.Tensor, dict[int, torch.Tensor]]:  # noqa: ANN001
    """Our model replaying ``dataset``'s first record (``cfg``: a rollout config with replay on):
    the row, its per-token loss and, per DSA layer number, the key indices its attention read."""
    from recipes.replay.recorder import build_recording_model
    from recipes.replay.step import RolloutStep

    model = build_recording_model(cfg)
    model.config.dsa_topk_replay = True
    attended: dict[int, torch.Tensor] = {}
    handles = [m.core_attention.register_forward_hook(
        lambda mod, args, output, n=m.layer_number: attended.__setitem__(n, args[2][0]))
        for m in model.modules() if type(m).__name__ == "GLMSparseMLA"]
    step = RolloutStep(cfg, model)
    step.begin(measure=False)
    row = {k: v.unsqueeze(0) for k, v in dataset[0].items()}
    with torch.enable_grad():
        loss = model(row["tokens"], row["position_ids"], None, labels=row["labels"],
                     packed_seq_params=step.prepare(row)).detach()[0]
    for h in handles:
        h.remove()
    return row, loss, attended


def test_hf_records_replay_hf_selection_within_fp32_reordering(tmp_path: Path, single_rank_parallel_state) -> None:
    hf_dir, _, load = hf_checkpoint(tmp_path)
    out = tmp_path / "rollouts"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_rollout.py"), "--hf", str(hf_dir),
                           "--out", str(out), "--num-samples", "3", "--min-length", "20", "--max-length", "30"],
                          cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = to_config(_compose(TINY + load + ["data=rollout", f"data.rollout_dir={out}", "model.dsa_topk_replay=true",
                                            "model.moe_router_replay=true"]))
    dataset = RolloutDataset(cfg)  # validated against our model: layers, widths, ranges, metadata
    record = dataset.records[0]
    assert sorted(record.topk) == [1, 2, 3, 4] and sorted(record.experts) == [2, 3, 4]

    # HF's own selection of the first sample, as its attention uses it (indices after the query
    # masked), per query as a set.
    hf = load_hf_model(hf_dir)
    capture = HFCapture(hf)
    with torch.no_grad():
        hf(input_ids=record.tokens[None], use_cache=False)
    capture.remove()
    s = record.length
    for layer, idx in capture.topk.items():
        raw = idx[0].long()
        want = [set(raw[i][raw[i] <= i].tolist()) for i in range(s)]
        assert [set(r[r >= 0].tolist()) for r in to_record_topk(idx, 16)] == want
    # Our model replaying the records: every attention reads HF's selection.
    row, loss, attended = replay_first_row(cfg, dataset)
    for layer, idx in capture.topk.items():
        raw = idx[0].long()
        got = attended[layer][:s]  # the first sample is at the row's start
        assert [set(r[r >= 0].tolist()) for r in got] == [set(raw[i][raw[i] <= i].tolist()) for i in range(s)]
    mask = row["has_rollout_logprobs"][0]
    gap = (-loss[mask] - row["rollout_logprobs"][0][mask]).abs()
    assert 0 < gap.max() <= HF_GAP_TOL, gap.max()  # nonzero: other ops, the records are HF's


G5N_TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, v_head_dim=16,
                qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=4, index_kpool=4,
                index_kpool_always_select_tail=True, mlp_layer_types=["dense", "sparse", "sparse"],
                indexer_types=["full"] * 3, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                max_position_embeddings=256, hc_mult=2, pad_token_id=0)
"""A tiny GLM-5.3 (glm5_next) text stack: NoPE, KPool 4 with the tail, MoE after the first layer."""


@pytest.mark.parametrize("layer_types,topk_layers", [
    (["indexed_attention"] * 3, [1, 2, 3]),
    (["indexed_attention", "linear_attention", "indexed_attention"], [1, 3]),
], ids=["indexed", "with-kda"])
def test_glm5_next_records_hold_its_kpool_selection(tmp_path: Path, layer_types: list[str],
                                                    topk_layers: list[int]) -> None:
    """glm5_next's indexer already returns token indices (its pools expanded, then the tail,
    ``-1``-padded): the record holds them unchanged, in our width; a KDA layer has no top-k but
    its routing is recorded. The records validate against the model config the import derives
    from the same config.json (KDA layers hold no top-k)."""
    from omegaconf import OmegaConf

    from recipes.config.schema import Config
    from recipes.hf.config import model_config_from_hf, text_config
    from recipes.replay.dataset import model_layers
    from recipes.replay.hf_recorder import record_hf_rollouts
    from recipes.replay.records import read_record

    cfg = transformers.Glm5NextConfig(
        text_config={**G5N_TEXT, "layer_types": layer_types},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    transformers.Glm5NextForConditionalGeneration(cfg).float().save_pretrained(tmp_path / "hf")
    hf = load_hf_model(tmp_path / "hf")
    tokens = torch.randint(0, 299, (23,), generator=torch.Generator().manual_seed(3))
    (path,) = record_hf_rollouts(hf, [tokens], tmp_path / "rollouts")
    capture = HFCapture(hf)
    with torch.no_grad():
        hf(input_ids=tokens[None], use_cache=False)
    capture.remove()
    assert sorted(capture.topk) == topk_layers and sorted(capture.experts) == [2, 3]
    from safetensors.torch import load_file

    stored = load_file(path)
    assert sorted(k for k in stored if k.startswith("indexer_topk")) == [f"indexer_topk.layer_{n}" for n in topk_layers]
    for n in topk_layers:
        assert torch.equal(stored[f"indexer_topk.layer_{n}"], capture.topk[n][0]), n  # [s, 8 + 3]
    for n in (2, 3):
        assert torch.equal(stored[f"routed_experts.layer_{n}"].long(), capture.experts[n]), n
    derived = model_config_from_hf(text_config(json.loads((tmp_path / "hf" / "config.json").read_text())), "g5n")
    ours = to_config(OmegaConf.merge(OmegaConf.structured(Config), {"model": derived})).model
    record = read_record(path, model_layers(ours), require_topk=True, require_experts=True)
    assert sorted(record.topk) == topk_layers and record.topk[1].shape == (23, 11)


def test_hf_recorder_refuses_other_models_and_overrides(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from scripts.record_rollout import main

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit):
        main(["--hf", str(tmp_path / "llama"), "--out", str(tmp_path / "out")])
    assert "model_type 'llama' is not supported; allowed: glm_moe_dsa, glm5_next" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--hf", str(tmp_path / "llama"), "--out", str(tmp_path / "out"), "model=glm5_tiny"])
    assert "--hf takes no overrides" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_glm53_records_replay_in_our_model(tmp_path: Path, single_rank_parallel_state) -> None:
    """A tiny random GLM-5.3 text checkpoint (KDA / DSA alternating, 4 mHC streams, KPool 4 with
    the tail; ``glm5_next_text``, the layout ``convert_checkpoint.py`` imports): recorded by
    transformers, imported, and replayed in our model. Every DSA layer's attention reads exactly
    HF's selection, the routers HF's experts, and the logprob gap is within :data:`HF_GAP_TOL`
    (the same fp32-reordering argument: the KDA and mHC layers match transformers' to 8e-6 of
    max |logit| in tests/test_glm53_model.py)."""
    from omegaconf import OmegaConf

    from scripts.convert_checkpoint import import_hf
    from tests.test_hf_verify import save_glm5_next

    hf_dir = save_glm5_next(tmp_path / "hf", layers="kda_dsa_hc4")
    derived = import_hf(hf_dir, tmp_path / "ckpt")
    out = tmp_path / "rollouts"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "record_rollout.py"), "--hf", str(hf_dir),
                           "--out", str(out), "--num-samples", "2", "--min-length", "20", "--max-length", "30"],
                          cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    base = _compose(["precision=fp32", "data.seq_length=64", f"train.load={tmp_path / 'ckpt'}", "data=rollout",
                     f"data.rollout_dir={out}"])
    replay = {"dsa_topk_replay": True, "moe_router_replay": True}
    cfg = to_config(OmegaConf.merge(base, {"model": {**OmegaConf.to_container(derived), **replay}}))
    dataset = RolloutDataset(cfg)
    record = dataset.records[0]
    assert sorted(record.topk) == [2, 4] and sorted(record.experts) == [2, 3, 4]  # KDA layers 1, 3: no top-k

    row, loss, attended = replay_first_row(cfg, dataset)
    s = record.length
    assert sorted(attended) == [2, 4]
    for layer, want in record.topk.items():
        got = attended[layer][:s]
        assert [set(r[r >= 0].tolist()) for r in got] == [set(r[r >= 0].tolist()) for r in want], layer
    mask = row["has_rollout_logprobs"][0]
    gap = (-loss[mask] - row["rollout_logprobs"][0][mask]).abs()
    assert 0 < gap.max() <= HF_GAP_TOL, gap.max()
