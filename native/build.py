"""cffi API-mode builder for the ``rpmemfs._native`` extension.

setuptools runs this through ``setup(cffi_modules=["native/build.py:ffibuilder"])``,
so ``pip install .`` and ``pip install -e .`` both compile it.
"""

import os
import re
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent


def _rel(path: Path) -> str:
    # setuptools wants extension paths relative to the project root, which is the
    # cwd during its builds; locating them from this file keeps any cwd working.
    return os.path.relpath(path)


def _cdef() -> str:
    # The header is the single declaration of the C API; cffi's cdef cannot parse
    # preprocessor lines except integer constants, which it exports as lib.NAME.
    text = (_HERE / "rpmem_native.h").read_text()
    keep = [ln for ln in text.splitlines() if not ln.startswith("#") or re.fullmatch(r"#define \w+ \d+", ln)]
    return "\n".join(keep)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "rpmemfs._native",
    '#include "rpmem_native.h"',
    sources=[_rel(_HERE / "rpmem_native.c"), _rel(_HERE / "rpmem_lane.c")],
    include_dirs=[_rel(_HERE)],
    # Listed so that sdists carry them (setuptools >= 68, which pyproject.toml
    # requires, packs an extension's depends) and editing them triggers a rebuild.
    depends=[_rel(_HERE / "rpmem_native.h"), _rel(_HERE / "build.py")],
    extra_compile_args=["-O2"],
)
