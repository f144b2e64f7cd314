"""Generates native/rpmem_wire.h, the wire format as C sees it, from rpmemfs/transport/wire.py.

wire.py is the one definition of the format; the C lane loop and barrier builder
(rpmem_lane.c) use this header's constants and structs instead of their own. native/build.py
writes the header before every compile of the native helper (so a clean clone needs nothing
generated beforehand; the file is not committed), and gives cffi :func:`render_cdef`, through
which the compiled helper reports the values and layouts it was built with:
tests/unit/test_wire_header.py compares those with wire.py.

What it shares with native/record_header.py is native/headergen.py's.
``python native/wire_header.py`` writes the header by hand.
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
WIRE = HERE.parent / "rpmemfs" / "transport" / "wire.py"
HEADER = HERE / "rpmem_wire.h"
PREFIX = "RPM_WIRE_"

# What C gets, by wire.py's names: plain integers, every member of these enums (under the
# prefix beside each), and these structs (wire.py's (name, struct code) field lists).
CONSTANTS = (
    "VERSION", "HEADER_SIZE", "F_FLUSH", "F_CLOSE", "ATOMIC_SIZE", "FLUSH_READ_SIZE",
    "MAX_WRITE", "MAX_READ", "MAX_SEND", "MAX_CONTROL", "MAX_ERROR_TEXT",
    "FLUSH_COUNT_SIZE", "FLUSH_RANGE_SIZE", "MAX_FLUSH_RANGES",
    "RECORD_LEN_SIZE", "RECORD_TAG_SIZE", "RECORD_MAX", "RECORD_OVERHEAD", "KEY_SIZE",
)
ENUMS = (("Op", "OP_"), ("SendKind", "SEND_"), ("Code", "CODE_"), ("Cipher", "CIPHER_"))
STRUCTS = (("rpm_wire_hdr", "HEADER_FIELDS"), ("rpm_wire_flush_range", "FLUSH_RANGE_FIELDS"))
SOURCE_NAME = "rpmemfs/transport/wire.py"


def load_wire(path: Path = WIRE) -> ModuleType:
    """wire.py as a module of its own, without importing the rpmemfs package."""
    return load_source(path, "_rpmemfs_wire_for_c")


def constants(wire: ModuleType) -> dict[str, int]:
    """Every integer C gets, by its C name."""
    out = {PREFIX + name: int(getattr(wire, name)) for name in CONSTANTS}
    for enum_name, prefix in ENUMS:
        for member in getattr(wire, enum_name):
            out[PREFIX + prefix + member.name] = int(member)
    return out


def layouts(wire: ModuleType) -> dict[str, tuple[int, Members]]:
    """struct name -> (size, [(field, C type, offset)]), as wire.py's little-endian, unpadded
    struct formats lay them out."""
    return {cname: struct_layout(getattr(wire, attr)) for cname, attr in STRUCTS}


def _value(name: str, value: int) -> str:
    # opcodes and flags read as the hex docs/wire.md gives them
    hexed = name.startswith((PREFIX + "OP_", PREFIX + "F_"))
    return f"0x{value:02x}" if hexed else str(value)


def _op_flags(wire: ModuleType) -> list[str]:
    """A C function giving each op the flags it may carry, and -1 for a byte that is no op:
    the receive loop's first check of a header, as ``unpack_header`` makes it."""
    lines = [
        "/* The flags a frame of this op may carry; -1 when the wire has no such op. */",
        "static inline int rpm_wire_op_flags(unsigned op)",
        "{",
        "    switch (op) {",
    ]
    for member in wire.Op:
        flags = int(wire.KNOWN_FLAGS.get(member, 0))
        lines.append(f"    case {PREFIX}OP_{member.name}: return 0x{flags:02x};")
    lines += ["    default: return -1;", "    }", "}"]
    return lines


def render_header(wire: ModuleType) -> str:
    lines = preamble(f"rpmemfs wire format, version {wire.VERSION}", SOURCE_NAME, "native/wire_header.py",
                     "RPMEM_WIRE_H", "on the wire and in these structs")
    lines += [f"#define {name} {_value(name, value)}" for name, value in constants(wire).items()]
    for cname, (size, members) in layouts(wire).items():
        lines += ["", *render_struct(cname, size, members, SOURCE_NAME)]
    lines += ["", *_op_flags(wire)]
    lines += ["", "#endif", ""]
    return "\n".join(lines)


def render_cdef(wire: ModuleType) -> str:
    """The constants and structs for cffi's cdef (headergen.cdef_struct says why no layout)."""
    lines = [f"#define {name} {value}" for name, value in constants(wire).items()]
    for cname, (_, members) in layouts(wire).items():
        lines += cdef_struct(cname, members)
    return "\n".join(lines) + "\n"


def write(path: Path = HEADER, wire_path: Path = WIRE) -> bool:
    """Write the header when it changed; whether it was written."""
    return write_if_changed(path, render_header(load_wire(wire_path)))


if __name__ == "__main__":
    print(f"{HEADER}: {'written' if write() else 'unchanged'}")
