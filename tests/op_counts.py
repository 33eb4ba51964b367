"""Counts the aten ops that each module's own code runs, forward and backward (a test helper).

On a GPU every counted op is (at least) one kernel launch, so these counts pin launch budgets on
the CPU. An op is counted for the innermost module whose ``forward`` is running, or in backward
for the module whose forward created the autograd node being run (nodes made by a module's own
code, not by its submodules). Views, metadata and allocation ops launch no kernel and are not
counted.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "expand_as", "permute",
    "transpose", "t", "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "alias", "as_strided", "detach", "unflatten", "flatten", "view_as",
    "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "is_same_size", "_has_compatible_shallow_copy_type",
})
"""aten ops that launch no kernel."""

OUTSIDE = "<outside>"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tuples, lists, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))


class OwnOps(TorchDispatchMode):
    """``with OwnOps(module) as ops: ...`` -> ``ops.counts[(name, "fwd" | "bwd")]``, ``name`` as
    in ``module.named_modules()`` ("" for ``module``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._stack: list[str] = []
        self._owner: dict[Any, str] = {}
        self._hooks = []
        for name, sub in module.named_modules():
            self._hooks.append(sub.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            self._hooks.append(sub.register_forward_hook(self._leave(name), with_kwargs=True))

    def _claim(self, values: Any, owner: str) -> None:
        """Give ``owner`` every autograd node behind ``values`` that no module owns yet."""
        nodes = [t.grad_fn for t in _tensors(values) if t.grad_fn is not None]
        while nodes:
            node = nodes.pop()
            if node is None or node in self._owner or type(node).__name__ == "AccumulateGrad":
                continue
            self._owner[node] = owner
            nodes.extend(parent for parent, _ in node.next_functions)

    def _enter(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._claim((args, kwargs), self._stack[-1] if self._stack else OUTSIDE)  # the caller's
            self._stack.append(name)
        return hook

    def _leave(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self._claim(output, name)
            self._stack.pop()
        return hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._hooks:
            handle.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN204
        name = func._overloadpacket.__name__
        if name not in NO_KERNEL:
            node = torch._C._current_autograd_node()
            if node is not None:
                self.counts[(self._owner.get(node, OUTSIDE), "bwd")] += 1
            else:
                self.counts[(self._stack[-1] if self._stack else OUTSIDE, "fwd")] += 1
        return func(*args, **(kwargs or {}))
