"""Two rules of docs/architecture.md that no import graph shows: no module uses another's
private names, and no class grows past about 30 methods (one job each; the FUSE edge's
Operations, one handler per request, and the tools aside)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rpmemfs"
# Underscored names that are public API of the standard library (namedtuple, os).
STDLIB_PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_exit"}
MAX_METHODS = 30
BIG_ON_PURPOSE = {("fuse.py", "Operations")}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines: its methods and attributes, and what its methods set on self."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def private_uses(path: str, tree: ast.Module) -> list[str]:
    """Private names this module takes from elsewhere: imported from another module, or read
    off an object other than self, cls or an instance of the class it is written in."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rpmemfs"):
            found += [f"{path}: imports {a.name} from {node.module}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]

    def visit(node: ast.AST, own: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, _own_names(child))
                continue
            if (isinstance(child, ast.Attribute) and child.attr.startswith("_")
                    and not child.attr.startswith("__") and child.attr not in STDLIB_PUBLIC):
                on_self = isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")
                if not on_self and child.attr not in own:
                    found.append(f"{path}:{child.lineno}: {ast.unparse(child)}")
            visit(child, own)

    visit(tree, set())
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    found = [use for path, tree in _modules() for use in private_uses(path, tree)]
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_a_reach_into_another_object() -> None:
    reach = ast.parse("class A:\n    def f(self, fs):\n        return fs._touch(1)\n")
    same_class = ast.parse(
        "class A:\n    def _g(self): ...\n    def f(self, other):\n        return other._g()\n"
    )
    imported = ast.parse("from rpmemfs.fs.data import _zero_tail\n")
    assert private_uses("a.py", reach) == ["a.py:3: fs._touch"]
    assert private_uses("a.py", same_class) == []
    assert private_uses("a.py", imported) == ["a.py: imports _zero_tail from rpmemfs.fs.data"]


def _is_method(node: ast.stmt) -> bool:
    """A def that is behaviour: not a dunder, not a property (an attribute read or set)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
        return False
    decorators = node.decorator_list
    return not any(isinstance(d, ast.Name) and d.id == "property" for d in decorators) and not any(
        isinstance(d, ast.Attribute) and d.attr == "setter" for d in decorators
    )


def test_no_class_over_about_30_methods() -> None:
    big = []
    for path, tree in _modules():
        if path.startswith("tools/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (path, node.name) not in BIG_ON_PURPOSE:
                methods = [m for m in node.body if _is_method(m)]
                if len(methods) > MAX_METHODS:
                    big.append(f"{path}: {node.name} has {len(methods)} methods")
    assert not big, "\n".join(big)
