"""Structured, quiet-by-default logging: one `key=value` line per event."""

from __future__ import annotations

import logging
import sys
import time


class _KeyValue(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        msg = record.getMessage().replace('"', "'")
        line = f'ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} ' \
               f'logger={record.name} msg="{msg}"'
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def setup(level: str = "warning", stream: object = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(_KeyValue())
    root = logging.getLogger("rpmemfs")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
