"""``train.cuda_graph_impl=full_iteration`` (``recipes/train/cuda_graph.py``): the rules that refuse
steps a replay cannot run, the config megatron gets, the eager / graphed / capture-error routing
(CPU, with megatron's wrapper stood in), and on a GPU whole training runs replayed against eager
ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import recipes.train.cuda_graph as cuda_graph
from recipes.config.megatron import to_transformer_config
from recipes.config.schema import ConfigError, CudaGraphImpl, TrainConfig
from recipes.config.rules import all_problems, validate
from recipes.config.typed import to_config
from tests.test_config import _compose
from tests.train_runner import metrics, run_train

GRAPHS = "train.cuda_graph_impl=full_iteration"


REFUSED = [
    (["parallelism.pipeline_model_parallel_size=2", "model.num_layers=4"], 2,
     "parallelism.pipeline_model_parallel_size"),
    (["parallelism.context_parallel_size=2"], 2, "parallelism.context_parallel_size"),
    (["data.reset_attention_mask=true", "train.micro_batch_size=1"], 1, "data.reset_attention_mask"),
    (["model.dsa_indexer_loss_coeff=0.01"], 1, "model.dsa_indexer_loss_coeff"),
    (["model.moe_token_dispatcher_type=alltoall"], 1, "model.moe_token_dispatcher_type"),
    (["parallelism.tensor_model_parallel_size=2"], 2, "parallelism.tensor_model_parallel_size"),
    (["parallelism.expert_model_parallel_size=2"], 2, "parallelism.expert_model_parallel_size"),
    (["model.moe_grouped_gemm=false"], 1, "model.moe_grouped_gemm"),
    (["precision=fp8", "precision.recipe=tensorwise"], 1, "precision.recipe"),
]


@pytest.mark.parametrize("overrides,world,key", REFUSED, ids=[k for _, _, k in REFUSED])
def test_steps_a_replay_cannot_run_are_refused_naming_the_key(overrides: list[str], world: int,
                                                               key: str) -> None:
    """Each rule fires on its key (a dry run: the CUDA rule aside) and only with graphs on."""
    base = ["model=glm5_tiny", "train.dry_run=true"] + overrides
    problems = all_problems(_compose(base + [GRAPHS]), world)
    assert key in [p.key for p in problems], problems
    assert all("allowed" in str(p) for p in problems)
    assert key not in [p.key for p in all_problems(_compose(base), world)]


def test_the_proxy_and_dense_models_pass() -> None:
    for overrides in (["experiment=glm5_proxy_h200"], ["model=glm5_tiny", "model.num_moe_experts=null"],
                      ["experiment=glm5_proxy_h200", "precision=serving_match"],
                      ["experiment=glm5_3_proxy_h200"], ["model=glm5_3_flash_tiny"]):
        assert all_problems(_compose(overrides + [GRAPHS, "train.dry_run=true"]), 1) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is for machines without CUDA")
def test_refused_without_cuda() -> None:
    with pytest.raises(ConfigError, match="train.cuda_graph_impl.*none on a machine without CUDA"):
        validate(_compose(["model=glm5_tiny", GRAPHS]), 1)


def test_megatron_gets_the_implementation_and_warmup() -> None:
    cfg = to_config(_compose(["model=glm5_tiny", GRAPHS, "train.cuda_graph_warmup_steps=3"]))
    tcfg = to_transformer_config(cfg)
    assert (tcfg.cuda_graph_impl, tcfg.cuda_graph_warmup_steps, tcfg.cuda_graph_modules) == (
        "full_iteration", 3, [])
    assert to_transformer_config(to_config(_compose(["model=glm5_tiny"]))).cuda_graph_impl == "none"


class _FakeWrapper:
    """megatron's ``FullCudaGraphWrapper`` interface (it needs CUDA): counts calls, fails as told."""

    def __init__(self, func, cuda_graph_warmup_steps: int) -> None:
        self.func, self.cuda_graph_warmup_steps = func, cuda_graph_warmup_steps
        self.calls, self.fail_at, self.reset = 0, None, False

    def curr_iter(self, stage: str) -> int:
        assert stage == "training"
        return self.calls

    def __call__(self, **kwargs: object) -> tuple[str, dict[str, object]]:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        return ("graphed", kwargs)

    def reset_cuda_graph(self) -> None:
        self.reset = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cuda_graph, "FullCudaGraphWrapper", _FakeWrapper)
    monkeypatch.setattr(cuda_graph, "get_forward_backward_func", lambda: lambda **kw: ("eager", kw))


def test_eager_graphed_and_closed(fake) -> None:
    off = cuda_graph.ForwardBackward(TrainConfig())
    assert off(x=1) == ("eager", {"x": 1})
    on = cuda_graph.ForwardBackward(TrainConfig(cuda_graph_impl=CudaGraphImpl.full_iteration,
                                                cuda_graph_warmup_steps=2))
    wrapper = on._graphed
    assert on(x=1) == ("graphed", {"x": 1}) and not on.just_captured
    assert on(eager=True, x=2) == ("eager", {"x": 2}) and not on.just_captured
    assert wrapper.calls == 1  # the eager step did not count as one of the wrapper's
    assert on(x=1) == ("graphed", {"x": 1}) and not on.just_captured  # the second warm-up step
    assert on(x=1) == ("graphed", {"x": 1}) and on.just_captured  # the capture
    assert on(x=1) == ("graphed", {"x": 1}) and not on.just_captured  # a replay
    cuda_graph.StaticBufferLoader.static_buffers["training"].append({"tokens": None})
    on.close()
    assert wrapper.reset and cuda_graph.StaticBufferLoader.static_buffers == {"training": [], "validation": []}
    assert on(x=3) == ("eager", {"x": 3})


@pytest.mark.parametrize("fail_at,capture", [(2, True), (1, False)])
def test_a_failed_capture_names_the_key(fake, fail_at: int, capture: bool) -> None:
    """The capture (the call after the warm-up steps) failing is a config error naming
    ``train.cuda_graph_impl``; any other step's error passes through unchanged."""
    on = cuda_graph.ForwardBackward(TrainConfig(cuda_graph_impl=CudaGraphImpl.full_iteration,
                                                cuda_graph_warmup_steps=2))
    on._graphed.fail_at = fail_at
    for _ in range(fail_at):
        on(x=0)
    with pytest.raises((RuntimeError, ConfigError)) as err:
        on(x=0)
    if capture:
        assert isinstance(err.value, cuda_graph.CaptureError) and err.value.key == "train.cuda_graph_impl"
        assert "stream is capturing" in str(err.value) and "more detail" not in str(err.value)
    else:
        assert not isinstance(err.value, ConfigError)


def _losses(tmp_path: Path, name: str, overrides: list[str],
            captured_at: int | None = None) -> tuple[list[float], list[float]]:
    """Per-step losses and grad norms of a ``train.py`` run; ``captured_at``: the step the run
    must report capturing its graph at (None: it must capture none)."""
    out = run_train(tmp_path, name, overrides, timeout=900).stdout
    captures = [line.split(":")[0] for line in out.splitlines() if "captured as one CUDA graph" in line]
    assert captures == ([] if captured_at is None else [f"step {captured_at}"]), out[-2000:]
    rows = [r for r in metrics(tmp_path / name) if "loss" in r]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


TINY_GPU = ["model=glm5_tiny", "precision=bf16", "model.dsa_kernels=triton", "data.seq_length=256",
            "train.steps=5", "train.micro_batch_size=1", "train.global_batch_size=2",
            "train.save_final=false", "logging.mode=disabled", "train.cuda_graph_warmup_steps=1"]


@pytest.mark.gpu
def test_replayed_dense_training_equals_eager_bit_for_bit(tmp_path: Path) -> None:
    """A dense model (no MoE: no atomics in the step) trains the same, bit for bit, when steps 2-5
    are one graph replay each (step 1 eager, step 2 captured then replayed)."""
    dense = TINY_GPU + ["model.num_moe_experts=null", "precision.drift.interval=0"]  # no eager drift steps
    eager = _losses(tmp_path, "eager", dense)  # prints no capture
    graphed = _losses(tmp_path, "graphed", dense + [GRAPHS], captured_at=2)
    assert len(eager[0]) == 5 and graphed == eager


@pytest.mark.gpu
def test_replayed_moe_training_with_eager_drift_steps(tmp_path: Path) -> None:
    """The MoE model replays too, with the drift measurement's steps (2 and 4) run eagerly in
    between: step 1 eager, step 3 captured (the drift step does not count as a warm-up step), step
    5 replayed. Bit for bit: the token dispatcher adds each token's expert rows in a fixed order
    without atomics, forward and backward (``kpool_layers.moe.permute``)."""
    moe = TINY_GPU + ["precision.drift.interval=2"]
    eager = _losses(tmp_path, "eager", moe)
    graphed = _losses(tmp_path, "graphed", moe + [GRAPHS], captured_at=3)
    drift_rows = [r for r in metrics(tmp_path / "graphed") if "dsa/topk_overlap" in r]
    assert len(drift_rows) == 2 and len(eager[0]) == 5
    assert graphed == eager
