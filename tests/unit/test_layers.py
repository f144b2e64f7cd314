"""The package's shape: no import cycles, between modules or between the package's parts; every
part in a layer, each layer reaching only the layers below it (through any chain of imports);
long modules that say why.

A part is a top-level module (``rpmemfs/units.py``) or a top-level package (``rpmemfs/fs/``,
everything under it). The import graph is read from the source (ast), so it counts imports
inside functions and under TYPE_CHECKING too. Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` first, so it counts as importing those packages as well, except the importer's
own enclosing packages, which Python has begun already when the importer runs: a module depends
on its own package only when it reads the package's namespace (``from rpmemfs.transport import
tokens``, ``import rpmemfs``), which is what makes a package whose ``__init__`` re-exports its
modules a cycle with them.
"""

from __future__ import annotations

import ast
from collections import deque
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


def _known(name: str) -> str:
    """The module ``name`` names, or the package it is an attribute of."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _with_packages(module: str, importer: str) -> set[str]:
    """``module`` and the packages Python runs first to import it, less the importer's own."""
    parts = module.split(".")
    out = {module}
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if not importer.startswith(pkg + "."):
            out.add(pkg)
    return out


def _imports(name: str, source: str, is_pkg: bool = False) -> set[str]:
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rpmemfs"):
                    out |= _with_packages(_known(alias.name), name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("rpmemfs"):
                continue
            # `from P import x` reads P's namespace: P counts, even when it encloses the importer.
            base = _known(base)
            out |= _with_packages(base, name) | {base}
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.add(f"{base}.{alias.name}")
    out.discard(name)
    out.discard("")
    return out


GRAPH = {name: _imports(name, path.read_text(), path.name == "__init__.py") for name, path in MODULES.items()}


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


PARTS = {part(m) for m in MODULES}
PART_GRAPH = {p: {part(d) for m, deps in GRAPH.items() if part(m) == p for d in deps} - {p} for p in PARTS}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted."""
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
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _reached(start: set[str], graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module reached from ``start``, with the chain of imports that reaches it first."""
    paths = {m: [m] for m in sorted(start)}
    todo = deque(sorted(start))
    while todo:
        m = todo.popleft()
        for d in sorted(graph.get(m, ())):
            if d not in paths:
                paths[d] = [*paths[m], d]
                todo.append(d)
    return paths


# Known exceptions: none. The lists are exact: a new cycle or wrong-way import fails, and so
# does fixing a listed one without deleting it here.
KNOWN_CYCLES: list[list[str]] = []
KNOWN_PART_CYCLES: list[list[str]] = []
KNOWN_WRONG_WAY: dict[str, list[str]] = {}
KNOWN_LONG: set[str] = set()


def test_no_import_cycles_between_modules() -> None:
    assert _cycles(GRAPH) == KNOWN_CYCLES


def test_no_import_cycles_between_parts() -> None:
    assert _cycles(PART_GRAPH) == KNOWN_PART_CYCLES


# Every part of the package, top to bottom (docs/architecture.md): a part reaches, directly or
# through others, only parts of its own layer or of layers below it.
LAYERS: list[tuple[str, set[str]]] = [
    ("CLI edge", {"cli"}),
    ("tools", {"tools"}),
    ("cluster agent", {"ha"}),
    ("offline commands", {"admin"}),
    ("daemons", {"mountd", "target"}),
    ("FUSE edge", {"fuse", "poller", "callers"}),
    ("metrics", {"metrics", "metrics_endpoint"}),
    ("durability", {"durability"}),
    ("filesystem", {"fs"}),
    ("replication", {"replica"}),
    ("transport", {"transport"}),
    ("pool files", {"poolfile"}),
    ("persistence", {"pmem"}),
    ("pool format", {"pool"}),
    ("small shared", {"", "errors", "units", "ranges", "logs", "progress", "mountinfo", "native", "printable",
                      "safeopen", "holders", "devdax", "latency", "sdnotify", "cliparse", "poolname",
                      "changeset", "chunksum"}),
]
RANK = {f"rpmemfs.{p}".rstrip("."): i for i, (_, parts) in enumerate(LAYERS) for p in parts}

# What a part never reaches, even where the order above would let it: siblings that stay
# apart, and what a library gets passed in rather than imports (the progress bar is a
# callback; the CLI and the tools are edges nothing below them knows).
CORE = ["pool", "pmem", "poolfile", "fs", "replica", "durability", "transport", "target", "mountd",
        "fuse", "metrics", "metrics_endpoint", "admin"]
NEVER_REACHES = {
    **{c: ["cli", "tools", "progress"] for c in CORE},
    "fs": ["cli", "tools", "progress", "replica", "durability", "transport", "target", "mountd", "fuse"],
    # The offline commands work on a pool nobody mounts: they never reach a daemon or the
    # FUSE edge (targets are reached over the transport, as every initiator reaches them).
    "admin": ["cli", "tools", "progress", "mountd", "target", "fuse"],
    # The resource agent runs daemons as commands and asks them over their sockets: it
    # imports none of the target's code, and nothing of the tools'.
    "ha": ["cli", "tools", "progress", "target"],
    "replica": ["cli", "tools", "progress", "fs", "durability", "target", "mountd", "fuse"],
    "durability": ["cli", "tools", "progress", "fs", "target", "mountd", "fuse"],
    "transport": ["cli", "tools", "progress", "fs", "pool", "pmem", "poolfile", "replica", "durability",
                  "target", "mountd", "fuse"],
    "target": ["cli", "tools", "progress", "fs", "replica", "durability", "mountd", "fuse"],
    "mountd": ["cli", "tools", "progress", "target"],
    "metrics": ["cli", "tools", "progress", "mountd", "target", "fuse", "durability", "fs", "replica"],
    "metrics_endpoint": ["cli", "tools", "progress", "mountd", "target", "fuse", "durability", "fs",
                         "replica"],
}
# What a part reaches only through the layer between, never by an import of its own.
NOT_DIRECTLY = {
    "fuse": ["replica", "transport", "target", "mountd"],  # it asks durability
    "durability": ["transport"],  # it drives replicas through the replica layer
}


def test_every_part_has_a_layer() -> None:
    listed = [p for _, parts in LAYERS for p in parts]
    assert len(listed) == len(set(listed)), "a part listed in two layers"
    assert {f"rpmemfs.{p}".rstrip(".") for p in listed} == PARTS


def _wrong_way(p: str) -> list[str]:
    paths = _reached({m for m in MODULES if part(m) == p}, GRAPH)
    short = p.removeprefix("rpmemfs.")
    never = {f"rpmemfs.{x}" for x in NEVER_REACHES.get(short, [])}
    direct = {f"rpmemfs.{x}" for x in NOT_DIRECTLY.get(short, [])}
    wrong: dict[str, list[str]] = {}
    for m, chain in paths.items():
        q = part(m)
        if q == p:
            continue
        why = ("a layer above" if RANK[q] < RANK[p] else "never" if q in never
               else "directly" if q in direct and len(chain) == 2 else "")
        if why and (q not in wrong or len(chain) < len(wrong[q])):
            wrong[q] = [why, *chain]
    return sorted(f"{p} reaches {q} ({w[0]}): {' -> '.join(w[1:])}" for q, w in wrong.items())


@pytest.mark.parametrize("p", sorted(PARTS))
def test_parts_reach_only_down(p: str) -> None:
    assert _wrong_way(p) == KNOWN_WRONG_WAY.get(p, [])


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
    assert len(MODULES) > 50 and {"rpmemfs.cli", "rpmemfs.fs", "rpmemfs"} <= PARTS


def test_the_rules_see_what_they_are_for() -> None:
    # A sibling module imported by name leaves the own package out; one read from the
    # package's namespace does not (the re-exporting __init__ cycle).
    tcp = "rpmemfs.transport.tcp"
    assert _imports(tcp, "from rpmemfs.transport.tokens import key_id") == {"rpmemfs.transport.tokens"}
    assert _imports(tcp, "from rpmemfs.transport import tokens") == {"rpmemfs.transport",
                                                                    "rpmemfs.transport.tokens"}
    assert _imports(tcp, "from . import tokens") == {"rpmemfs.transport", "rpmemfs.transport.tokens"}
    assert _imports(tcp, "def f():\n    from rpmemfs.metrics import serve") == {"rpmemfs.metrics"}
    assert _imports("rpmemfs.cli", "import rpmemfs.fs.mkfs") == {"rpmemfs.fs", "rpmemfs.fs.mkfs"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # Reached through an intermediate counts, with the chain that shows how.
    assert _reached({"a"}, {"a": {"b"}, "b": {"c"}})["c"] == ["a", "b", "c"]
