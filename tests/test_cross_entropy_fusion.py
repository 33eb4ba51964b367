"""``train.cross_entropy_fusion``: megatron's native fused cross entropy (its torch.compile'd
``fused_vocab_parallel_cross_entropy``) where it computes what the unfused loss does: on a GPU,
for bf16 logits (it returns bf16 logit gradients, wrong for an fp32 model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kpool_layers.precision import PrecisionPolicy
from recipes.megatron_config import fused_cross_entropy, to_transformer_config
from recipes.typed_config import to_config
from tests.test_config import _compose
from tests.test_cuda_graph import GRAPHS, _losses


@pytest.mark.parametrize(("gpu", "overrides", "fused"), [
    (True, ["precision=bf16"], True),
    (True, ["precision=fp8"], True),
    (True, ["precision=serving_match"], True),
    (True, ["precision=fp32"], False),
    (True, ["precision=bf16", "train.cross_entropy_fusion=false"], False),
    (False, ["precision=bf16"], False),
])
def test_fused_loss_only_for_bf16_logits_on_a_gpu(gpu, overrides, fused) -> None:
    cfg = to_config(_compose(["model=glm5_tiny", *overrides]))
    policy = PrecisionPolicy.from_config(cfg.precision)
    assert fused_cross_entropy(cfg.train.cross_entropy_fusion, policy, gpu) is fused


def test_megatron_gets_the_choice(monkeypatch) -> None:
    """The decision, made from the key, the profile and this machine, reaches megatron's config with
    the native implementation."""
    import recipes.megatron_config as megatron_config

    seen = []
    monkeypatch.setattr(megatron_config, "fused_cross_entropy", lambda *args: seen.append(args) or True)
    cfg = to_config(_compose(["model=glm5_tiny", "precision=bf16", "train.cross_entropy_fusion=false"]))
    tcfg = to_transformer_config(cfg)
    assert tcfg.cross_entropy_loss_fusion is True and tcfg.cross_entropy_fusion_impl == "native"
    (fusion, policy, on_gpu), = seen
    assert fusion is False and policy == PrecisionPolicy.from_config(cfg.precision)
    assert on_gpu is torch.cuda.is_available()


TINY_GPU = ["model=glm5_tiny", "precision=bf16", "model.dsa_kernels=triton", "data.seq_length=256",
            "train.steps=3", "train.lr_warmup_steps=1", "train.micro_batch_size=1", "train.global_batch_size=2",
            "train.save_final=false", "logging.mode=disabled"]


@pytest.mark.gpu
def test_fused_loss_trains_as_the_unfused_one(tmp_path: Path) -> None:
    """Three steps with the unfused loss, the fused loss, and the fused loss inside a CUDA graph
    (compiled in eager step 1, captured at step 2, replayed at step 3).

    First step (same weights, same batch), fused against unfused:
    * loss: both compute the per-token loss in FP32 from the same bf16 logits and differ only in
      the order of the sums over the vocabulary (V = 512 terms): relative difference within
      ``2 * V * 2**-24`` (about 6e-5);
    * grad norm: the logit gradients ``softmax - onehot`` differ by that much before both round
      them to bf16, so each differs by at most one bf16 step (2**-8 relative); the backward is
      linear in them, so the gradient norm within 2**-7 relative.
    Replayed against eager, both fused: bit for bit at every step (the same compiled kernels; the
    tiny model's top-2 routing keeps the MoE sums exact, see tests/test_cuda_graph.py)."""
    unfused = _losses(tmp_path, "unfused", TINY_GPU + ["train.cross_entropy_fusion=false"])
    fused = _losses(tmp_path, "fused", TINY_GPU)
    graphed = _losses(tmp_path, "fused_graphed", TINY_GPU + [GRAPHS, "train.cuda_graph_warmup_steps=1"],
                      captured_at=2)
    (loss, norm), (ref_loss, ref_norm) = (fused[0][0], fused[1][0]), (unfused[0][0], unfused[1][0])
    assert abs(loss - ref_loss) <= 2 * 512 * 2.0**-24 * abs(ref_loss), (fused, unfused)
    assert abs(norm - ref_norm) <= 2.0**-7 * ref_norm, (fused, unfused)
    assert len(fused[0]) == 3 and graphed == fused
