"""The package's shape: no import cycles, layers that import one way, long modules that say why.

The import graph is read from the source (ast), so it counts imports inside functions too, and
importing ``a.b.c`` counts as importing the packages ``a`` and ``a.b`` as well, since Python
runs their ``__init__`` first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rpmemfs"
LONG = 500
LONG_MARK = "Why this module is long:"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            if not t.startswith("rpmemfs"):
                continue
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            # the module itself, and every package on the way to it
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep != name and dep in MODULES and not name.startswith(dep + "."):
                    out.add(dep)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


# Known exceptions, none left since issue 13. The lists are exact: a new cycle, wrong-way import
# or unexplained long module fails, and so does fixing a listed one without deleting it here.
KNOWN_CYCLES: list[list[str]] = []
KNOWN_WRONG_WAY: dict[str, list[str]] = {}
KNOWN_LONG: set[str] = set()


def test_no_import_cycles() -> None:
    assert sorted(_cycles()) == KNOWN_CYCLES


# layer -> layers it must never import (the layer's own subpackages included).
FORBIDDEN = {
    "rpmemfs.pool": ["fs", "replica", "durability", "transport", "target", "mountd", "fuse", "cli", "tools"],
    "rpmemfs.fs": ["replica", "durability", "transport", "target", "mountd", "fuse", "cli", "tools"],
    "rpmemfs.replica": ["fs", "durability", "mountd", "fuse", "cli", "tools"],
    "rpmemfs.durability": ["fs", "mountd", "fuse", "cli", "tools", "transport", "target"],
    "rpmemfs.transport": ["fs", "pool", "replica", "durability", "target", "mountd", "fuse", "cli", "tools"],
    "rpmemfs.target": ["fs", "replica", "durability", "mountd", "fuse", "cli", "tools"],
    "rpmemfs.pmem": ["fs", "replica", "durability", "transport", "target", "mountd", "fuse", "cli", "tools"],
    "rpmemfs.fuse": ["replica", "transport", "target", "mountd", "cli", "tools"],
    "rpmemfs.mountd": ["cli", "tools"],
}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_one_way(layer: str) -> None:
    bad = {f"rpmemfs.{x}" for x in FORBIDDEN[layer]}
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if name == layer or name.startswith(layer + ".")
        for dep in deps
        if any(dep == b or dep.startswith(b + ".") for b in bad)
    )
    assert wrong == KNOWN_WRONG_WAY.get(layer, [])


def test_long_modules_say_why() -> None:
    unexplained = []
    for name, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > LONG and LONG_MARK not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(name)
    assert set(unexplained) == KNOWN_LONG


def test_the_graph_is_read() -> None:
    # Guards the test itself: a parser that found no edges would pass everything above.
    assert "rpmemfs.pool.layout" in GRAPH["rpmemfs.pool.header"]
    # importing rpmemfs.replica.spec runs rpmemfs/replica/__init__.py first
    assert {"rpmemfs.replica", "rpmemfs.replica.spec"} <= GRAPH["rpmemfs.mountd.daemon"]
    assert len(MODULES) > 50
