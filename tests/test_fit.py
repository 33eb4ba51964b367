"""recipes.plan.fit: the dry run's "does not fit" verdict came with no suggestion. Each suggestion
is an override line that, pasted after the command, composes, passes every config rule and plans
a largest stage that fits its GPU size (same plan, same parameter counts)."""

from __future__ import annotations

import time

import pytest

from recipes.config.rules import validate
from recipes.config.typed import to_config
from recipes.plan import fit
from recipes.plan.memory_plan import GPU_SIZES_GB, fits, plan_groups
from tests.test_config import _compose

# Parameter counts of a GLM-5.2-sized model (78 layers, 3 dense, ~753 B in all): per layer
# (dense, expert), and the embedding, output head and MTP block. Made up to that scale: the
# search only reads these counts (the dry run takes them from the meta-built model).
GLM5_2_GROUPS = ([(int(1.2e9), 0)] * 3 + [(int(0.4e9), int(9.6e9))] * 75,
                 {"embedding": (int(0.95e9), 0), "head": (int(0.95e9), 0), "mtp": (int(0.4e9), int(9.6e9))})


def _largest(overrides: list[str], groups=GLM5_2_GROUPS) -> tuple[float, int]:
    composed = _compose(overrides)
    world = composed.parallelism.nodes * composed.parallelism.gpus_per_node
    validate(composed, world)  # raises ConfigError naming the key if a rule is broken
    return max(s.total for s in plan_groups(to_config(composed), groups)), world


def test_every_suggestion_pasted_after_the_command_fits() -> None:
    base = ["model=glm5_2", "train.dry_run=true"]
    start = time.perf_counter()
    found = fit.suggestions(to_config(_compose(base)), GLM5_2_GROUPS)
    assert time.perf_counter() - start < 20  # the dry run waits for it
    assert [s.gpu for s in found] == list(GPU_SIZES_GB)  # 1 GPU fits none; each size gets one
    for s in found:
        largest, world = _largest(base + list(s.overrides))
        assert fits(largest, GPU_SIZES_GB[s.gpu]) and largest == pytest.approx(s.largest_gib)
        assert world == s.gpus and f"parallelism.nodes={world // 8}" in s.overrides
    assert found[0].gpus >= found[1].gpus >= found[2].gpus  # smaller GPUs need no fewer of them
    lines = fit.report(to_config(_compose(base)), GLM5_2_GROUPS)
    assert lines[0].startswith("to fit, add to the command")
    assert lines[1] == found[0].line() and lines[1].startswith("  80 GB (A100/H100): parallelism.")


def test_the_configured_machine_is_kept_when_a_layout_on_it_fits() -> None:
    base = ["experiment=glm5_2_h200_64n", "data=mock", "train.dry_run=true"]
    largest, _ = _largest(base)
    wanted = [name for name, gb in GPU_SIZES_GB.items() if not fits(largest, gb)]
    assert wanted  # this scale does not fit the smallest GPU as configured
    for s in fit.suggestions(to_config(_compose(base)), GLM5_2_GROUPS):
        assert s.gpus == 512 and not any(o.startswith(("parallelism.nodes=", "parallelism.gpus_per_node="))
                                         for o in s.overrides), s
        assert fits(_largest(base + list(s.overrides))[0], GPU_SIZES_GB[s.gpu])


def test_no_suggestion_when_it_fits_and_a_line_when_nothing_does() -> None:
    tiny = to_config(_compose(["model=glm5_tiny", "train.dry_run=true"]))
    small = ([(1000, 2000)] * tiny.model.num_layers, {"embedding": (500, 0), "head": (500, 0), "mtp": (0, 0)})
    assert fit.report(tiny, small) == [] and fit.suggestions(tiny, small) == []
    # one dense layer larger than any TP (at most 8, the heads' divisors) x PP split can hold
    huge = ([(int(2e12), 0)] + small[0][1:], small[1])
    assert fit.report(tiny, huge)[1:] == [f"  {name}: no layout up to {fit.MAX_GPUS} GPUs fits"
                                          for name in GPU_SIZES_GB]
