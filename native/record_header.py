"""Generates native/rpmem_record.h, the log record header as C sees it, from
rpmemfs/fs/record_format.py.

record_format.py is the one definition of the header; the C log scan (rpm_log_scan in
rpmem_native.c) uses this header's constants and struct instead of its own. native/build.py
writes the header before every compile of the native helper (the file is not committed), and
gives cffi :func:`render_cdef`, through which the compiled helper reports the values and the
layout it was built with: tests/unit/test_record_header.py compares those with
record_format.py. It works as native/wire_header.py does for the wire format, over the same
native/headergen.py. ``python native/record_header.py`` writes the header by hand.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from headergen import (
    Members,
    cdef_struct,
    load_source,
    preamble,
    render_struct,
    struct_layout,
    write_if_changed,
)

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "rpmemfs" / "fs" / "record_format.py"
HEADER = HERE / "rpmem_record.h"
PREFIX = "RPM_REC_"
STRUCT = "rpm_rec_hdr"
# What C gets, by record_format.py's names.
CONSTANTS = ("HEADER_SIZE", "CRC_FROM", "ALIGN")
SOURCE_NAME = "rpmemfs/fs/record_format.py"


def load_format(path: Path = SOURCE) -> ModuleType:
    """record_format.py as a module of its own, without importing the rpmemfs package."""
    return load_source(path, "_rpmemfs_record_format_for_c")


def constants(fmt: ModuleType) -> dict[str, int]:
    """Every integer C gets, by its C name."""
    return {PREFIX + name: int(getattr(fmt, name)) for name in CONSTANTS}


def layout(fmt: ModuleType) -> tuple[int, Members]:
    """(size, [(field, C type, offset)]) of the header, as record_format.py's little-endian,
    unpadded struct format lays it out."""
    return struct_layout(fmt.HEADER_FIELDS)


def render_header(fmt: ModuleType) -> str:
    size, members = layout(fmt)
    lines = preamble("rpmemfs log record header", SOURCE_NAME, "native/record_header.py", "RPMEM_RECORD_H",
                     "in the pool and in this struct")
    lines += [f"#define {name} {value}" for name, value in constants(fmt).items()]
    lines += ["", *render_struct(STRUCT, size, members, SOURCE_NAME), "", "#endif", ""]
    return "\n".join(lines)


def render_cdef(fmt: ModuleType) -> str:
    """The constants and struct for cffi's cdef (headergen.cdef_struct says why no layout)."""
    _, members = layout(fmt)
    lines = [f"#define {name} {value}" for name, value in constants(fmt).items()]
    return "\n".join([*lines, *cdef_struct(STRUCT, members)]) + "\n"


def write(path: Path = HEADER, source: Path = SOURCE) -> bool:
    """Write the header when it changed; whether it was written."""
    return write_if_changed(path, render_header(load_format(source)))


if __name__ == "__main__":
    print(f"{HEADER}: {'written' if write() else 'unchanged'}")
