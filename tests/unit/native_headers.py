"""What test_wire_header.py and test_record_header.py both check of a header generated from
a Python source (native/wire_header.py, native/record_header.py): the generator loaded as the
build loads it, and the built helper's constants and struct layouts against the source's."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rpmemfs.native import ffi, lib

NATIVE = Path(__file__).resolve().parents[2] / "native"


def load_generator(name: str) -> ModuleType:
    """native/NAME.py, imported as native/build.py imports it: with native/ on sys.path."""
    if str(NATIVE) not in sys.path:
        sys.path.insert(0, str(NATIVE))
    return importlib.import_module(name)


def assert_built_constants(expected: dict[str, int], rebuild: str) -> None:
    """The loaded helper was compiled with exactly these values (cffi checks each constant
    against what the C compiler saw: ffi.error when they differ)."""
    built = {}
    for name in expected:
        try:
            built[name] = getattr(lib, name)
        except (AttributeError, ffi.error) as exc:
            pytest.fail(f"{name}: {exc}; {rebuild}")
    assert built == expected, rebuild


def assert_built_struct(cname: str, size: int, members: list[tuple[str, str, int]], rebuild: str) -> None:
    """The compiler laid ``struct cname`` out as the source does: its size, and each field's
    name, C type and offset in order."""
    ctype = ffi.typeof(f"struct {cname}")
    assert ffi.sizeof(ctype) == size, rebuild
    assert [(name, field.type.cname, field.offset) for name, field in ctype.fields] == members, rebuild
