"""The timeline's writer: 4 KiB pwrite + fsync in a loop, every fsync timed.

`python -m rpmemfs.tools.fsync_writer FILE RECORDS SPAN`: writes FILE (in the mount) at
offsets moving on by the write size, wrapping at SPAN bytes, until SIGTERM; appends
one record per fsync to RECORDS (outside the mount): RECORD.pack(start, seconds, errno), the
start on the system's monotonic clock (the same in every process, so the parent can put it on
its own time axis) and errno 0 when the fsync succeeded.

A process of its own, not a thread of the tool: a thread looping on syscalls takes the GIL
back after each one, and starved the tool's sampler and scenario for seconds at a time.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time

from rpmemfs import safeopen

WRITE_SIZE = 4096
RECORD = struct.Struct("<ddi")
FLUSH_SECONDS = 0.5  # records reach RECORDS at least this often (and at the end)


def run(path: str, records: str, span: int) -> None:
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    # A Ctrl-C at the terminal reaches the whole process group: the tool stops the writer
    # itself (SIGTERM) once it has seen the interrupt, not the other way round.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    data = os.urandom(WRITE_SIZE)
    out = safeopen.overwrite(records, flags=os.O_WRONLY | os.O_APPEND)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    pending = bytearray()
    flushed = time.monotonic()
    offset = 0
    try:
        while not stopping:
            os.pwrite(fd, data, offset)
            start = time.monotonic()
            errno = 0
            try:
                os.fsync(fd)
            except OSError as e:
                errno = e.errno or -1
            end = time.monotonic()
            pending += RECORD.pack(start, end - start, errno)
            offset = (offset + WRITE_SIZE) % span
            if end - flushed >= FLUSH_SECONDS:
                os.write(out, pending)
                pending.clear()
                flushed = end
    finally:
        os.write(out, pending)
        os.close(out)
        os.close(fd)


def read_records(records: str) -> list[tuple[float, float, int]]:
    with open(records, "rb") as f:
        data = f.read()
    whole = len(data) - len(data) % RECORD.size  # (a writer killed mid-write leaves a part)
    return [RECORD.unpack_from(data, i) for i in range(0, whole, RECORD.size)]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m rpmemfs.tools.fsync_writer FILE RECORDS SPAN")
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
