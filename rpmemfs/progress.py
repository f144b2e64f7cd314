"""Progress on stderr, so stdout carries only results: a bar for one long operation (mkfs,
verify, sync, recover) and elapsed-time lines for long runs of steps (bench, soak).

The bar draws only when stderr is a terminal (a log file or a pipe would fill with carriage
returns); the lines always print, because runs that take minutes are watched through logs too.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rpmemfs.units import human

BAR_WIDTH = 30
# Redraw at most this often: a bar fed per chunk would otherwise cost more than the chunk.
REDRAW_SECONDS = 0.2


class ProgressBar:
    """``label [#####.....] 12.0 MiB/64.0 MiB`` on one line, redrawn in place.

    Fed either with amounts as they complete (call it with the bytes just done) or with the
    position (:meth:`update`); :meth:`close` ends the line if it was drawn.
    """

    def __init__(self, label: str, total: int = 0, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self.shown = self._stream.isatty()
        self._drawn = False
        self._last = 0.0

    def __call__(self, n: int) -> None:
        self.update(self.done + n, self.total)

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.monotonic()
        finished = done >= total
        if not self.shown or (now - self._last < REDRAW_SECONDS and not finished):
            return
        self._last = now
        filled = BAR_WIDTH * min(done, total) // max(total, 1)
        self._stream.write(f"\r{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                           f"{human(done)}/{human(total)}")
        self._drawn = True
        if finished:
            self.close()
        else:
            self._stream.flush()

    def close(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False


class Notes:
    """``[bench   12.3s] message`` lines: what a long run is doing, and since when."""

    def __init__(self, tool: str, stream: TextIO | None = None) -> None:
        self.tool = tool
        self._stream = stream
        self._start = time.monotonic()

    def __call__(self, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        print(f"[{self.tool} {time.monotonic() - self._start:6.1f}s] {message}", file=stream,
              flush=True)
