"""Structured, quiet-by-default logging: one `key=value` line per event, whatever a peer put
in the text it carries (control characters are escaped: rpmemfs/printable.py).

Where lines go: stderr (the CLI, daemons in the foreground, units under systemd), a file
(`-o log=FILE`), or syslog for a mount that forked off without a file (mount(8) and fstab
mounts would otherwise log to nowhere; under systemd, /dev/log is the journal's), and where
there is no syslog socket either, a file the mount names (``to_file``). ``destination`` says
where they go, for the messages that send an administrator there.

Under systemd (stderr is the journal: $JOURNAL_STREAM names it) a line carries its priority as
a `<N>` prefix, which journald takes as the entry's level, and no timestamp of its own (the
journal has one). Through syslog the handler sends the priority.

A line that repeats (the same text but for its numbers, from the same logger at the same
level) is let through once per REPEAT_WINDOW seconds; the next one let through says how many
were held back meanwhile. A target that keeps failing is one line a minute, not hundreds. At
debug level every line goes through.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Callable
from typing import TextIO

from rpmemfs import safeopen
from rpmemfs.printable import printable

REPEAT_WINDOW = 60.0
MAX_KEYS = 1024  # distinct repeating lines remembered; the oldest are forgotten first
SYSLOG_SOCKET = "/dev/log"
_DIGITS = re.compile(r"\d+")
# syslog priorities (sd-daemon(3) prefixes) for Python's levels.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _KeyValue(logging.Formatter):
    def __init__(self, *, journal: bool = False, timestamps: bool = True) -> None:
        super().__init__()
        self.journal = journal
        self.timestamps = timestamps and not journal

    def format(self, record: logging.LogRecord) -> str:
        # One record, one line: what peers said (holders, names, reasons) may hold newlines
        # or terminal escapes, and must neither forge lines nor reach a terminal raw.
        msg = printable(record.getMessage()).replace('"', "'")
        line = f'level={record.levelname.lower()} logger={record.name} msg="{msg}"'
        held = getattr(record, "held_back", 0)
        if held:
            line += f" repeated={held}"
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        if self.timestamps:
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            line = f"ts={ts}.{int(record.msecs):03d}Z {line}"
        if self.journal:
            line = f"<{_PRIORITY.get(record.levelno, 6)}>{line}"
        return line


class RepeatFilter(logging.Filter):
    """Lets one of each repeating line through per window (see the module's text)."""

    def __init__(self, window: float = REPEAT_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self._clock = clock
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (let through, held)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, _DIGITS.sub("#", record.getMessage()))
        now = self._clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.window:
            self._seen[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            record.held_back = last[1]
        self._seen.pop(key, None)
        self._seen[key] = (now, 0)
        if len(self._seen) > MAX_KEYS:
            del self._seen[next(iter(self._seen))]
        return True


def _journal_stream(stream: TextIO) -> bool:
    """Whether ``stream`` is the systemd journal ($JOURNAL_STREAM holds its device:inode)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def _install(handler: logging.Handler, level: str) -> None:
    if level.lower() != "debug":  # debugging wants every line
        handler.addFilter(RepeatFilter())
    root = logging.getLogger("rpmemfs")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def setup(level: str = "warning", stream: TextIO | None = None) -> None:
    out = stream or sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(_KeyValue(journal=_journal_stream(out)))
    _install(handler, level)


def to_syslog(level: str, ident: str = "rpmemfs") -> bool:
    """Send the lines to syslog (the journal under systemd) instead; False, and nothing
    changed, when there is no syslog socket. $RPMEMFS_SYSLOG_SOCKET names another socket."""
    path = os.environ.get("RPMEMFS_SYSLOG_SOCKET") or SYSLOG_SOCKET
    try:
        # (The handler itself would start without a socket and drop every line quietly.)
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
        handler = logging.handlers.SysLogHandler(
            address=path, facility=logging.handlers.SysLogHandler.LOG_DAEMON, socktype=socket.SOCK_DGRAM)
    except OSError:
        return False
    handler.ident = f"{ident}[{os.getpid()}]: "
    handler.setFormatter(_KeyValue(timestamps=False))
    _install(handler, level)
    return True


def to_file(level: str, path: str) -> None:
    """Send the lines, and whatever else reaches stderr (fd 2), to the file at ``path``:
    appended to, created mode 0600, never through a symbolic link nor into another's file
    (safeopen.append). OSError when it cannot be opened (nothing changed then)."""
    fd = safeopen.append(path)
    os.dup2(fd, 2)
    os.close(fd)
    setup(level, sys.stderr)


def destination() -> str:
    """Where the lines go now, as a message names it: syslog, a file's path, or stderr."""
    handler = next(iter(logging.getLogger("rpmemfs").handlers), None)
    if isinstance(handler, logging.handlers.SysLogHandler):
        return f"syslog, as {handler.ident.rstrip(': ')}"
    stream = getattr(handler, "stream", None)
    if stream is None:
        return "stderr"  # (logging's last resort, with no handler)
    try:
        fd = stream.fileno()
        target, kind = os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return "stderr"
    if target == os.devnull:
        return "nowhere (stderr is /dev/null)"
    if stat.S_ISREG(kind):
        return target
    return "the journal (stderr)" if _journal_stream(stream) else "stderr"
