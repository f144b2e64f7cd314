"""Progress lines on stderr, so stdout carries only the report."""

from __future__ import annotations

import sys
import time

_START = time.monotonic()


def note(message: str) -> None:
    print(f"[bench {time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)
