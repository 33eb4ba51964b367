"""``train.cross_entropy_fusion``: the language-model loss in two Triton kernels
(``kpool_layers.loss``) on GPUs, against megatron's unfused ``vocab_parallel_cross_entropy``
(the oracle) and a float64 reference.

Tolerances, from the arithmetic (FP32 throughout, module docstring of kpool_layers.loss):
the row sum ``S`` has a relative error of a few FP32 steps per block iteration and per level of
the lane reduction plus the exponentials' (at most ~2^-22 each, GPU ``ex2.approx``), so below
2^-18 for these sizes; ``log S``, ``m + log S`` and the final subtraction add a rounding of
2^-24 times the magnitudes involved. So ``|loss - ref| <= 2^-16 (1 + |lse|)``: 4x that margin.
A gradient ``g (p - onehot)``, ``p = exp(x - lse)``, carries p's relative error (the rounding
of ``x - lse``, up to ``(|x| + |lse|) 2^-24``, plus lse's and exp's) times ``|g| p``, then one
rounding to the logits' dtype: within one step of the dtype at the larger of the two values (the
interpreter truncates FP32 -> BF16 where the GPU rounds to nearest) plus the smallest subnormal.

The interpreter cases run this module as a script in a subprocess (``TRITON_INTERPRET=1`` must be
set before triton is imported); the tensor-parallel case splits the vocabulary over two gloo
processes there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.config.megatron import fused_cross_entropy, to_transformer_config
from recipes.config.typed import to_config
from tests.test_config import _compose
from tests.test_cuda_graph import GRAPHS, _losses

REPO = Path(__file__).resolve().parents[1]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def reference(logits: torch.Tensor, labels: torch.Tensor, grad_loss: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, logit gradient) in float64 of ``logits [T, V]`` as given (already rounded to
    their dtype); a label outside ``[0, V)`` contributes no logit (megatron's convention)."""
    x = logits.double()
    lse = torch.logsumexp(x, dim=-1)
    held = (labels >= 0) & (labels < x.shape[-1])
    target = x.gather(1, labels.clamp(0, x.shape[-1] - 1)[:, None])[:, 0]
    loss = lse - torch.where(held, target, x.max(dim=-1).values)
    onehot = torch.zeros_like(x).scatter_(1, labels.clamp(0, x.shape[-1] - 1)[:, None], 1.0) * held[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot) * grad_loss.double()[:, None]
    return loss, lse, grad


def within(loss: torch.Tensor, grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
           grad_loss: torch.Tensor) -> dict[str, float]:
    """Largest error / bound ratios (module docstring) of ``loss`` and ``grad`` (the logits'
    dtype) against :func:`reference`; <= 1 passes."""
    ref_loss, lse, ref_grad = reference(logits, labels, grad_loss)
    x = logits.double()
    loss_bound = 2.0**-16 * (1 + lse.abs())
    p = torch.exp(x - lse[:, None])
    dtype = logits.dtype
    size = torch.maximum(ref_grad.abs(), grad.double().abs()).clamp_min(1e-300)  # either binade
    step = torch.exp2(torch.floor(torch.log2(size)) - MANTISSA[dtype])
    tiny = torch.finfo(dtype).smallest_normal * 2.0**-MANTISSA[dtype]
    grad_bound = step + grad_loss.double().abs()[:, None] * p * 2.0**-16 * (2 + x.abs() + lse.abs()[:, None]) + tiny
    return {"loss": float(((loss.double() - ref_loss).abs() / loss_bound).max()),
            "grad": float(((grad.double() - ref_grad).abs() / grad_bound).max())}


def cases(dtype: torch.dtype, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[3, 2, v]`` (one row of equal values, one of +-80 extremes, the rest normal x 4),
    labels ``[3, 2]`` with one below and one above the vocabulary, FP32 loss gradients."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, v, generator=g) * 4
    x[1] = 0.5
    x[2] = torch.where(torch.rand(v, generator=g) < 0.5, -80.0, 80.0)
    labels = torch.randint(0, v, (6,), generator=g)
    labels[3], labels[4] = -1, v + 3
    return x.to(dtype).view(3, 2, v), labels.view(3, 2), torch.randn(3, 2, generator=g)


def kernel_errors(device: str, sizes: tuple[int, ...] = (1000, 5000)) -> dict[str, float]:
    """:func:`within`'s ratios of ``vocab_parallel_cross_entropy`` for each dtype and vocabulary
    size, and (FP32) of megatron's unfused loss on the same logits."""
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy as megatron_loss

    from kpool_layers.loss import vocab_parallel_cross_entropy

    errors = {}
    for v in sizes:
        for dtype in MANTISSA:
            logits, labels, grad_loss = cases(dtype, v, seed=v)
            ours = logits.detach().clone().to(device).requires_grad_()
            loss = vocab_parallel_cross_entropy(ours * 1, labels.to(device))  # * 1: a non-leaf
            loss.backward(grad_loss.to(device))
            flat = lambda t: t.reshape(-1, *t.shape[2:]).cpu()  # noqa: E731
            for key, err in within(flat(loss), flat(ours.grad), flat(logits), flat(labels), flat(grad_loss)).items():
                errors[f"ours/{dtype}/V{v}/{key}"] = err
            if dtype == torch.float32:  # megatron's oracle (gloo group of one when run here)
                theirs = logits.detach().clone().to(device).requires_grad_()
                loss = megatron_loss(theirs * 1, labels.to(device), tp_group=torch.distributed.group.WORLD)
                loss.backward(grad_loss.to(device))
                for key, err in within(flat(loss), flat(theirs.grad), flat(logits), flat(labels), flat(grad_loss)).items():
                    errors[f"megatron/V{v}/{key}"] = err
    return errors


def _tp_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from kpool_layers.loss import vocab_parallel_cross_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    logits, labels, grad_loss = cases(torch.float32, 600, seed=3)
    labels[0, 0], labels[1, 1] = 10, 590  # one label in each rank's half
    shard = logits[..., rank * 300:(rank + 1) * 300].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard * 1, labels, dist.group.WORLD)
    loss.backward(grad_loss)
    grads = [torch.empty_like(shard.grad) for _ in range(2)]
    dist.all_gather(grads, shard.grad.contiguous())
    if rank == 0:
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        queue.put(within(flat(loss), flat(torch.cat(grads, dim=-1)), flat(logits), flat(labels), flat(grad_loss)))
    dist.destroy_process_group()


def tp_errors() -> dict[str, float]:
    """:func:`within`'s ratios of the loss and the gathered logit gradients with the vocabulary
    split over two gloo processes (rank 0's loss)."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_tp_worker, args=(free_port(), queue), nprocs=2, join=True, start_method="spawn")
    return {f"tp2/{key}": err for key, err in queue.get().items()}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "tests.test_cross_entropy_fusion"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_match_the_reference_interpreted(interpreted: dict[str, float]) -> None:
    assert len(interpreted) == 2 * (3 + 1) * 2 + 2, sorted(interpreted)
    bad = {key: err for key, err in interpreted.items() if not err <= 1}
    assert not bad, bad


@pytest.mark.gpu
def test_kernels_match_the_reference_on_gpu(single_rank_parallel_state) -> None:
    """Also at glm5_proxy's vocabulary (154,880: 38 blocks per row)."""
    errors = kernel_errors("cuda", sizes=(1000, 5000, 154880))
    bad = {key: err for key, err in errors.items() if not err <= 1}
    assert len(errors) == 3 * 4 * 2 and not bad, bad


def test_kernels_refuse_bad_layouts() -> None:
    from kpool_layers.kernels import cross_entropy_triton

    with pytest.raises(ValueError, match=r"contiguous last dimension"):
        cross_entropy_triton.row_stats(torch.zeros(8, 4).t(), torch.zeros(4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"labels must be int64 \[4\]"):
        cross_entropy_triton.row_stats(torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32), 0)


@pytest.mark.parametrize(("gpu", "overrides", "fused"), [
    (True, ["precision=bf16"], True),
    (True, ["precision=fp8"], True),
    (True, ["precision=serving_match"], True),
    (True, ["precision=fp32"], True),
    (True, ["precision=bf16", "train.cross_entropy_fusion=false"], False),
    (False, ["precision=bf16"], False),
])
def test_fused_loss_on_gpus_unless_switched_off(gpu, overrides, fused) -> None:
    cfg = to_config(_compose(["model=glm5_tiny", *overrides]))
    assert fused_cross_entropy(cfg.train.cross_entropy_fusion, gpu) is fused


def test_megatron_gets_the_choice(monkeypatch) -> None:
    """The decision, made from the key and this machine, reaches megatron's config."""
    import recipes.config.megatron as megatron_config

    seen = []
    monkeypatch.setattr(megatron_config, "fused_cross_entropy", lambda *args: seen.append(args) or True)
    cfg = to_config(_compose(["model=glm5_tiny", "precision=bf16", "train.cross_entropy_fusion=false"]))
    tcfg = to_transformer_config(cfg)
    assert tcfg.cross_entropy_loss_fusion is True
    assert seen == [(False, torch.cuda.is_available())]


@pytest.mark.parametrize("fusion", [True, False])
def test_the_built_model_computes_its_loss_with_the_kernels(fusion, monkeypatch, single_rank_parallel_state) -> None:
    """With the fusion the model is ``FusedLossGPTModel``: its loss (the main head's and MTP's go
    through ``compute_language_model_loss``) is the kernels' function, given ``[s, b]`` labels and
    returning ``[b, s]``; without it megatron's ``GPTModel`` and its unfused loss."""
    from megatron.core.models.gpt import GPTModel

    import kpool_layers.loss as cross_entropy
    from kpool_layers.loss import FusedLossGPTModel
    from recipes.train.model import build_gpt_model

    cfg = to_config(_compose(["model=glm5_tiny", "precision=fp32"]))
    tcfg = to_transformer_config(cfg)
    tcfg.cross_entropy_loss_fusion = fusion
    model = build_gpt_model(cfg, tcfg)
    assert type(model) is (FusedLossGPTModel if fusion else GPTModel)
    logits, labels = torch.randn(5, 2, cfg.model.vocab_size), torch.randint(0, cfg.model.vocab_size, (2, 5))
    want = torch.nn.functional.cross_entropy(logits.reshape(10, -1), labels.t().reshape(10),
                                             reduction="none").view(5, 2).t()
    if fusion:  # the kernels need a GPU or the interpreter: the torch reference in their place
        seen = []

        def kernels(lg, lb, group):
            seen.append((lg.shape, lb.shape, group))
            return torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1),
                                                     reduction="none").view(lb.shape)

        monkeypatch.setattr(cross_entropy, "vocab_parallel_cross_entropy", kernels)
    loss = model.compute_language_model_loss(labels, logits.clone())
    assert loss.shape == (2, 5) and torch.allclose(loss, want, rtol=1e-6, atol=1e-6)
    if fusion:
        assert seen == [((5, 2, cfg.model.vocab_size), (5, 2), model.pg_collection.tp)]


TINY_GPU = ["model=glm5_tiny", "precision=bf16", "model.dsa_kernels=triton", "data.seq_length=256",
            "train.steps=3", "train.lr_warmup_steps=1", "train.micro_batch_size=1", "train.global_batch_size=2",
            "train.save_final=false", "logging.mode=disabled",
            "precision.drift.interval=0"]  # drift steps run eagerly: none, so step 2 is captured


@pytest.mark.gpu
def test_fused_loss_trains_as_the_unfused_one(tmp_path: Path) -> None:
    """Three steps with megatron's unfused loss, the fused loss (the Triton kernels), and the
    fused loss inside a CUDA graph (eager step 1, captured at step 2, replayed at step 3).

    First step (same weights, same batch), fused against unfused:
    * loss: both compute the per-token loss in FP32 from the same bf16 logits and differ only in
      FP32 rounding (the order of the sums over the vocabulary, V = 512 terms, and the
      exponentials): relative difference within ``2 * V * 2**-24`` (about 6e-5);
    * grad norm: the logit gradients ``softmax - onehot`` differ by that much before both round
      them to bf16, so each differs by at most one bf16 step (2**-8 relative); the backward is
      linear in them, so the gradient norm within 2**-7 relative.
    Replayed against eager, both fused: bit for bit at every step (the same kernels; the tiny
    model's top-2 routing keeps the MoE sums exact, see tests/test_cuda_graph.py)."""
    unfused = _losses(tmp_path, "unfused", TINY_GPU + ["train.cross_entropy_fusion=false"])
    fused = _losses(tmp_path, "fused", TINY_GPU)
    graphed = _losses(tmp_path, "fused_graphed", TINY_GPU + [GRAPHS, "train.cuda_graph_warmup_steps=1"],
                      captured_at=2)
    (loss, norm), (ref_loss, ref_norm) = (fused[0][0], fused[1][0]), (unfused[0][0], unfused[1][0])
    assert abs(loss - ref_loss) <= 2 * 512 * 2.0**-24 * abs(ref_loss), (fused, unfused)
    assert abs(norm - ref_norm) <= 2.0**-7 * ref_norm, (fused, unfused)
    assert len(fused[0]) == 3 and graphed == fused


if __name__ == "__main__":  # the interpreter cases (see the module docstring)
    import torch.distributed as dist

    from tests.conftest import free_port

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    found = kernel_errors("cpu")
    dist.destroy_process_group()
    found.update(tp_errors())
    print(json.dumps(found))
