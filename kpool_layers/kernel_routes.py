"""Kernel routes: the one pattern by which every place that picks a kernel picks it.

A :class:`Route` is one key (``"hadamard"``, ``"fp8_quant"``, ``"dsa"``, ...) with an ordered
table of :class:`KernelBackend` s, most preferred first, the last one the portable fallback. Each
backend states the machine it needs as *decline* checks (:class:`Machine` -> a reason, or None):
no CUDA device, a compute capability below what it needs, a package that is not installed.
:meth:`Route.resolve` walks the table once, before the model is built, and returns a
:class:`Resolution`: the chosen backend, the reason every preferred backend declined, and the
backend's callable (its ``load`` imports the kernel module on demand, so CPU CI never imports
CUDA-only code at import time). A route asked for one backend explicitly (a config key such as
``model.dsa_kernels``) raises :class:`KernelUnavailable` naming the key, the reason and the
allowed values when that backend declines, instead of falling back.

A kernel that takes only some tensors (a device, dtype or shape guard) declines per call as
well, by the guard it already has (``supports(x)``); the owner then calls the fallback's callable
(megatron-core's ``experimental_attention_variant.dsa_kernels`` hooks fall back the same way when
a backend returns None). Machine checks are never repeated per call.

The owning modules define their routes beside the code that calls them and :func:`register`
them here; :func:`resolutions` lists the latest choice of every registered key (the kernel part of
the precision map, ``recipes.observe.precision_map.route_rows``). This module imports no other
module of ``kpool_layers`` and no kernel imports it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


class KernelUnavailable(ValueError):
    """A backend asked for explicitly that cannot run here; the message names the key and the fix."""


@dataclass(frozen=True)
class Machine:
    """What the decline checks look at: whether a CUDA device is there and its compute capability
    (None: this machine's, asked of torch only by a check that needs it, since asking initialises
    CUDA). Packages are looked up by :func:`needs_package` itself."""

    cuda: bool
    capability: Optional[tuple[int, int]] = None
    planned: bool = False
    """A machine a dry run plans for (a Hopper GPU with every package), not this one."""

    @staticmethod
    def here() -> "Machine":
        """This process' machine."""
        return Machine(cuda=torch.cuda.is_available())

    @staticmethod
    def planned_gpu() -> "Machine":
        """The GPU machine a dry run on another box plans for: compute capability 9.0, every
        package installed."""
        return Machine(cuda=True, capability=(9, 0), planned=True)

    def device_capability(self) -> Optional[tuple[int, int]]:
        """The compute capability: the given one, else this machine's (None without CUDA)."""
        if self.capability is not None or not self.cuda:
            return self.capability
        return torch.cuda.get_device_capability()


Decline = Callable[[Machine], Optional[str]]
"""A machine check: the reason a backend cannot run on the machine, or None."""


def needs_cuda(machine: Machine) -> Optional[str]:
    """Declines without a CUDA device."""
    return None if machine.cuda else "no CUDA device"


def needs_capability(major: int, minor: int) -> Decline:
    """Declines below compute capability ``major.minor`` (and without a CUDA device)."""

    def check(machine: Machine) -> Optional[str]:
        if not machine.cuda:
            return "no CUDA device"
        capability = machine.device_capability()
        if capability is not None and capability < (major, minor):
            return f"compute capability {capability} < ({major}, {minor})"
        return None

    return check


def needs_package(name: str, install: str = "") -> Decline:
    """Declines where the Python package ``name`` is not installed (``install``: how to get it)."""

    def check(machine: Machine) -> Optional[str]:
        if machine.planned or importlib.util.find_spec(name) is not None:
            return None
        return f"package {name!r} not installed" + (f" ({install})" if install else "")

    return check


@dataclass(frozen=True)
class KernelBackend:
    """One row of a route's table: ``name``, the machine checks that may decline it, ``load`` (a
    function that imports the implementation on demand and returns what the owner calls), whether
    an ``auto`` resolution may pick it (a backend only taken when asked for sets it False), and a
    one-line ``summary`` of what it runs."""

    name: str
    load: Callable[[], Any]
    summary: str
    declines: tuple[Decline, ...] = ()
    automatic: bool = True
    auto_declines: tuple[Decline, ...] = ()
    """Checks that only an ``auto`` resolution applies (where it runs when asked for, but is not
    the best choice unasked, e.g. a GPU older than the one it is tuned for)."""

    def decline(self, machine: Machine, automatic: bool = False) -> Optional[str]:
        """The first reason this backend cannot run on ``machine`` (with ``automatic``: or should
        not be picked unasked), or None."""
        for check in self.declines + (self.auto_declines if automatic else ()):
            reason = check(machine)
            if reason is not None:
                return reason
        return None


@dataclass(frozen=True)
class Resolution:
    """A route's choice: ``backend`` (its name), ``kernel`` (what its ``load`` returned),
    ``declined`` (backend name -> reason, for every backend tried before it), ``forced`` (asked
    for by ``config_key`` rather than picked)."""

    key: str
    backend: str
    kernel: Any
    declined: dict[str, str]
    forced: bool
    config_key: Optional[str]

    def row(self) -> dict[str, Any]:
        """The precision map's entry of this choice (JSON-serialisable)."""
        return {"key": self.key, "backend": self.backend, "forced": self.forced,
                "config_key": self.config_key, "declined": dict(self.declined)}


@dataclass
class Route:
    """One kernel key and its table (module docstring). ``config_key``: the config key that may
    ask for a backend by name (None: none does)."""

    key: str
    backends: tuple[KernelBackend, ...]
    summary: str
    config_key: Optional[str] = None
    latest: Optional[Resolution] = field(default=None, compare=False)
    """The latest :meth:`resolve` result (what :func:`resolutions` lists)."""
    _default: Optional[Resolution] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        last = self.backends[-1] if self.backends else None
        if last is None or last.declines or last.auto_declines or not last.automatic:
            raise ValueError(f"route {self.key!r}: the last backend is the fallback and must not decline")

    @property
    def names(self) -> list[str]:
        """The backend names, in table order."""
        return [b.name for b in self.backends]

    def backend(self, name: str) -> KernelBackend:
        """The table row ``name``; a clear error naming the key and the allowed values otherwise."""
        for b in self.backends:
            if b.name == name:
                return b
        where = self.config_key or f"kernel route {self.key!r}"
        raise KernelUnavailable(f"{where}={name!r}; allowed: {self.names}")

    def resolve(self, forced: Optional[str] = None, machine: Optional[Machine] = None) -> Resolution:
        """The backend to run on ``machine`` (default :meth:`Machine.here`): ``forced`` (a name;
        raises :class:`KernelUnavailable` when it declines), else the first automatic backend that
        does not decline. Loads its callable and records the result as :attr:`latest`."""
        machine = machine if machine is not None else Machine.here()
        declined: dict[str, str] = {}
        if forced is not None:
            chosen = self.backend(forced)
            reason = chosen.decline(machine)
            if reason is not None:
                where = self.config_key or f"kernel route {self.key!r}"
                raise KernelUnavailable(f"{where}={forced} cannot run here: {reason}; allowed: {self.names}")
        else:
            chosen = self.backends[-1]
            for b in self.backends:
                if not b.automatic:
                    declined[b.name] = f"taken only when asked for ({self.config_key})"
                    continue
                reason = b.decline(machine, automatic=True)
                if reason is None:
                    chosen = b
                    break
                declined[b.name] = reason
        kernel = chosen.load() if not machine.planned else None
        self.latest = Resolution(self.key, chosen.name, kernel, declined, forced is not None, self.config_key)
        return self.latest

    def take(self, name: str) -> Resolution:
        """Record ``name`` as this route's choice, made and checked by the owner (a config rule
        that also checks shapes and determinism) rather than by :meth:`resolve`; loads its callable.
        Where :attr:`latest` already chose ``name`` (an ``auto`` the owner resolved through
        :meth:`resolve`), its declined reasons are kept."""
        chosen = self.backend(name)
        before = self.latest if self.latest is not None and self.latest.backend == name else None
        declined, forced = (before.declined, before.forced) if before is not None else ({}, True)
        self.latest = Resolution(self.key, name, chosen.load(), declined, forced, self.config_key)
        return self.latest

    def default(self) -> Resolution:
        """:meth:`resolve` on this machine without a forced backend, done once and kept (the
        resolution of the module-level dispatchers, whose hot paths call this)."""
        if self._default is None:
            self._default = self.resolve()
        return self._default

    def pin(self, name: Optional[str]) -> None:
        """Make :meth:`default` return backend ``name`` from now on (:meth:`resolve` forced to it:
        a backend that declines here raises), or with None this machine's automatic choice again;
        for benchmarks that time two backends of a key in one process."""
        self._default = None if name is None else self.resolve(forced=name)


ROUTES: dict[str, Route] = {}
"""Every registered route by key (registered by the module that owns it)."""


def register(route: Route) -> Route:
    """Add ``route`` to :data:`ROUTES` (a key registered twice is an error) and return it."""
    if route.key in ROUTES and ROUTES[route.key] is not route:
        raise ValueError(f"kernel route {route.key!r} is registered twice")
    ROUTES[route.key] = route
    return route


def resolutions(machine: Optional[Machine] = None) -> list[dict[str, Any]]:
    """One :meth:`Resolution.row` per registered key, sorted by key, with each route's ``summary``
    and ``allowed`` backends: its latest resolution, or its automatic one on ``machine`` where it
    was not resolved yet."""
    rows = []
    for key in sorted(ROUTES):
        route = ROUTES[key]
        resolution = route.latest or (route.default() if machine is None else route.resolve(machine=machine))
        rows.append({**resolution.row(), "allowed": route.names, "summary": route.summary})
    return rows
