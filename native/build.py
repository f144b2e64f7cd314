"""cffi API-mode builder for the ``rpmemfs._native`` extension.

setuptools runs this through ``setup(cffi_modules=["native/build.py:ffibuilder"])``,
so ``pip install .`` and ``pip install -e .`` both compile it. It first writes the headers
generated from the formats' one Python source each: native/rpmem_wire.h from
rpmemfs/transport/wire.py (native/wire_header.py), the wire format that rpmem_lane.c is
compiled against, and native/rpmem_record.h from rpmemfs/fs/record_format.py
(native/record_header.py), the log record header rpmem_native.c's log scan reads. Both work
over native/headergen.py.
"""

import os
import re
import sys
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent
# setuptools execs this file without putting its folder on sys.path; the generators live here.
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import record_header  # noqa: E402
import wire_header  # noqa: E402


def _rel(path: Path) -> str:
    # setuptools wants extension paths relative to the project root, which is the
    # cwd during its builds; locating them from this file keeps any cwd working.
    return os.path.relpath(path)


wire_header.write()
record_header.write()


def _cdef() -> str:
    # rpmem_native.h is the single declaration of the C API; cffi's cdef cannot parse
    # preprocessor lines except integer constants, which it exports as lib.NAME. The formats'
    # constants and structs come first: the API uses them.
    text = (_HERE / "rpmem_native.h").read_text()
    keep = [ln for ln in text.splitlines() if not ln.startswith("#") or re.fullmatch(r"#define \w+ \d+", ln)]
    return (wire_header.render_cdef(wire_header.load_wire())
            + record_header.render_cdef(record_header.load_format()) + "\n".join(keep))


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "rpmemfs._native",
    '#include "rpmem_native.h"',
    sources=[_rel(_HERE / name) for name in ("rpmem_native.c", "rpmem_lane.c", "rpmem_sec.c")],
    # OpenSSL's libcrypto seals the records of protected connections (rpmem_sec.c).
    libraries=["crypto"],
    include_dirs=[_rel(_HERE)],
    # Listed so that sdists carry them (setuptools >= 68, which pyproject.toml
    # requires, packs an extension's depends) and editing them triggers a rebuild.
    depends=[
        _rel(_HERE / name) for name in ("rpmem_native.h", "rpmem_wire.h", "rpmem_record.h", "build.py",
                                        "wire_header.py", "record_header.py", "headergen.py")
    ] + [_rel(wire_header.WIRE), _rel(record_header.SOURCE)],
    extra_compile_args=["-O2"],
)
