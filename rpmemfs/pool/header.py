"""Reading and writing the pool header's two copies: the one place that decides which copy
counts, what is wrong with the other, and how a new header reaches the pool.

The primary copy is at HEADER_OFF, the backup one block later. A header is written backup
first, so that a crash in between leaves at least one intact copy of either version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rpmemfs.pool.layout import BACKUP_OFF, HEADER_BYTES, HEADER_OFF, Header, PoolFormatError
from rpmemfs.ranges import Ranges

Buffer = bytes | bytearray | memoryview


def read_header(buf: Buffer) -> tuple[Header, list[str]]:
    """The pool header and what is wrong with either copy (mount rewrites a damaged one).

    PoolFormatError when neither copy is intact."""
    copies: list[Header | None] = []
    errors: list[str] = []
    for off in (HEADER_OFF, BACKUP_OFF):
        try:
            copies.append(Header.decode(buf[off: off + HEADER_BYTES]))
            errors.append("")
        except PoolFormatError as e:
            copies.append(None)
            errors.append(str(e))
    primary, backup = copies
    if primary is None and backup is None:
        if "magic" in errors[0] and "magic" in errors[1]:
            raise PoolFormatError("not an rpmemfs pool (bad magic in both headers)")
        raise PoolFormatError(f"both pool headers are damaged: primary: {errors[0]}; "
                              f"backup: {errors[1]}")
    problems: list[str] = []
    if primary is None:
        problems.append(f"primary header damaged: {errors[0]} (the backup is intact; "
                        f"mounting repairs the primary)")
    elif backup is None:
        problems.append(f"backup header damaged: {errors[1]} (mounting repairs it)")
    elif primary != backup:
        problems.append("primary and backup headers differ (mounting rewrites the backup)")
    hdr = primary or backup
    assert hdr is not None
    return hdr, problems


def find_header(buf: Buffer) -> Header | None:
    """The header from whichever copy is intact, or None when neither is (a pool being made)."""
    try:
        return read_header(buf)[0]
    except PoolFormatError:
        return None


def write_header(buf: memoryview | bytearray, hdr: Header) -> Ranges:
    """Store both copies, backup first; returns the ranges the caller must persist."""
    raw = hdr.encode()
    for off in (BACKUP_OFF, HEADER_OFF):
        buf[off: off + len(raw)] = raw
    return [(BACKUP_OFF, len(raw)), (HEADER_OFF, len(raw))]


def write_epoch(buf: memoryview | bytearray, hdr: Header, epoch: int,
                persist: Callable[[Ranges], None]) -> tuple[Header, Ranges]:
    """A new epoch into both copies, persisted: the new header, and the ranges written (which
    a mount carries to its replicas with its first durability point)."""
    moved = replace(hdr, epoch=epoch)
    ranges = write_header(buf, moved)
    persist(ranges)
    return moved, ranges
