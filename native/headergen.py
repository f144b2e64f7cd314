"""What native/wire_header.py and native/record_header.py share: each turns one Python source
of a binary format into a C header (and the matching cffi cdef), so C never spells the format
itself.

A source is loaded on its own file, without importing the rpmemfs package: these run at build
time, in pip's isolated environment, before the package can be imported, and so they import
the standard library only. native/build.py puts this folder on sys.path and imports them.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

# struct codes as C types (little endian, unpadded: the structs are packed)
C_TYPES = {"B": "uint8_t", "H": "uint16_t", "I": "uint32_t", "Q": "uint64_t"}

Members = list[tuple[str, str, int]]  # (field, C type, offset)


def load_source(path: Path, name: str) -> ModuleType:
    """The Python file at path as a module of its own, not imported through its package."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their class's module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def struct_layout(fields: Iterable[tuple[str, str]]) -> tuple[int, Members]:
    """(size, members) of a packed struct given as (name, struct code) fields."""
    codes = ""
    members = []
    for field, code in fields:
        members.append((field, C_TYPES[code], struct.calcsize("<" + codes)))
        codes += code
    return struct.calcsize("<" + codes), members


def preamble(what: str, source: str, generator: str, guard: str, endian_note: str) -> list[str]:
    """The header's opening: what it is, where it comes from, its guard, the endianness check."""
    return [
        f"/* {what}, for C: GENERATED from {source} by",
        f" * {generator} at every build of the native helper. Do not edit: change {Path(source).name}.",
        f" * Integers are little endian {endian_note} (the host must be too). */",
        f"#ifndef {guard}",
        f"#define {guard}",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        f"_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, \"{Path(source).name} is little endian, "
        "and so must the host be\");",
        "",
    ]


def render_struct(cname: str, size: int, members: Members, source: str) -> list[str]:
    """A packed struct, with asserts that the compiler laid it out as the source does."""
    name = Path(source).name
    return [
        f"struct {cname} {{",
        *(f"    {ctype} {field};" for field, ctype, _ in members),
        "} __attribute__((packed));",
        f"_Static_assert(sizeof(struct {cname}) == {size}, \"{cname}: size as in {name}\");",
        *(f"_Static_assert(offsetof(struct {cname}, {field}) == {offset}, \"{cname}.{field}: offset as in "
          f"{name}\");" for field, _, offset in members),
    ]


def cdef_struct(cname: str, members: Members) -> list[str]:
    """The struct for cffi's cdef: its layout comes from the compiler (``...;``), so the built
    module reports what the C code was compiled with."""
    return [f"struct {cname} {{", *(f"    {ctype} {field};" for field, ctype, _ in members), "    ...;", "};"]


def write_if_changed(path: Path, text: str) -> bool:
    """Write the header only when it changed, so that an unchanged one triggers no rebuild;
    whether it was written."""
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True
