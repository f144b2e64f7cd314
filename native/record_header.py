"""Generates native/rpmem_record.h, the log record header as C sees it, from
rpmemfs/fs/record_format.py.

record_format.py is the one definition of the header; the C log scan (rpm_log_scan in
rpmem_native.c) uses this header's constants and struct instead of its own. native/build.py
writes the header before every compile of the native helper (the file is not committed), and
gives cffi :func:`render_cdef`, through which the compiled helper reports the values and the
layout it was built with: tests/unit/test_record_header.py compares those with
record_format.py. As native/wire_header.py does for the wire format, and for the same reason
it loads record_format.py on its own file and imports the standard library only.
``python native/record_header.py`` writes the header by hand.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "rpmemfs" / "fs" / "record_format.py"
HEADER = HERE / "rpmem_record.h"
PREFIX = "RPM_REC_"
STRUCT = "rpm_rec_hdr"
# What C gets, by record_format.py's names.
CONSTANTS = ("HEADER_SIZE", "CRC_FROM", "ALIGN")
C_TYPES = {"I": "uint32_t", "Q": "uint64_t"}


def load_format(path: Path = SOURCE) -> ModuleType:
    """record_format.py as a module of its own, without importing the rpmemfs package."""
    name = "_rpmemfs_record_format_for_c"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def constants(fmt: ModuleType) -> dict[str, int]:
    """Every integer C gets, by its C name."""
    return {PREFIX + name: int(getattr(fmt, name)) for name in CONSTANTS}


def layout(fmt: ModuleType) -> tuple[int, list[tuple[str, str, int]]]:
    """(size, [(field, C type, offset)]) of the header, as record_format.py's little-endian,
    unpadded struct format lays it out."""
    codes = ""
    members = []
    for field, code in fmt.HEADER_FIELDS:
        members.append((field, C_TYPES[code], struct.calcsize("<" + codes)))
        codes += code
    return struct.calcsize("<" + codes), members


def render_header(fmt: ModuleType) -> str:
    size, members = layout(fmt)
    lines = [
        "/* rpmemfs log record header, for C: GENERATED from rpmemfs/fs/record_format.py by",
        " * native/record_header.py at every build of the native helper. Do not edit: change",
        " * record_format.py. Integers are little endian in the pool and in this struct (the host",
        " * must be too). */",
        "#ifndef RPMEM_RECORD_H",
        "#define RPMEM_RECORD_H",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        "_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, \"log records are little endian, and "
        "so must the host be\");",
        "",
        *(f"#define {name} {value}" for name, value in constants(fmt).items()),
        "",
        f"struct {STRUCT} {{",
        *(f"    {ctype} {field};" for field, ctype, _ in members),
        "} __attribute__((packed));",
        f"_Static_assert(sizeof(struct {STRUCT}) == {size}, \"{STRUCT}: size as in record_format.py\");",
        *(f"_Static_assert(offsetof(struct {STRUCT}, {field}) == {offset}, \"{STRUCT}.{field}: offset as "
          "in record_format.py\");" for field, _, offset in members),
        "",
        "#endif",
        "",
    ]
    return "\n".join(lines)


def render_cdef(fmt: ModuleType) -> str:
    """The same, for cffi's cdef: the struct's layout comes from the compiler (``...;``), so
    the built module reports what the C code was compiled with."""
    _, members = layout(fmt)
    lines = [f"#define {name} {value}" for name, value in constants(fmt).items()]
    lines += [f"struct {STRUCT} {{", *(f"    {ctype} {field};" for field, ctype, _ in members)]
    lines += ["    ...;", "};"]
    return "\n".join(lines) + "\n"


def write(path: Path = HEADER, source: Path = SOURCE) -> bool:
    """Write the header (only when it changed, so that an unchanged one triggers no rebuild);
    whether it was written."""
    text = render_header(load_format(source))
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


if __name__ == "__main__":
    print(f"{HEADER}: {'written' if write() else 'unchanged'}")
