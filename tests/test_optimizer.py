"""recipes.train.optimizer: megatron's torch-Adam fallback switched to torch's fused AdamW at the build.

End to end (a run through ``train.py`` on CPU uses the fused kernel, and a resume reproduces the
uninterrupted run bit for bit with the fused per-parameter ``step`` tensors) is
``tests/test_train.py::test_resume_reproduces_the_uninterrupted_run``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recipes.train.optimizer import adam_step, fusable, inner_optimizers, use_fused_adam


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(7, 5), (5,), (3, 2, 4)]]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], n: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _megatron_like(inner: torch.optim.Optimizer) -> SimpleNamespace:
    """The attribute megatron's (non-chained) optimizers expose: ``.optimizer``."""
    return SimpleNamespace(optimizer=inner)


def test_fallback_adamw_becomes_torch_fused_adamw() -> None:
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, ref = _params(), _params()
    inner = torch.optim.AdamW(mine, **hyper)  # as megatron builds it without TE/apex
    assert use_fused_adam(_megatron_like(inner))
    assert all(g["fused"] and not g["foreach"] for g in inner.param_groups)
    _steps(inner, mine)
    fused = torch.optim.AdamW(ref, fused=True, **hyper)
    _steps(fused, ref)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
        assert torch.equal(inner.state[a]["exp_avg_sq"], fused.state[b]["exp_avg_sq"])
    # the fused kernel keeps every parameter's own step on its device
    assert [inner.state[p]["step"].item() for p in mine] == [3.0] * 3


def test_chained_optimizers_are_all_switched() -> None:
    a, b = torch.optim.AdamW(_params(0)), torch.optim.AdamW(_params(1))
    chained = SimpleNamespace(chained_optimizers=[_megatron_like(a), _megatron_like(b)])
    assert inner_optimizers(chained) == [a, b]
    assert use_fused_adam(chained)
    assert a.param_groups[0]["fused"] and b.param_groups[0]["fused"]


def test_other_optimizers_are_left_alone() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.1)
    assert not fusable(sgd)
    assert not use_fused_adam(_megatron_like(sgd))
    assert not sgd.param_groups[0].get("fused")
    ints = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    ints.param_groups[0]["params"].append(torch.zeros(3, dtype=torch.int64))
    assert not fusable(ints)


def test_switch_refused_once_state_exists() -> None:
    params = _params()
    inner = torch.optim.AdamW(params)
    _steps(inner, params, n=1)
    with pytest.raises(RuntimeError, match="before the optimizer has state"):
        use_fused_adam(_megatron_like(inner))


@pytest.mark.parametrize("flags,on_param", [({"fused": True}, True), ({"capturable": True}, True),
                                            ({"fused": False, "capturable": False}, False)])
def test_adam_step_placement(flags: dict, on_param: bool) -> None:
    param = torch.nn.Parameter(torch.zeros(2, device="meta"))  # a device other than the CPU
    step = adam_step(5, param, flags)
    assert step.dtype == torch.float32 and step.dim() == 0
    assert step.device == (torch.device("meta") if on_param else torch.device("cpu"))
    if not on_param:
        assert step.item() == 5.0
    assert adam_step(5, torch.nn.Parameter(torch.zeros(2)), flags).item() == 5.0
