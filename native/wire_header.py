"""Generates native/rpmem_wire.h, the wire format as C sees it, from rpmemfs/transport/wire.py.

wire.py is the one definition of the format; the C lane loop and barrier builder
(rpmem_lane.c) use this header's constants and structs instead of their own. native/build.py
writes the header before every compile of the native helper (so a clean clone needs nothing
generated beforehand; the file is not committed), and gives cffi :func:`render_cdef`, through
which the compiled helper reports the values and layouts it was built with:
tests/unit/test_wire_header.py compares those with wire.py.

Runs before the package can be imported (at build time, in pip's isolated environment), so it
loads wire.py on its own file and imports the standard library only.
``python native/wire_header.py`` writes the header by hand.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType

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
C_TYPES = {"B": "uint8_t", "H": "uint16_t", "I": "uint32_t", "Q": "uint64_t"}


def load_wire(path: Path = WIRE) -> ModuleType:
    """wire.py as a module of its own, without importing the rpmemfs package."""
    name = "_rpmemfs_wire_for_c"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their class's module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def constants(wire: ModuleType) -> dict[str, int]:
    """Every integer C gets, by its C name."""
    out = {PREFIX + name: int(getattr(wire, name)) for name in CONSTANTS}
    for enum_name, prefix in ENUMS:
        for member in getattr(wire, enum_name):
            out[PREFIX + prefix + member.name] = int(member)
    return out


def layouts(wire: ModuleType) -> dict[str, tuple[int, list[tuple[str, str, int]]]]:
    """struct name -> (size, [(field, C type, offset)]), as wire.py's little-endian, unpadded
    struct formats lay them out."""
    out = {}
    for cname, attr in STRUCTS:
        fields = getattr(wire, attr)
        codes = ""
        members = []
        for field, code in fields:
            members.append((field, C_TYPES[code], struct.calcsize("<" + codes)))
            codes += code
        out[cname] = (struct.calcsize("<" + codes), members)
    return out


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
    lines = [
        f"/* rpmemfs wire format, version {wire.VERSION}, for C: GENERATED from rpmemfs/transport/wire.py by",
        " * native/wire_header.py at every build of the native helper. Do not edit: change wire.py.",
        " * Integers are little endian on the wire and in these structs (the host must be too). */",
        "#ifndef RPMEM_WIRE_H",
        "#define RPMEM_WIRE_H",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        "_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, \"the wire is little endian, and so "
        "must the host be\");",
        "",
    ]
    lines += [f"#define {name} {_value(name, value)}" for name, value in constants(wire).items()]
    for cname, (size, members) in layouts(wire).items():
        lines += ["", f"struct {cname} {{"]
        lines += [f"    {ctype} {field};" for field, ctype, _ in members]
        lines += ["} __attribute__((packed));"]
        lines += [f"_Static_assert(sizeof(struct {cname}) == {size}, \"{cname}: size as in wire.py\");"]
        lines += [
            f"_Static_assert(offsetof(struct {cname}, {field}) == {offset}, \"{cname}.{field}: offset as in "
            "wire.py\");"
            for field, _, offset in members
        ]
    lines += ["", *_op_flags(wire)]
    lines += ["", "#endif", ""]
    return "\n".join(lines)


def render_cdef(wire: ModuleType) -> str:
    """The same, for cffi's cdef: the structs' layouts come from the compiler (``...;``), so
    the built module reports what the C code was compiled with."""
    lines = [f"#define {name} {value}" for name, value in constants(wire).items()]
    for cname, (_, members) in layouts(wire).items():
        lines += [f"struct {cname} {{", *(f"    {ctype} {field};" for field, ctype, _ in members)]
        lines += ["    ...;", "};"]
    return "\n".join(lines) + "\n"


def write(path: Path = HEADER, wire_path: Path = WIRE) -> bool:
    """Write the header (only when it changed, so that an unchanged one triggers no rebuild);
    whether it was written."""
    text = render_header(load_wire(wire_path))
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


if __name__ == "__main__":
    print(f"{HEADER}: {'written' if write() else 'unchanged'}")
