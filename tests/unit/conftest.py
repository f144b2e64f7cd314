"""The unit tier needs no FUSE, no root and no other process; this keeps the first true."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _no_fuse_binding() -> Iterator[None]:
    yield
    # Loaded by anything under test means the tier needs libfuse and /dev/fuse after all.
    assert "pyfuse3" not in sys.modules, "the unit tier imported pyfuse3 (the FUSE edge)"
