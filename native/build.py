"""cffi API-mode builder for the ``rpmemfs._native`` extension.

setuptools runs this through ``setup(cffi_modules=["native/build.py:ffibuilder"])``,
so ``pip install .`` and ``pip install -e .`` both compile it. It first writes the headers
generated from the formats' one Python source each: native/rpmem_wire.h from
rpmemfs/transport/wire.py (native/wire_header.py), the wire format that rpmem_lane.c is
compiled against, and native/rpmem_record.h from rpmemfs/fs/record_format.py
(native/record_header.py), the log record header rpmem_native.c's log scan reads.
"""

import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType

from cffi import FFI

_HERE = Path(__file__).resolve().parent


def _rel(path: Path) -> str:
    # setuptools wants extension paths relative to the project root, which is the
    # cwd during its builds; locating them from this file keeps any cwd working.
    return os.path.relpath(path)


def _load_generator(name: str) -> ModuleType:
    # setuptools execs this file without putting its folder on sys.path.
    spec = importlib.util.spec_from_file_location(f"_rpmemfs_{name}", _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_wire_header = _load_generator("wire_header")
_wire_header.write()
_record_header = _load_generator("record_header")
_record_header.write()


def _cdef() -> str:
    # rpmem_native.h is the single declaration of the C API; cffi's cdef cannot parse
    # preprocessor lines except integer constants, which it exports as lib.NAME. The formats'
    # constants and structs come first: the API uses them.
    text = (_HERE / "rpmem_native.h").read_text()
    keep = [ln for ln in text.splitlines() if not ln.startswith("#") or re.fullmatch(r"#define \w+ \d+", ln)]
    return (_wire_header.render_cdef(_wire_header.load_wire())
            + _record_header.render_cdef(_record_header.load_format()) + "\n".join(keep))


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
                                        "wire_header.py", "record_header.py")
    ] + [_rel(_wire_header.WIRE), _rel(_record_header.SOURCE)],
    extra_compile_args=["-O2"],
)
