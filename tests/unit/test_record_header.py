"""The log record header has one source, rpmemfs/fs/record_format.py; the C side is generated
from it, as the wire format's is (test_wire_header.py).

native/record_header.py writes native/rpmem_record.h at every build of the native helper. These
tests fail when the helper that is loaded was built from another record_format.py (a stale
build, or a header edited by hand: cffi checks each constant against what the C compiler saw,
and the struct layout is the compiler's), when the header in the tree is not what
record_format.py gives, when records.py packs records another way, or when the C log scan or
its Python wrapper spells the header themselves again.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from native_headers import NATIVE, assert_built_constants, assert_built_struct, load_generator

from rpmemfs import native
from rpmemfs.fs import record_format, records
from rpmemfs.native import ffi

REBUILD = "the native helper was built from another record_format.py: rebuild it (pip install -e .)"


GEN = load_generator("record_header")


def test_constants_in_the_built_helper_are_record_format_s() -> None:
    expected = GEN.constants(record_format)
    assert expected["RPM_REC_HEADER_SIZE"] == record_format.HEADER_SIZE == 16
    assert_built_constants(expected, REBUILD)


def test_the_struct_layout_in_the_built_helper_is_record_format_s() -> None:
    size, members = GEN.layout(record_format)
    assert_built_struct(GEN.STRUCT, size, members, REBUILD)


def test_records_are_packed_with_record_format_s_header() -> None:
    assert records.REC is record_format.HEADER and records.REC_BYTES == record_format.HEADER_SIZE
    payload = b"abcdefghijk"
    raw = records.frame(0x0102030405060708, payload)
    size, members = GEN.layout(record_format)
    values = {"crc": native.crc32c(raw[record_format.CRC_FROM: size + len(payload)]),
              "length": len(payload), "seq": 0x0102030405060708}
    for field, ctype, offset in members:
        width = ffi.sizeof(ctype)
        assert int.from_bytes(raw[offset: offset + width], "little") == values[field], field
    padding = raw[size + len(payload):]
    assert len(raw) % record_format.ALIGN == 0 and padding == bytes(len(padding))


def test_the_c_scan_reads_what_records_py_writes() -> None:
    area = bytearray(1024)
    off, expected = 0, []
    for seq, payload in enumerate([b"a", b"b" * 8, b"c" * 17], start=7):
        raw = records.frame(seq, payload)
        area[off: off + len(raw)] = raw
        expected += [off, len(payload)]
        off += len(raw)
    assert native.log_scan(memoryview(area), 0, 7) == expected


def test_the_header_in_the_tree_is_generated_from_record_format_py() -> None:
    path = NATIVE / "rpmem_record.h"
    assert path.exists(), "native/rpmem_record.h is missing: build the native helper (pip install -e .)"
    assert path.read_text() == GEN.render_header(GEN.load_format()), REBUILD


def test_record_format_py_needs_only_the_standard_library() -> None:
    # The build loads it on its own, before rpmemfs can be imported.
    tree = ast.parse(Path(record_format.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.partition(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}


def _body(text: str, start: str) -> str:
    """From ``start`` to the end of the function it opens: C's first line that is only "}",
    Python's next top-level definition."""
    return re.split(r"\n}\n|\n\n\n(?=\S)", text[text.index(start):], maxsplit=1)[0]


@pytest.mark.parametrize(("source", "start"), [
    (NATIVE / "rpmem_native.c", "size_t rpm_log_scan("),
    (Path(native.__file__), "def log_scan("),
])
def test_the_scan_takes_the_header_from_the_generated_one(source: Path, start: str) -> None:
    # What spelling it by hand looked like: the header's size, its fields' offsets, the padding.
    body = _body(source.read_text(), start)
    spelled = re.findall(r"(?<![\w.])(4|7|8|12|16)(?![\w.])", body)
    assert not spelled, f"{source.name} spells the record header itself"
