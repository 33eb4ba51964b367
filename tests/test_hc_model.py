"""Models with mHC streams (``model.hc_mult``, kpool_layers/hyper_connections) end to end: logits
against transformers' ``Glm5NextTextModel`` (hc_mult 1..4, the checkpoint imported by
``scripts/convert_checkpoint.py``'s path), export back bit for bit, unsupported hc fields named,
the config rules, recompute against none, a dist-checkpoint round trip, every precision profile
builds, PP = 2 and TP = 2 + SP equal PP = 1 (two gloo ranks), and through ``train.py`` resume is
exact and CP = 2 trains the losses of CP = 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from recipes.config.rules import all_problems  # noqa: E402
from recipes.hf.config import model_config_from_hf  # noqa: E402
from scripts.convert_checkpoint import export_hf, import_hf  # noqa: E402
from tests.test_config import _compose  # noqa: E402
from tests.test_hf_interop import our_model, safetensors_of  # noqa: E402
from tests.train_runner import ADAM_EPS, metrics, run_train  # noqa: E402

SEQ, VOCAB, HIDDEN, LAYERS = 32, 320, 64, 3
EPS32 = torch.finfo(torch.float32).eps
# A tiny random glm5_next_text (GLM-5.3-Flash's text stack) whose layers are all DSA MLA: NoPE,
# KPool 4 with the tail, top-8 < SEQ (sparse), one dense layer then MoE; 8 indexer heads (with 4,
# pools whose ReLU'd scores are exactly 0 tie at the top-k boundary and either pick is right).
TINY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16,
            v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4,
            index_kpool_always_select_tail=True, layer_types=["indexed_attention"] * LAYERS,
            mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1), indexer_types=["full"] * LAYERS,
            pad_token_id=None, max_position_embeddings=128)


HC_INIT = {"_hc.fn": (0.0, 0.1), "_hc.base": (0.0, 0.5), "_hc.scale": (1.0, 0.2)}
"""Normal (mean, std) given to transformers' mHC parameters by suffix: away from their
initialisation, so that every stream's mixing and weights matter in the parity tests."""


def perturb_hc(name: str, p: torch.Tensor) -> bool:
    """Draw ``p`` from :data:`HC_INIT` if ``name`` is an mHC parameter; whether it was."""
    for suffix, (mean, std) in HC_INIT.items():
        if name.endswith(suffix):
            p.normal_(mean, std)
            return True
    return False


def save_tiny_glm5_next(path: Path, hc_mult: int, seed: int = 0) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    """A random tiny ``Glm5NextTextModel`` written as a glm5_next_text checkpoint (``model.`` +
    the tensor names transformers stores, ``hc_attn_fn`` ..., plus ``lm_head.weight``) and
    ``config.json``; returns the directory, the model and the head. The mHC weights are drawn
    far from their init (fn N(0, 0.1), base N(0, 0.5), scale N(1, 0.2)) so the streams mix."""
    from transformers.core_model_loading import revert_weight_conversion

    cfg = transformers.Glm5NextTextConfig(**TINY, hc_mult=hc_mult, hc_sinkhorn_iters=20, hc_eps=1e-6)
    torch.manual_seed(seed)
    model = transformers.Glm5NextTextModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if perturb_hc(name, p):
                continue
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
            elif "index_kpool_compress" in name:
                p.normal_(0.0, 0.3)
        head = torch.randn(VOCAB, HIDDEN) * 0.02
    state = {f"model.{k}": v.contiguous() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    path.mkdir(parents=True)
    save_file({**state, "lm_head.weight": head}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    return path, model, head


@pytest.mark.parametrize("hc_mult", [1, 2, 3, 4])
def test_logits_match_transformers(tmp_path: Path, single_rank_parallel_state, hc_mult: int) -> None:
    """fp32 on both sides, the same operations in a different order (GEMM blockings, the sparse
    attention's sums, our Hadamard-rotated index scores, which select the same pools). A
    reordered sum of K rounded terms differs by about sqrt(K) eps32 relative (the probabilistic
    rounding bound of Higham & Mary 2019; the worst case is K eps32); the longest sums are
    K = N h <= 256 (the mHC projection), a block chains about 10 of them, there are 2 L = 6
    blocks, and the streams carry each block's error forward at most doubled (comb is doubly
    stochastic, post <= 2): 2 * 6 * 10 * sqrt(256) * eps32 ~ 2.3e-5 relative bounds the
    logits' error. Measured ~3e-7 for every hc_mult."""
    hf_dir, hf_model, head = save_tiny_glm5_next(tmp_path / "hf", hc_mult, seed=hc_mult)
    model_cfg = import_hf(hf_dir, tmp_path / "ckpt")
    assert (model_cfg.hc_mult, model_cfg.hc_sinkhorn_iters, model_cfg.hc_eps) == (hc_mult, 20, 1e-6)
    ours = our_model(model_cfg, tmp_path / "ckpt")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(hc_mult))
    with torch.no_grad():
        ref = hf_model(ids).last_hidden_state @ head.T
        got = ours(ids, torch.arange(SEQ)[None].expand(2, -1), None)
    err = float((got - ref).abs().max() / ref.abs().max())
    print(f"hc_mult={hc_mult}: max |dlogit| / max |logit| = {err:.2e}")
    assert err <= 2 * 6 * 10 * 16 * EPS32


def test_export_round_trip_is_bit_exact(tmp_path: Path, single_rank_parallel_state) -> None:
    hf_dir, _, _ = save_tiny_glm5_next(tmp_path / "hf", hc_mult=4)
    import_hf(hf_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    original, exported = safetensors_of(hf_dir), safetensors_of(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    reloaded = transformers.Glm5NextTextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    src = json.loads((hf_dir / "config.json").read_text())
    for key in ("hc_mult", "hc_sinkhorn_iters", "hc_eps", "layer_types", "mlp_layer_types", "indexer_types",
                "index_kpool", "index_kpool_always_select_tail", "qk_rope_head_dim"):
        assert getattr(reloaded, key) == src[key], key
    assert model_config_from_hf(config, "x")["hc_mult"] == 4


def test_unsupported_hc_fields_are_named() -> None:
    base = {**transformers.Glm5NextTextConfig(**TINY).to_dict()}
    with pytest.raises(ValueError, match="hc_head_fn"):
        model_config_from_hf({**base, "hc_head_fn": 1}, "x")
    with pytest.raises(ValueError, match="hc_mult"):
        model_config_from_hf({**base, "hc_mult": 0}, "x")
    dsa = transformers.GlmMoeDsaConfig().to_dict()
    with pytest.raises(ValueError, match="hc_mult"):
        model_config_from_hf({**dsa, "hc_mult": 4}, "x")
    assert "hc_mult" not in model_config_from_hf(dsa, "x")
    from recipes.hf.config import hf_config_from_model
    from scripts.convert_checkpoint import model_group

    roped = model_group("glm5_tiny")
    roped.hc_mult = 4
    with pytest.raises(ValueError, match="qk_pos_emb_head_dim"):  # glm5_next_text is NoPE
        hf_config_from_model(roped, "float32")


@pytest.mark.parametrize("overrides,key,says", [
    (["model.hc_mult=4", "model.mtp_num_layers=1"], "model.mtp_num_layers", "hc_mult"),
    (["model.hc_sinkhorn_iters=5"], "model.hc_sinkhorn_iters", "unless model.hc_mult"),
    (["model.hc_mult=0"], "model.hc_mult", "[1, inf)"),
])
def test_config_rules(overrides: list[str], key: str, says: str) -> None:
    found = all_problems(_compose(["model=glm5_tiny", *overrides]), 1)
    assert len(found) == 1 and found[0].key == key and says in found[0].allowed, found


HC = ["model=glm5_tiny", "model.hc_mult=4"]


def _build(overrides: list[str], precision: str = "fp32") -> torch.nn.Module:
    from recipes.config.megatron import to_transformer_config
    from recipes.config.typed import to_config
    from recipes.train.model import build_gpt_model

    cfg = to_config(_compose([*HC, f"precision={precision}", *overrides]))
    return build_gpt_model(cfg, to_transformer_config(cfg))


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 512, (2, 40), generator=gen) for _ in range(2))
    loss = model(tokens, torch.arange(40).expand(2, -1), None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


RECOMPUTE = [  # (overrides, a module that runs twice with them)
    (["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
     "decoder.layers.3.attn_hc"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[mlp,moe]"], "decoder.layers.0.mlp")]


def test_recompute_equals_no_recompute(single_rank_parallel_state) -> None:
    """Full (every layer, the streams [s, b, N, h] its checkpointed input) and selective
    recompute rerun the same ops on the same inputs: loss and every gradient bit-equal to no
    recompute, the mHC weights' included."""
    torch.manual_seed(0)
    ref_model = _build([])
    ref_loss, ref_grads = _step(ref_model)
    assert any(".attn_hc." in n for n in ref_grads) and any(".ffn_hc." in n for n in ref_grads)
    for overrides, twice in RECOMPUTE:
        assert not all_problems(_compose([*HC, *overrides]), 1), overrides
        model = _build(overrides)
        model.load_state_dict(ref_model.state_dict())
        calls = []
        model.get_submodule(twice).register_forward_hook(lambda *_: calls.append(1))
        loss, grads = _step(model)
        assert len(calls) == 2, (overrides, twice, len(calls))
        assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys(), overrides
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items()), overrides


def test_hc_mult_unset_builds_todays_model(single_rank_parallel_state) -> None:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from recipes.config.megatron import to_transformer_config
    from recipes.config.typed import to_config
    from recipes.train.model import build_gpt_model

    cfg = to_config(_compose(["model=glm5_tiny", "precision=fp32"]))
    model = build_gpt_model(cfg, to_transformer_config(cfg))
    assert all(type(layer) is TransformerLayer for layer in model.decoder.layers)
    assert not any("_hc." in n for n in model.state_dict())


@pytest.mark.parametrize("precision", ["bf16", "fp8", "serving_match", "fp32"])
def test_every_precision_profile_builds_with_mhc_proj_in_fp32(single_rank_parallel_state, precision: str) -> None:
    from recipes.observe.precision_map import precision_map

    model = _build([], precision)
    rows = [r for r in precision_map(model) if r["role"] == "mhc.proj"]
    assert len(rows) == 2 * 4 and {(r["dtype"], r["quantized"]) for r in rows} == {("float32", False)}
    assert rows[0]["module"] == "decoder.layers.0.attn_hc.fn"


def test_dist_checkpoint_round_trip(tmp_path: Path, single_rank_parallel_state) -> None:
    from megatron.core import dist_checkpointing

    torch.manual_seed(0)
    model = _build([])
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "ckpt"))
    torch.manual_seed(1)
    other = _build([])
    assert not torch.equal(other.decoder.layers[0].attn_hc.fn, model.decoder.layers[0].attn_hc.fn)
    other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(tmp_path / "ckpt")))
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def _forward_step(batches, model):  # noqa: ANN001, ANN202 - megatron's forward_step_func
    tokens, labels = next(batches)
    out = model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels)
    return out, lambda loss: (loss.sum(), {"loss": loss.sum().detach()})


def _fwd_bwd(model: torch.nn.Module, batches: list) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kpool_layers.hyper_connections.pipeline import schedule_kwargs

    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=32, micro_batch_size=1, forward_only=False,
        **schedule_kwargs([model]))


def _worker(rank: int, port: int, ckpt: str) -> None:
    """Both ranks build the PP = 1 model (same seed) and run megatron's no-pipeline schedule on
    two micro-batches; then the PP = 2 stage of their rank with those weights under the 1F1B
    schedule (the stream tensor [32, 1, 4, h] crosses the stage boundary both ways); then TP = 2
    with sequence parallelism (streams [16, 1, 4, h] per rank), the weights resharded from a
    dist checkpoint of the PP = 1 model."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from kpool_layers.compat import cpu as _cpu

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    _cpu.install()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(3)
    batches = [tuple(torch.randint(0, 512, (1, 32), generator=gen) for _ in range(2)) for _ in range(2)]
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    full = _build([])
    ref = _fwd_bwd(full, batches)
    ref_grads = {n: p.grad for n, p in full.named_parameters() if p.grad is not None}
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(full.sharded_state_dict(), ckpt)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    stage = _build(["parallelism.pipeline_model_parallel_size=2"])

    def full_name(name: str) -> str:  # stage layer i is layer 2 * rank + i of the full model
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(int(parts[2]) + 2 * rank)
        return ".".join(parts)

    full_state = full.state_dict()
    stage.load_state_dict({n: full_state[full_name(n)] for n in stage.state_dict()})
    got = _fwd_bwd(stage, batches)
    if rank == 1:  # the last stage: the losses, bit for bit
        assert [float(r["loss"]) for r in got] == [float(r["loss"]) for r in ref], (got, ref)
    grads = {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}
    assert any("_hc." in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[full_name(name)]), name
    ps.destroy_model_parallel()
    _tp2_sp(batches, ref, ref_grads, ckpt)
    dist.destroy_process_group()


def _tp2_sp(batches: list, ref: list, ref_grads: dict, ckpt: str) -> None:
    """TP = 2 + SP against PP = 1: the row-parallel outputs are sums of two partial products
    (a reordering), so the losses agree to the logits' reordering bound of
    :func:`test_logits_match_transformers` (2.3e-5 relative); each rank holds the mHC weights'
    gradient of its half of the tokens, which summed over TP (what finalize_model_grads does for
    ``sequence_parallel`` parameters) is the full gradient to the same relative bound."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    tp = _build(["parallelism=tp2"])
    assert tp.config.sequence_parallel and tp.decoder.layers[0].attn_hc.fn.sequence_parallel
    tp.load_state_dict(dist_checkpointing.load(tp.sharded_state_dict(), ckpt))
    got = _fwd_bwd(tp, batches)
    bound = 2 * 6 * 10 * 16 * EPS32
    for g, r in zip(got, ref):
        assert abs(float(g["loss"]) - float(r["loss"])) <= bound * abs(float(r["loss"])), (got, ref)
    hc = {n: p.grad for n, p in tp.named_parameters() if "_hc." in n}
    assert len(hc) == 6 * 4
    for name, grad in hc.items():
        dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        want = ref_grads[name]
        assert float((grad - want).abs().max()) <= bound * float(want.abs().max()), name
    ps.destroy_model_parallel()


@pytest.mark.dist
def test_pp2_and_tp2_sp_equal_pp1(tmp_path: Path) -> None:
    """hc_mult = 4 on two gloo ranks. PP = 2 equals PP = 1 bit for bit: the same operations on
    the same values per stage, the stream tensor handed over by p2p (no arithmetic). TP = 2
    with sequence parallelism within the bound of :func:`_tp2_sp`."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    mp.spawn(_worker, args=(free_port(), str(tmp_path / "ckpt")), nprocs=2, join=True)


TRAIN = ["model=glm5_tiny", "model.hc_mult=4", "precision=fp32", "data.seq_length=32", "train.lr_warmup_steps=0",
         "logging.mode=disabled", "train.micro_batch_size=1", "train.global_batch_size=2",
         f"train.adam_eps={ADAM_EPS}"]


@pytest.mark.dist
def test_resume_exact_and_cp2_equals_cp1(tmp_path: Path) -> None:
    """``train.py`` with hc_mult = 4. Step 3 resumed from the step-2 checkpoint equals the
    uninterrupted run bit for bit (the mHC weights and their optimizer state round-trip). CP = 2
    (each rank's streams hold 2 of the row's 4 chunks; the mHC math is per token) trains the
    losses of CP = 1: the same fp32 terms summed in another order over the ranks' tokens, ~1e-7
    relative per step on a loss of ~6 (tests/test_train_cp.py's bound, 1e-5 absolute, at its
    ``ADAM_EPS``)."""
    run_train(tmp_path, "full", TRAIN + ["train.steps=3", "train.save_interval=2"])
    ckpt = tmp_path / "full" / "checkpoints" / "iter_0000002"
    out = run_train(tmp_path, "resumed", TRAIN + ["train.steps=3", f"train.resume={ckpt}"])
    assert "resumed from" in out.stdout
    full, resumed = metrics(tmp_path / "full"), metrics(tmp_path / "resumed")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in full[2:]]
    run_train(tmp_path, "cp2", TRAIN + ["train.steps=3", "train.save_final=false", "parallelism=cp2"], nproc=2)
    cp2 = [r["loss"] for r in metrics(tmp_path / "cp2")]
    assert cp2 == pytest.approx([r["loss"] for r in full], abs=1e-5, rel=0), (cp2, full)
    assert len({r["loss"] for r in full}) == 3  # the steps train


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(tmp_path: Path) -> None:
    """``train.cuda_graph_impl=full_iteration`` with hc_mult = 4 (dense, no MoE atomics): the mHC
    math has no host synchronisation, so steps 2-5 replay one captured graph and train the same
    as eager steps, bit for bit (no drift steps: they run eagerly and would postpone the capture)."""
    from tests.test_cuda_graph import GRAPHS, TINY_GPU, _losses

    dense = TINY_GPU + ["model.num_moe_experts=null", "model.hc_mult=4", "precision.drift.interval=0"]
    eager = _losses(tmp_path, "eager", dense)
    graphed = _losses(tmp_path, "graphed", dense + [GRAPHS], captured_at=2)
    assert len(eager[0]) == 5 and graphed == eager


def test_bf16_model_saves_its_distributed_optimizer_state(single_rank_parallel_state) -> None:
    """The trainer's BF16 build (``Float16Module``, megatron's DDP and distributed optimizer)
    with hc_mult = 4 takes an optimizer step and gives the checkpoint's sharded optimizer state
    (the mHC weights sit in the BF16 buffer with every other parameter)."""
    from recipes.checkpoint.store import OPTIMIZER_SHARDING, unwrap
    from recipes.config.typed import to_config
    from recipes.loop import _build as build_trainer

    cfg = to_config(_compose([*HC, "precision=bf16"]))
    trainer = build_trainer(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 512, (1, 32), generator=gen) for _ in range(2))
    trainer.model(tokens, torch.arange(32)[None], None, labels=labels).sum().backward()
    trainer.model.finish_grad_sync()
    trainer.optimizer.step()
    model_sd = unwrap(trainer.model).sharded_state_dict()
    state = trainer.optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=OPTIMIZER_SHARDING)
    assert state and unwrap(trainer.model).decoder.layers[0].attn_hc.base.dtype == torch.bfloat16
