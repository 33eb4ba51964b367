"""``train.loss_chunk_tokens``: the output layer and loss in sequence chunks
(``kpool_layers.chunked_loss``) equal the whole-sequence head, at TP = 1 (the glm5_tiny model, FP32)
and over a vocab-parallel output layer at TP = 2 (two gloo processes, with and without sequence
parallelism); the chunked head never allocates the ``[s, b, V]`` logits.

Tolerance, from the arithmetic: a token's logits, loss and input gradient are computed by the same
ops on the same values with and without chunks (a GEMM over fewer rows; each output element is the
same dot product over h); the weight gradient ``sum_t dlogits_t^T hidden_t`` is the same FP32 terms
summed in another order (per chunk, then over chunks), which differs by at most
``(n - 1) eps sum_t |dlogits_t| |hidden_t|`` for n = s * b tokens (Higham, 2nd ed., section 4.2).
A BLAS may also block a GEMM's h-contraction differently for another row count: the same bound with
n = h. The assertions use ``(n - 1) eps`` times the sum of the terms' magnitudes, computed here.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.conftest import free_port

EPS32 = torch.finfo(torch.float32).eps


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    loss = model(tokens, positions, None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tiny(chunk: int, *overrides: str):
    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model
    from recipes.config.typed import to_config
    from tests.test_config import _compose

    cfg = to_config(_compose(["model=glm5_tiny", "precision=fp32", f"train.loss_chunk_tokens={chunk}",
                                  *overrides]))
    return build_gpt_model(cfg, to_transformer_config(cfg))


def _weight_grad_bound(hidden: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    """``(n - 1) eps sum_t |dlogits_t| |hidden_t|`` per weight element (module docstring),
    ``hidden [s, b, h]``, ``dlogits [s, b, V]``, n = max(s * b, h)."""
    h, d = hidden.reshape(-1, hidden.shape[-1]).abs(), dlogits.reshape(-1, dlogits.shape[-1]).abs()
    n = max(h.shape[0], h.shape[1])
    return (n - 1) * EPS32 * (d.t() @ h)


def test_the_chunked_model_equals_the_whole_sequence_head(single_rank_parallel_state) -> None:
    """glm5_tiny (FP32), 2 x 40 tokens in chunks of 16 (16 + 16 + 8): the same per-token loss and
    the same gradient of every parameter as the unchunked model with the same weights."""
    from kpool_layers.chunked_loss import ChunkedLossGPTModel

    torch.manual_seed(0)
    ref = _tiny(0)
    chunked = _tiny(16)
    assert type(chunked) is ChunkedLossGPTModel and chunked.loss_chunk_tokens == 16
    chunked.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 40), generator=gen)
    labels = torch.randint(0, 512, (2, 40), generator=gen)
    ref_loss, ref_grads = _loss_and_grads(ref, tokens, labels)
    loss, grads = _loss_and_grads(chunked, tokens, labels)
    assert loss.shape == (2, 40)
    # Per-token loss: the same ops per token (module docstring); h = 64 terms per logit at most.
    assert (loss - ref_loss).abs().max() <= 64 * EPS32 * ref_loss.abs().max()
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        # Every gradient flows from the head's input gradient (the same per token) and the output
        # weight's (a reordered sum over 80 tokens): 80 eps of the largest magnitude bounds both.
        assert (grads[name] - ref_grad).abs().max() <= 80 * EPS32 * ref_grad.abs().max() + 1e-30, name


def _head_case(sp: bool, tp: int, chunk: int) -> dict[str, float]:
    """One vocab-parallel output layer (megatron's ``ColumnParallelLinear``, this rank's slice of
    a 96-word vocabulary) and megatron's unfused loss, whole and chunked: the largest error / bound
    ratios of the loss, the input gradient and the weight gradient."""
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from kpool_layers.chunked_loss import chunked_head_loss

    s, b, h, vocab = 24, 2, 16, 96
    gen = torch.Generator().manual_seed(5)
    full_hidden = torch.randn(s, b, h, generator=gen)
    full_weight = torch.randn(vocab, h, generator=gen)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    grad_loss = torch.rand(b, s, generator=gen)
    rank = ps.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True)
    layer = ColumnParallelLinear(h, vocab, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                 gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(full_weight.chunk(tp)[rank])
    local = full_hidden.chunk(tp)[rank] if sp else full_hidden

    def loss_of_logits(lab: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, lab.t().contiguous()).t()

    results = {}
    for mode in ("whole", "chunked"):
        hidden = local.clone().requires_grad_(True)
        layer.weight.grad = None
        if mode == "whole":
            logits, _ = layer(hidden)
            loss = loss_of_logits(labels, logits)
        else:
            loss = chunked_head_loss(hidden, layer, None, labels, loss_of_logits, chunk)
        loss.backward(grad_loss)
        results[mode] = (loss.detach(), hidden.grad, layer.weight.grad.clone())
    (loss, gh, gw), (ref_loss, ref_gh, ref_gw) = results["chunked"], results["whole"]
    # The terms of the weight gradient, for its bound: this rank's logit gradients of every token.
    logits = (full_hidden @ layer.weight.detach().t()).requires_grad_(True)
    loss_of_logits(labels, logits).backward(grad_loss)
    logit_scale = (full_hidden.abs() @ layer.weight.abs().t()).max()
    return {"loss": float((loss - ref_loss).abs().max() / (2 * (h - 1) * EPS32 * logit_scale)),
            "input_grad": float((gh - ref_gh).abs().max()
                                / ((h - 1) * EPS32 * (ref_gh.abs().max() + logit_scale))),
            "weight_grad": float(((gw - ref_gw).abs() / _weight_grad_bound(full_hidden, logits.grad)).max())}


def test_the_head_at_tp1(single_rank_parallel_state) -> None:
    """Chunks of 7 over 24 tokens (7 + 7 + 7 + 3) and chunks longer than the sequence."""
    for chunk in (7, 64):
        assert all(r <= 1 for r in _head_case(False, 1, chunk).values()), chunk


def _tp_worker(rank: int, port: int, queue) -> None:  # noqa: ANN001 - a multiprocessing queue
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    found = {f"sp={sp}/{k}": v for sp in (False, True) for k, v in _head_case(sp, 2, 5).items()}
    if rank == 0:
        queue.put(found)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.dist
def test_the_head_at_tp2() -> None:
    """Two gloo ranks, each with half the vocabulary (sequence parallel: half the tokens too),
    chunks of 5 over the 24 tokens (12 per rank under sequence parallelism, gathered first)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_tp_worker, args=(free_port(), queue), nprocs=2, join=True, start_method="spawn")
    found = queue.get()
    assert len(found) == 6 and all(r <= 1 for r in found.values()), found


def _largest_vocab_tensor(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, vocab: int) -> int:
    """The most elements of any tensor whose last dimension is ``vocab`` (logits, their
    gradients, the loss's buffers of their shape) that an op created during the forward and
    backward of ``model``, leaving out those of the output weight's size (``[V, h]``: the weight,
    its transpose and its gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    largest = [0]
    weight_numel = model.output_layer.weight.numel()

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab
                        and t.numel() != weight_numel):
                    largest[0] = max(largest[0], t.numel())
            return out

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with Sizes():
        model(tokens, positions, None, labels=labels).sum().backward()
    return largest[0]


def test_the_chunked_head_never_creates_the_whole_logits(single_rank_parallel_state) -> None:
    """Every tensor of glm5_tiny's forward and backward at 2 x 96 tokens whose last dimension is
    the vocabulary (640 here: no other dimension of the model has that size): the whole-sequence
    model creates the logits ``[96, 2, 640]``, the chunked one (chunks of 32) nothing larger than a
    chunk's ``[32, 2, 640]``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 512, (2, 96), generator=gen)
    labels = torch.randint(0, 512, (2, 96), generator=gen)
    vocab = "model.vocab_size=640"
    assert _largest_vocab_tensor(_tiny(0, vocab), tokens, labels, 640) == 96 * 2 * 640
    assert _largest_vocab_tensor(_tiny(32, vocab), tokens, labels, 640) == 32 * 2 * 640


@pytest.mark.gpu
def test_the_fused_loss_in_chunks_on_gpu(single_rank_parallel_state) -> None:
    """bf16 glm5_tiny with the Triton loss (``ChunkedFusedLossGPTModel``), whole against chunks of
    48 over 2 x 128 tokens (48 + 48 + 32). Per token the same kernels run on the same values,
    except that cuBLAS may pick another GEMM algorithm for fewer rows: a bf16 logit may then
    round to the neighbouring value, one step of 2^-8 relative to ``max|logit|``; the loss
    ``lse - x_label`` moves by at most twice that. Each logit gradient ``g (p - onehot)`` then
    moves by at most ``g p`` times that logit shift's effect (``2 * 2^-8 max|logit|`` relative) plus
    one bf16 rounding (2^-8); every parameter gradient is linear in them, so the total gradient
    norm moves by at most ``2^-8 (1 + 2 max|logit|)`` relative, again twice for the rounding of
    the GEMMs' bf16 outputs downstream: ``2^-7 (1 + 2 max|logit|)``."""
    from kpool_layers.chunked_loss import ChunkedFusedLossGPTModel

    torch.manual_seed(0)
    ref = _tiny(0, "precision=bf16", "model.dsa_kernels=triton").cuda()
    chunked = _tiny(48, "precision=bf16", "model.dsa_kernels=triton").cuda()
    assert type(chunked) is ChunkedFusedLossGPTModel
    chunked.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 128), generator=gen).cuda()
    labels = torch.randint(0, 512, (2, 128), generator=gen).cuda()
    with torch.no_grad():
        logits = ref(tokens, torch.arange(128, device="cuda").expand(2, -1), None)
    top = float(logits.float().abs().max())
    ref_loss, ref_grads = _loss_and_grads(ref, tokens, labels)
    loss, grads = _loss_and_grads(chunked, tokens, labels)
    assert (loss - ref_loss).abs().max() <= 2 * 2.0**-8 * top
    norm = lambda gs: torch.sqrt(sum(g.float().square().sum() for g in gs.values()))  # noqa: E731
    assert abs(norm(grads) - norm(ref_grads)) <= 2.0**-7 * (1 + 2 * top) * norm(ref_grads)
