"""The tiers can run in one pytest session (a bare `pytest` collects tests/unit and tests/e2e):
pytest imports test modules by their base name, so two tiers must not share one."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_test_module_names_are_unique_across_tiers() -> None:
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.glob("*/test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {path}")
        seen[path.name] = path
    assert not clashes, clashes
