"""The wire format has one source, rpmemfs/transport/wire.py; the C side is generated from it.

native/wire_header.py writes native/rpmem_wire.h at every build of the native helper. These
tests fail when the helper that is loaded was built from another wire.py (a stale build, or a
header edited by hand: cffi checks each constant against what the C compiler saw, and the
struct layouts are the compiler's), when the header in the tree is not what wire.py gives, or
when the C sources spell the format themselves again instead of including the header.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from native_headers import NATIVE, assert_built_constants, assert_built_struct, load_generator

from rpmemfs.native import ffi
from rpmemfs.transport import wire

REBUILD = "the native helper was built from another wire.py: rebuild it (pip install -e .)"


GEN = load_generator("wire_header")


def test_constants_in_the_built_helper_are_wire_py_s() -> None:
    expected = GEN.constants(wire)
    assert expected["RPM_WIRE_OP_WRITE"] == wire.Op.WRITE  # the names are the ones C uses
    assert_built_constants(expected, REBUILD)


@pytest.mark.parametrize("struct_name", [name for name, _ in GEN.STRUCTS])
def test_struct_layouts_in_the_built_helper_are_wire_py_s(struct_name: str) -> None:
    size, members = GEN.layouts(wire)[struct_name]
    assert_built_struct(struct_name, size, members, REBUILD)


def test_layouts_follow_wire_py_s_struct_formats() -> None:
    # The generator's reading of the field lists, checked against the structs wire.py packs with.
    layouts = GEN.layouts(wire)
    assert layouts["rpm_wire_hdr"][0] == wire.HEADER.size == wire.HEADER_SIZE
    assert layouts["rpm_wire_flush_range"][0] == wire.FLUSH_RANGE.size
    values = {"op": wire.Op.READ, "flags": wire.F_FLUSH, "reserved": 0, "key": 0x11223344,
              "offset": 0x0102030405060708, "length": 0x0A0B0C0D, "id": 0x21222324, "imm": 0x3132333435363738}
    frame = wire.Frame(**{k: v for k, v in values.items() if k != "reserved"}).pack()
    for field, ctype, offset in layouts["rpm_wire_hdr"][1]:
        width = ffi.sizeof(ctype)
        assert int.from_bytes(frame[offset : offset + width], "little") == values[field], field


def test_the_lane_buffer_holds_one_header() -> None:
    hdr = dict(ffi.typeof("struct rpm_lane").fields)["hdr"]
    assert hdr.type.length == wire.HEADER_SIZE, REBUILD


def test_the_header_in_the_tree_is_generated_from_wire_py() -> None:
    path = NATIVE / "rpmem_wire.h"
    assert path.exists(), "native/rpmem_wire.h is missing: build the native helper (pip install -e .)"
    assert path.read_text() == GEN.render_header(GEN.load_wire()), REBUILD


def test_wire_py_needs_only_the_standard_library() -> None:
    # The build loads wire.py on its own, before rpmemfs (or trio) can be imported.
    tree = ast.parse(Path(wire.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.partition(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}


# What spelling the format by hand looked like before rpmem_wire.h: its names, and a header struct.
_OWN_DEFINE = re.compile(r"^\s*#\s*define\s+(HDR|OP_\w+|F_\w+|KIND_\w+|MAX_\w+|FLUSH_\w+|ATOMIC_\w+)\b", re.M)
_OWN_STRUCT = re.compile(r"struct\s+\w+\s*\{[^}]*\buint8_t\s+op\s*;", re.S)


@pytest.mark.parametrize("source", ["rpmem_lane.c", "rpmem_native.c", "rpmem_native.h"])
def test_c_sources_take_the_format_from_the_generated_header(source: str) -> None:
    text = (NATIVE / source).read_text()
    assert not _OWN_DEFINE.findall(text), f"{source} defines wire constants itself; use rpmem_wire.h's"
    assert not _OWN_STRUCT.search(text), f"{source} declares a frame header itself; use struct rpm_wire_hdr"
    if source == "rpmem_native.h":
        assert '#include "rpmem_wire.h"' in text


@pytest.mark.parametrize("enum_name", [name for name, _ in GEN.ENUMS])
def test_no_two_names_of_an_enum_share_a_value(enum_name: str) -> None:
    # A second name with a value already taken is an alias in Python: C never gets it, and
    # Code(value).name gives the other name (a refused HELLO read as a version mismatch).
    members = getattr(wire, enum_name).__members__
    values = [int(v) for v in members.values()]
    assert len(set(values)) == len(values), {n: int(v) for n, v in members.items()}


def test_error_codes_are_the_ones_docs_wire_md_lists() -> None:
    text = (NATIVE.parent / "docs" / "wire.md").read_text()
    table = text.split("| ERROR code | name | when |", 1)[1].split("\n\n", 1)[0]
    documented = {m.group(2): int(m.group(1)) for m in re.finditer(r"^\| (\d+) \| (\w+) \|", table, re.M)}
    assert documented == {n: int(v) for n, v in wire.Code.__members__.items()}
