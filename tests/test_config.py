"""Config composition: every option of every group composes; invalid configs fail naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from kpool_layers.mla.attention import IndexerLossAutoScaler
from recipes.launch.distributed import register_resolvers
from recipes.config.megatron import to_transformer_config
from recipes.config.keys import UnknownKeyError, check_overrides
from recipes.config.schema import ConfigError, numeric_fields, register_configs
from recipes.config.rules import validate
from recipes.config.typed import to_config

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()
register_configs()


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in ("model", "precision", "parallelism", "data", "train", "logging", "experiment")
     for o in _options(g)],
)
def test_every_option_composes(group: str, option: str) -> None:
    cfg = _compose([f"{group}={option}"])
    if group in ("model", "precision", "parallelism", "data", "logging"):
        assert cfg[group].name == option
    world = cfg.parallelism.nodes * cfg.parallelism.gpus_per_node
    needs = {"indexed": "data.paths", "rollout": "data.rollout_dir"}  # data files the option needs
    if cfg.data.kind in needs and (group == "data" or not cfg.data.paths):
        with pytest.raises(ConfigError, match=needs[cfg.data.kind]):
            validate(cfg, world)
        return
    validate(cfg, world)
    tcfg = to_transformer_config(to_config(cfg))
    assert tcfg.num_layers == cfg.model.num_layers
    assert tcfg.q_lora_rank == cfg.model.q_lora_rank
    assert tcfg.dsa_indexer_kpool == cfg.model.dsa_indexer_kpool


def test_indexer_loss_scale_callback_is_installed_on_the_config() -> None:
    """megatron's schedules hand the loss scale to the indexer loss through the config's callback:
    set once when the config is made, iff the indexer loss is on."""
    off = to_transformer_config(to_config(_compose(["model=glm5_tiny"])))
    on = to_transformer_config(to_config(_compose(["model=glm5_tiny", "model.dsa_indexer_loss_coeff=0.5"])))
    assert off.experimental_attention_variant_loss_scale_func is None
    assert on.experimental_attention_variant_loss_scale_func == IndexerLossAutoScaler.set_loss_scale


def test_dense_model_drops_the_moe_sizes() -> None:
    """megatron refuses MoE sizes without experts: a dense model (``model.num_moe_experts=null``)
    gets none, a MoE model keeps them."""
    dense = to_transformer_config(to_config(_compose(["model=glm5_tiny", "model.num_moe_experts=null"])))
    assert dense.num_moe_experts is None and dense.moe_ffn_hidden_size is None
    assert dense.moe_shared_expert_intermediate_size is None
    assert to_transformer_config(to_config(_compose(["model=glm5_tiny"]))).moe_ffn_hidden_size == 64


def test_model_fields_map_one_to_one() -> None:
    tcfg = to_transformer_config(to_config(_compose(["model=glm5_2", "precision=bf16"])))
    assert (tcfg.hidden_size, tcfg.kv_lora_rank, tcfg.qk_head_dim, tcfg.v_head_dim) == (6144, 512, 192, 256)
    assert (tcfg.dsa_indexer_topk_freq, tcfg.dsa_indexer_skip_topk_offset) == (4, 3)
    assert tcfg.moe_layer_freq == [0, 0, 0] + [1] * 75
    assert tcfg.bf16 and tcfg.moe_router_dtype == "fp32" and tcfg.mtp_num_layers == 1


# (overrides, world size, key named in the message)
INVALID = [
    (["parallelism.tensor_model_parallel_size=3"], 3, "parallelism.tensor_model_parallel_size"),
    (["parallelism=tp2"], 3, "parallelism.tensor_model_parallel_size"),
    (["parallelism.pipeline_model_parallel_size=3", "train.global_batch_size=6"], 3,
     "parallelism.pipeline_model_parallel_size"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], 1, "train.global_batch_size"),
    (["train.global_batch_size=4", "train.micro_batch_size=2"], 4, "train.global_batch_size"),
    (["parallelism.expert_model_parallel_size=3", "train.global_batch_size=6"], 3,
     "parallelism.expert_model_parallel_size"),
    (["model.moe_router_topk=9"], 1, "model.moe_router_topk"),
    (["model.dsa_indexer_kpool=3"], 1, "model.dsa_indexer_kpool"),
    (["model.dsa_indexer_kpool=128", "model.dsa_indexer_topk=128"], 1, "model.dsa_indexer_kpool"),
    (["model.dsa_indexer_kpool=4", "model.dsa_indexer_topk=18"], 1, "model.dsa_indexer_topk"),
    (["model.dsa_indexer_head_dim=48"], 1, "model.dsa_indexer_head_dim"),
    (["model.qk_pos_emb_head_dim=7"], 1, "model.qk_pos_emb_head_dim"),
    # Context parallelism: 2 * CP (* TP under SP) chunks of the row; MTP rolls packed rows only at CP 1.
    (["parallelism.context_parallel_size=3"], 3, "data.seq_length"),
    (["parallelism=cp2", "parallelism.tensor_model_parallel_size=2", "data.seq_length=132"], 4,
     "data.seq_length"),
    (["parallelism=cp2", "model.mtp_num_layers=1", "data.reset_attention_mask=true",
      "train.micro_batch_size=1"], 2, "parallelism.context_parallel_size"),
    (["parallelism=tp2", "parallelism.sequence_parallel=false"], 2, "parallelism.sequence_parallel"),
    (["parallelism.sequence_parallel=true"], 1, "parallelism.sequence_parallel"),
    (["data.seq_length=8192"], 1, "data.seq_length"),
    (["data=indexed"], 1, "data.paths"),
    (["data=indexed", "data.paths=[x]"], 1, "data.tokenizer"),
    (["train.lr=-1"], 1, "train.lr"),
    (["train.lr_warmup_steps=30"], 1, "train.lr_warmup_steps"),
    (["train.steps=0"], 1, "train.steps"),
    (["model=glm5_2", "parallelism.pipeline_model_parallel_size=2"], 2,
     "parallelism.pipeline_model_parallel_size"),
    (["model.num_moe_experts=null", "parallelism.expert_model_parallel_size=2"], 2,
     "parallelism.expert_model_parallel_size"),
    # A pp2 preset launched as one process: the PP size is what does not fit, not TP.
    (["parallelism=pp2"], 1, "parallelism.pipeline_model_parallel_size"),
    # Out of their declared ranges (field metadata in recipes/config/schema.py).
    (["train.clip_grad=-1"], 1, "train.clip_grad"),
    (["model.vocab_size=1"], 1, "model.vocab_size"),
    (["train.adam_beta1=1.5"], 1, "train.adam_beta1"),
    (["train.weight_decay=-5"], 1, "train.weight_decay"),
    (["train.seed=-1"], 1, "train.seed"),
    (["data.num_workers=-1"], 1, "data.num_workers"),
    (["model.kv_lora_rank=-1"], 1, "model.kv_lora_rank"),
    (["model.dsa_indexer_n_heads=0"], 1, "model.dsa_indexer_n_heads"),
    (["model.mtp_num_layers=-1"], 1, "model.mtp_num_layers"),
    (["precision.drift.interval=-1"], 1, "precision.drift.interval"),
    # Keys added with + / ++ that nothing reads.
    (["+drift.interval=2"], 1, "drift.interval"),
    (["++train.step=4"], 1, "train.step"),
]


@pytest.mark.parametrize("overrides,world,key", INVALID, ids=[k for _, _, k in INVALID])
def test_invalid_config_names_the_key(overrides: list[str], world: int, key: str) -> None:
    cfg = _compose(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    assert err.value.key == key
    assert key in str(err.value) and ("allowed" in str(err.value) or "did you mean" in str(err.value))


@pytest.mark.parametrize(
    "override,key",
    [("model.foo=1", "model.foo"), ("train.steps=abc", "train.steps"),
     ("model.normalization=Foo", "model.normalization"), ("logging.mode=loud", "logging.mode"),
     ("data.kind=csv", "data.kind"), ("precision.dtype=fp64", "precision.dtype"),
     ("precision.backend=te", "precision.backend")],
)
def test_schema_rejects_unknown_keys_and_types(override: str, key: str) -> None:
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as err:
        _compose([override])
    text = str(err.value) + str(getattr(err.value, "__cause__", ""))
    assert key.split(".")[-1] in text


def test_every_numeric_key_declares_its_range() -> None:
    """A numeric field added without ``num(default, lo, hi)`` would escape the range checks."""
    fields = dict(numeric_fields())
    assert "precision.drift.interval" in fields and "train.seed" in fields
    missing = [key for key, f in fields.items() if "range" not in f.metadata]
    assert not missing, f"numeric schema keys without a range: {missing}"
    for key, f in fields.items():  # every default lies in its own range
        assert f.default is None or f.default in f.metadata["range"], key


@pytest.mark.parametrize("override,suggestion", [
    ("+drift.interval=2", "precision.drift.interval"),  # exists under another group
    ("train.step=4", "train.steps"),                    # a typo, no + (Hydra's struct error before)
    ("++model.num_experts=4", "model.num_moe_experts"),
    ("+kpool=4", "model.dsa_indexer_kpool"),
])
def test_unknown_key_suggests_the_closest(override: str, suggestion: str) -> None:
    with pytest.raises(UnknownKeyError) as err:
        check_overrides([override])
    assert err.value.suggestion == suggestion and f"did you mean {suggestion}?" in str(err.value)


def test_group_selections_and_hydra_keys_pass() -> None:
    check_overrides(["model=glm5_2", "+experiment=kpool_sweep", "hydra/launcher=slurm",
                     "hydra.run.dir=x", "model.dsa_indexer_kpool=1,2", "data.paths=[a,b]",
                     "~model.mscale"])


def _train_py(args: list[str], **env: str) -> subprocess.CompletedProcess:
    from tests.train_runner import ROOT, subprocess_env

    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120,
                          env=subprocess_env(OMP_NUM_THREADS="1", **env))


def test_config_error_is_one_paragraph_without_traceback(tmp_path: Path) -> None:
    proc = _train_py(["train.step=4"], KPOOL_RUN_ROOT=str(tmp_path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("Error: unknown config key train.step") and "did you mean train.steps?" in proc.stderr


def test_hydra_full_error_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.launch.console import config_errors

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError), config_errors(exit_on_error=True):
        check_overrides(["train.step=4"])
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    with pytest.raises(SystemExit) as exited, config_errors(exit_on_error=True):
        check_overrides(["train.step=4"])
    assert exited.value.code == 2


def test_glm5_2_pipeline_needs_uneven_stages_and_gets_a_suggestion() -> None:
    """78 layers do not split evenly over 8 stages, and under IndexShare every stage must start on
    a layer computing its top-k: the error proposes first/last stage sizes that satisfy both."""
    from recipes.config.pipeline_layout import shares_across_stages, stage_layers, suggest_layout

    world = ["parallelism.nodes=2", "parallelism.gpus_per_node=8", "parallelism.expert_model_parallel_size=2",
             "train.global_batch_size=2", "train.micro_batch_size=1"]
    cfg = _compose(["model=glm5_2", "parallelism.pipeline_model_parallel_size=8", *world])
    with pytest.raises(ConfigError, match="num_layers_in_first_pipeline_stage=2 "
                                          "parallelism.num_layers_in_last_pipeline_stage=4"):
        validate(cfg, 16)
    assert suggest_layout(78, 8, 4, 3) == (2, 4) and suggest_layout(78, 4, 4, 3) == (18, 20)
    assert stage_layers(78, 8, 2, 4) == [2] + [12] * 6 + [4]
    assert shares_across_stages([2] + [12] * 6 + [4], 4, 3) is None
    assert shares_across_stages([9] + [10] * 6 + [9], 4, 3) == 10  # layer 10 reuses layer 7's top-k
    validate(_compose(["model=glm5_2", "parallelism.pipeline_model_parallel_size=8", *world,
                       "parallelism.num_layers_in_first_pipeline_stage=2",
                       "parallelism.num_layers_in_last_pipeline_stage=4"]), 16)
    bad = _compose(["model=glm5_2", "parallelism.pipeline_model_parallel_size=8", *world,
                    "parallelism.num_layers_in_first_pipeline_stage=9",
                    "parallelism.num_layers_in_last_pipeline_stage=9"])
    with pytest.raises(ConfigError, match="layer 10 starts a stage but reuses a top-k"):
        validate(bad, 16)


def test_dry_run_check_lists_every_problem_at_once() -> None:
    from recipes.plan.dry_run import check_all

    cfg = _compose(["parallelism.tensor_model_parallel_size=3", "model.dsa_indexer_kpool=3",
                    "train.micro_batch_size=3"])
    with pytest.raises(ConfigError) as err:
        check_all(cfg, 3)
    text = str(err.value)
    assert text.startswith("3 config problems for 3 GPUs:")  # topk % kpool only for an allowed kpool
    for key in ("parallelism.tensor_model_parallel_size=3", "train.global_batch_size=4",
                "model.dsa_indexer_kpool=3"):
        assert key in text, text


def test_glm5_2_cluster_preset_trains_on_indexed_data_and_needs_its_path() -> None:
    """The 512-GPU preset trained on mock data; it takes data=indexed, and without a data path its
    first problem on its own machine is a ConfigError naming data.paths (raised before the build)."""
    cfg = _compose(["experiment=glm5_2_h200_64n"])
    assert cfg.parallelism.nodes * cfg.parallelism.gpus_per_node == 512
    assert (cfg.data.kind, cfg.data.seq_length) == ("indexed", 4096)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 512)
    assert (err.value.key, err.value.value) == ("data.paths", [])
    validate(_compose(["experiment=glm5_2_h200_64n", "data.paths=[/shared/corpus_text_document]",
                       "data.tokenizer=/shared/tokenizer"]), 512)
    assert _compose(["experiment=glm5_2_h200_64n", "data=mock"]).data.seq_length == 4096  # planning


def test_uneven_stages_build_their_own_layer_counts() -> None:
    """Each stage's block spec has the layers megatron assigns it (not num_layers // PP on every
    stage: 1 + 3, not 2 + 2). Trained end to end: torchrun --nproc-per-node 2 train.py
    parallelism=pp2 parallelism.num_layers_in_first_pipeline_stage=1 ..._last_...=3."""
    from kpool_layers.mla.attention import glm_attention_spec
    from kpool_layers.spec import glm_decoder_block_spec

    cfg = _compose(["parallelism=pp2", "parallelism.num_layers_in_first_pipeline_stage=1",
                    "parallelism.num_layers_in_last_pipeline_stage=3"])
    validate(cfg, 2)
    tcfg = to_transformer_config(to_config(cfg))
    attention = glm_attention_spec(tcfg)
    assert [len(glm_decoder_block_spec(tcfg, attention, pp_rank=r).layer_specs) for r in (0, 1)] == [1, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is for machines without CUDA")
def test_alltoall_dispatcher_refused_without_cuda() -> None:
    """megatron's alltoall dispatcher creates CUDA streams at the build: refused up front on a
    machine without CUDA (a dry run, planning for GPUs, still takes it)."""
    cfg = _compose(["model=glm5_tiny", "model.moe_token_dispatcher_type=alltoall"])
    with pytest.raises(ConfigError, match="model.moe_token_dispatcher_type.*allgather"):
        validate(cfg, 1)
    validate(_compose(["model=glm5_tiny", "model.moe_token_dispatcher_type=alltoall", "train.dry_run=true"]), 1)
