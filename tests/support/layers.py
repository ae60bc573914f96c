"""The package's layer rules, and a checker that reads every module's imports (AST, nothing imported).

The rules are docs/architecture.md's diagram as data: :data:`ALLOWED` says which of the package's
own layers each layer may import, :data:`FORBIDDEN` which third-party packages it must not.
:func:`violations` returns one line per broken rule, naming the importing module, its line and the
edge; an empty list means the tree keeps the design. It checks every import, also those inside
functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "diloco_serverless"

#: layer -> the package's layers it may import (besides itself). A layer is a subpackage or a
#: top-level module; "" is the package's own ``__init__`` (lazy re-exports only).
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "config": frozenset({"errors"}),
    "store": frozenset({"errors"}),
    "run": frozenset({"errors", "config", "store"}),
    "exchange": frozenset({"errors", "config", "store", "run"}),
    "loss": frozenset({"errors"}),
    "data": frozenset({"errors", "config", "store", "loss"}),
    "rl": frozenset({"errors", "config", "loss", "data"}),
    "trainer": frozenset({"errors", "config", "store", "run", "exchange", "loss", "data", "rl"}),
    "executors": frozenset({"errors", "config", ""}),
    "tracking": frozenset({"errors", "config"}),
    "launcher": frozenset({"errors", "config", "store", "run", "executors", "tracking", ""}),
    "cli": frozenset({"errors", "config", "store", "run", "executors", "tracking", "launcher", "replay", ""}),
    "entrypoints": frozenset({"errors", "config", "store", "run", "exchange", "loss", "data", "trainer",
                              "executors", "rl"}),
    "testing": frozenset({"errors", "config", "store", "run", "exchange", "trainer"}),
    "replay": frozenset({"errors", "config", "store"}),
    "": frozenset(),
}

_NO_TORCH = frozenset({"torch", "torchft", "transformers", "safetensors.torch", "typer", "rich"})
#: layer -> third-party modules (and their submodules) it must never import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "errors": _NO_TORCH,
    "config": _NO_TORCH,
    "store": _NO_TORCH,
    "run": _NO_TORCH,
    "executors": _NO_TORCH,
    "tracking": _NO_TORCH,
    "launcher": _NO_TORCH,
    "replay": _NO_TORCH,
    "cli": frozenset({"torch", "torchft", "transformers", "safetensors.torch"}),
    "exchange": frozenset({"torchft", "transformers", "typer", "rich"}),
    "loss": frozenset({"torchft", "typer", "rich"}),
    "data": frozenset({"torchft", "typer", "rich"}),
    "rl": frozenset({"torchft", "typer", "rich"}),
    "trainer": frozenset({"typer", "rich"}),
    "entrypoints": frozenset({"typer", "rich"}),
    "testing": frozenset({"typer", "rich"}),
    "": _NO_TORCH,
}


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` (a module) imports ``target`` (a module) at ``path:line``."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.name}:{self.line}: {self.source} imports {self.target}"


def module_name(root: Path, path: Path) -> str:
    """``diloco_serverless.store.errors`` for ``<root>/diloco_serverless/store/errors.py``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of a module of the package: its first component below the package ('' for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` (the folder holding ``diloco_serverless/``)."""
    return {module_name(root, p): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def _resolve(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(root: Path) -> Iterator[Edge]:
    """Every import statement of the package, as edges to module names (first-party or not).

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the package,
    otherwise to ``pkg``.
    """
    known = modules(root)
    for source, path in known.items():
        tree = ast.parse(path.read_text("utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Edge(source, alias.name, path, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, source, path.name == "__init__.py")
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    yield Edge(source, sub if sub in known else target, path, node.lineno)


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(root: Path) -> list[str]:
    """Imports of a layer the source's layer may not use, and forbidden third-party imports."""
    out: list[str] = []
    for edge in imports(root):
        src = layer_of(edge.source)
        if _is_under(edge.target, PACKAGE):
            dst = layer_of(edge.target)
            if dst != src and dst not in ALLOWED[src]:
                out.append(f"{edge}: layer '{src or PACKAGE}' may not import layer '{dst or PACKAGE}'")
        else:
            for banned in FORBIDDEN.get(src, frozenset()):
                if _is_under(edge.target, banned):
                    out.append(f"{edge}: layer '{src or PACKAGE}' may not import {banned}")
    return out


def cycles(root: Path) -> list[list[str]]:
    """Import cycles between the package's modules (strongly connected components of size > 1)."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for edge in imports(root):
        if edge.target in graph and edge.target != edge.source:
            graph[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(root: Path) -> list[str]:
    """Every broken rule under ``root``: layer edges, forbidden imports and import cycles."""
    out = layer_violations(root)
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(root)]
    unknown = sorted({layer_of(m) for m in modules(root)} - set(ALLOWED))
    out += [f"layer '{name}' is not in the layer rules (tests/support/layers.py, docs/architecture.md)"
            for name in unknown]
    return out
