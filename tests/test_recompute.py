"""``train.recompute_*`` (megatron's activation recompute, ``recipes/config/recompute.py``): every
accepted combination recomputes (the recomputed submodule runs a second forward in backward) and
gives the loss and gradients of no recompute in FP32; the others are refused by name.

Recompute reruns the same ops on the same inputs with the generator states restored, so the
loss and the gradients are bit-equal to no recompute (asserted exactly: a difference means a
recompute that is not a rerun)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from recipes.config.schema import ConfigError
from recipes.config.rules import all_problems
from tests.test_config import _compose
from tests.train_runner import metrics, run_train

ACCEPTED = [  # (overrides, a module name of glm5_tiny that runs twice with it)
    (["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
     "decoder.layers.1.self_attention"),
    (["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=2"],
     "decoder.layers.3.mlp"),
    (["train.recompute_granularity=full", "train.recompute_method=block", "train.recompute_num_layers=1"],
     "decoder.layers.0.self_attention"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[mlp]"], "decoder.layers.0.mlp"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[moe]"],
     "decoder.layers.1.mlp.experts"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[shared_experts]"],
     "decoder.layers.2.mlp.shared_experts"),
]


def _build(overrides: list[str]) -> torch.nn.Module:
    from recipes.config.megatron import to_transformer_config
    from recipes.train.model import build_gpt_model
    from recipes.config.typed import to_config

    cfg = to_config(_compose(["model=glm5_tiny", "precision=fp32", *overrides]))
    return build_gpt_model(cfg, to_transformer_config(cfg))


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter]:
    """Loss ``[b, s]``, parameter gradients and forward calls per module name of one step."""
    calls: Counter = Counter()
    for name, module in model.named_modules():
        module.register_forward_hook(lambda *_, name=name: calls.update([name]))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 40), generator=gen)
    labels = torch.randint(0, 512, (2, 40), generator=gen)
    loss = model(tokens, torch.arange(40).expand(2, -1), None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, calls


GROUPED = ["model.moe_grouped_gemm=true"]  # kpool_layers.moe.experts, the GPUs' default experts


@pytest.mark.parametrize("experts,accepted", [
    ([], ACCEPTED),
    (GROUPED, [(o, "decoder.layers.1.mlp.experts") for o, _ in (ACCEPTED[0], ACCEPTED[4])]),  # full; moe
])
def test_accepted_combinations_recompute_and_equal_no_recompute(experts, accepted,
                                                               single_rank_parallel_state) -> None:
    torch.manual_seed(0)
    ref_model = _build(experts)
    ref_loss, ref_grads, ref_calls = _run(ref_model)
    for overrides, twice in accepted:
        assert not all_problems(_compose(["model=glm5_tiny", *overrides]), 1), overrides
        model = _build(experts + overrides)
        model.load_state_dict(ref_model.state_dict())
        loss, grads, calls = _run(model)
        assert ref_calls[twice] == 1 and calls[twice] == 2, (overrides, twice, calls[twice])
        assert torch.equal(loss, ref_loss), overrides
        assert grads.keys() == ref_grads.keys(), overrides
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items()), overrides


@pytest.mark.parametrize("overrides,key,says", [
    (["train.recompute_granularity=selective"], "train.recompute_modules", "core_attn"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[]"], "train.recompute_modules", "non-empty"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[core_attn]"], "train.recompute_modules",
     "core_attn is refused"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[mla_up_proj]"], "train.recompute_modules",
     "mla_up_proj is refused"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[mlp,moe_act]"], "train.recompute_modules",
     "moe_act is refused"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[layernorm]"], "train.recompute_modules",
     "layernorm is refused"),
    (["train.recompute_granularity=selective", "train.recompute_modules=[attention]"], "train.recompute_modules",
     "'attention' is none"),
    (["model.num_moe_experts=null", "train.recompute_granularity=selective", "train.recompute_modules=[moe]"],
     "train.recompute_modules", "dense model"),
    (["model.moe_first_k_dense_layers=0", "train.recompute_granularity=selective", "train.recompute_modules=[mlp]"],
     "train.recompute_modules", "without dense layers"),
    (["train.recompute_granularity=full", "train.recompute_num_layers=1"], "train.recompute_method", "uniform or block"),
    (["train.recompute_granularity=full", "train.recompute_method=uniform"], "train.recompute_num_layers", "1..4"),
    (["train.recompute_granularity=full", "train.recompute_method=block", "train.recompute_num_layers=5"],
     "train.recompute_num_layers", "1..4"),
    (["train.recompute_method=block"], "train.recompute_method", "null unless"),
    (["train.recompute_num_layers=2"], "train.recompute_num_layers", "null unless"),
    (["train.recompute_granularity=full", "train.recompute_method=block", "train.recompute_num_layers=1",
      "train.recompute_modules=[mlp]"], "train.recompute_modules", "null unless"),
    (["model.mtp_num_layers=1", "train.loss_chunk_tokens=16"], "train.loss_chunk_tokens", "mtp_num_layers"),
])
def test_refused_by_name(overrides: list[str], key: str, says: str) -> None:
    found = all_problems(_compose(["model=glm5_tiny", *overrides]), 1)
    assert len(found) == 1 and isinstance(found[0], ConfigError), found
    assert found[0].key == key and says in found[0].allowed, found[0]


TRAIN = ["model=glm5_tiny", "precision=fp32", "data.seq_length=64", "train.steps=2", "train.lr_warmup_steps=0",
         "train.save_final=false", "logging.mode=disabled"]


def test_two_steps_with_recompute_and_chunked_loss_equal_the_plain_run(tmp_path: Path) -> None:
    """``train.py``, two steps: full recompute of every layer plus the loss in chunks of 24 tokens
    (64 = 24 + 24 + 16) against neither. The forward values are bit-equal (module docstring and
    tests/test_chunked_loss.py); the output weight's gradient is a reordered FP32 sum over 128
    tokens, so step 2's weights, loss and both grad norms may differ by the rounding of that sum
    carried through one Adam step: 128 eps relative bounds it."""
    run_train(tmp_path, "plain", TRAIN)
    run_train(tmp_path, "saving", TRAIN + ["train.recompute_granularity=full", "train.recompute_method=uniform",
                                           "train.recompute_num_layers=1", "train.loss_chunk_tokens=24"])
    plain, saving = ([(r["loss"], r["grad_norm"]) for r in metrics(tmp_path / n) if "loss" in r]
                     for n in ("plain", "saving"))
    assert len(plain) == len(saving) == 2
    assert saving[0][0] == plain[0][0]
    eps = torch.finfo(torch.float32).eps
    for (loss, norm), (ref_loss, ref_norm) in zip(saving, plain):
        assert abs(loss - ref_loss) <= 128 * eps * abs(ref_loss) and abs(norm - ref_norm) <= 128 * eps * ref_norm
