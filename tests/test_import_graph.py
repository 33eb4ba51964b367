"""The import graph of ``kpool_layers`` and ``recipes``: no cycles, and no stale import anywhere.

Both checks read the sources with :mod:`ast` and import nothing, so they cover the imports inside
functions too: the kernel routes (``from kpool_layers.kernels import ...`` inside a function that
runs only on CUDA) and the lazy imports that would otherwise hide a cycle from Python's import
order. The floors hold too: ``kpool_layers`` imports nothing from ``recipes``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kpool_layers", "recipes")
SOURCES = ("kpool_layers", "recipes", "scripts", "tests", "train.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the two packages (``recipes/conf`` holds no code)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "conf" not in path.relative_to(ROOT).parts:
                out[module_name(path)] = path
    return out


MODULES = package_modules()


def source_files() -> list[Path]:
    files = []
    for entry in SOURCES:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "conf" not in p.parts)
    return files


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import statement in ``path``, at any depth
    (module level, functions, methods, ``if TYPE_CHECKING`` blocks); ``import a.b`` has no names."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module_name(path).split(".")
                pkg = pkg if path.name == "__init__.py" else pkg[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base, [alias.name for alias in node.names]))
    return out


def edges(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports (an imported name that is a module counts as one)."""
    out = set()
    for _, base, names in imports(path):
        for cand in [f"{base}.{n}" for n in names] + [base]:
            while cand and cand not in MODULES:
                cand = cand.rpartition(".")[0]
            if cand and cand != name:
                out.add(cand)
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_edge() -> None:
    """The checker itself: a -> b -> c -> a is one component, d hangs off it."""
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_counting_function_level_imports() -> None:
    graph = {name: edges(name, path) for name, path in MODULES.items()}
    assert strongly_connected(graph) == []


def test_kpool_layers_never_imports_recipes() -> None:
    bad = [f"{MODULES[name].relative_to(ROOT)} -> {target}"
           for name in MODULES if name.startswith("kpool_layers")
           for target in edges(name, MODULES[name]) if target.startswith("recipes")]
    assert bad == []


def test_kernels_import_only_kernels_and_contracts() -> None:
    """A kernel never imports the module that routes to it: besides other kernels, only contracts
    (formats, layout checks, selection order, device copies); package ``__init__`` files hold
    docstrings only."""
    contracts = {"kpool_layers.precision.fp8_format", "kpool_layers.dsa.sparse_attention",
                 "kpool_layers.dsa.topk", "kpool_layers.compat.device_copy"}
    bad = [f"{name} -> {target}" for name in MODULES if name.startswith("kpool_layers.kernels.")
           for target in edges(name, MODULES[name])
           if not target.startswith("kpool_layers.kernels") and target not in contracts
           and MODULES[target].name != "__init__.py"]
    assert bad == []


def top_level_names(path: Path) -> set[str]:
    """Names a module binds at its top level (defs, classes, assignments, imports), read statically."""
    names: set[str] = set()
    nodes = list(ast.parse(path.read_text(), str(path)).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            nodes += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            nodes += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def stale(path: Path) -> list[str]:
    """Every import in ``path`` of a package module that does not exist or lacks the name."""
    out = []
    for line, base, names in imports(path):
        if base.split(".")[0] not in PACKAGES:
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}"
        if base not in MODULES:
            out.append(f"{where}: no module {base}")
            continue
        defined = top_level_names(MODULES[base])
        out += [f"{where}: {base} has no {n}" for n in names
                if n != "*" and f"{base}.{n}" not in MODULES and n not in defined]
    return out


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_names_an_existing_module_and_name(path: Path) -> None:
    """Static, so the imports inside CUDA-only routes are checked on a CPU too."""
    assert stale(path) == []


def test_the_stale_import_check_catches_a_moved_module(tmp_path: Path) -> None:
    """The checker itself, on a file that imports a module from its pre-layout path and a name
    that left its module."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kpool_layers import fp8\n"
                     "    from kpool_layers.precision.fp8 import RECIPES\n"
                     "    from kpool_layers.precision.fp8_format import RECIPES as ok\n")
    assert stale(probe) == ["probe.py:2: kpool_layers has no fp8",
                            "probe.py:3: kpool_layers.precision.fp8 has no RECIPES"]
