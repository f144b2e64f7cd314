"""rpmemfs/errors.py's table names every error class rpmemfs raises on purpose: each subclass of
RpmemfsError in the package, found in the source (ast), so that modules needing pyverbs count
too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rpmemfs import errors

ROOT = Path(__file__).resolve().parents[2] / "rpmemfs"


def _bases() -> dict[str, set[str]]:
    """class name -> the names of its bases, for every class of the package."""
    found: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                found.setdefault(node.name, set()).update(names)
    return found


def _error_classes() -> set[str]:
    bases = _bases()
    out = {"RpmemfsError"}
    grew = True
    while grew:
        more = {name for name, of in bases.items() if of & out} - out
        out |= more
        grew = bool(more)
    return out - {"RpmemfsError"}


def test_the_table_lists_every_error_class() -> None:
    doc = errors.__doc__ or ""
    table = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    listed = set(re.findall(r"\b[A-Z]\w*Error\b", "\n".join(table)))
    found = _error_classes()
    assert len(found) > 20
    assert found - listed == set(), "rpmemfs/errors.py's table leaves them out"
    assert listed - found == set(), "rpmemfs/errors.py's table names classes that do not exist"
