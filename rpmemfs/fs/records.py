"""Metadata log records and the entries inside them.

A record is the unit of atomicity: a header (crc32c, payload length, sequence number: its
layout is record_format.py's, which the C log scan reads too) and a payload of entries, each
8-byte aligned. Replay applies a record whole or not at all; a record
whose checksum fails ends the log (a torn tail) unless intact records follow it (damage).
Entries state facts ("inode 7 has these attributes", "block run 10..20 of inode 7 is at pool
block 900"), so replaying a snapshot and then the log yields the same state as the live index.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from rpmemfs.fs.record_format import ALIGN, CRC_FROM, HEADER, HEADER_FIELDS
from rpmemfs.native import crc32c

REC = HEADER  # crc, payload length, seq
REC_BYTES = REC.size
_CRC = struct.Struct("<" + HEADER_FIELDS[0][1])
_LEN_SEQ = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS[1:]))  # what the CRC covers
_MASK = ALIGN - 1

T_INODE = 1
T_LINK = 2      # directory entry added
T_UNLINK = 3    # directory entry removed
T_MAP = 4       # run of file blocks mapped to pool blocks
T_TRUNC = 5     # every file block >= fblk unmapped
T_FREE = 6      # inode gone, with all its blocks
T_SYMLINK = 7
T_XSET = 8
T_XDEL = 9
T_NEXTINO = 10
T_UNMAP = 11    # file blocks fblk .. fblk+count-1 unmapped (a punched hole)

# tag, mode, ino, uid, gid, nlink, rdev, size, atime, mtime, ctime
INODE = struct.Struct("<BxxxIQIIIIQqqq")
# tag, namelen, parent, ino
LINK = struct.Struct("<BxHxxxxQQ")
# tag, namelen, parent
UNLINK = struct.Struct("<BxHxxxxQ")
# tag, flags, count, ino, fblk, pblk
MAP = struct.Struct("<BBxxIQQQ")
MAP_PREALLOC = 1  # flags: preallocated by fallocate, zero until written (a hint, see replay)
# tag, ino, fblk
TRUNC = struct.Struct("<BxxxxxxxQQ")
# tag, ino
FREE = struct.Struct("<BxxxxxxxQ")
# tag, len, ino
SYMLINK = struct.Struct("<BxxxIQ")
# tag, namelen, vallen, ino
XSET = struct.Struct("<BxHIQ")
# tag, namelen, ino
XDEL = struct.Struct("<BxHxxxxQ")
# tag, next_ino
NEXTINO = struct.Struct("<BxxxxxxxQ")
# tag, ino, fblk, count
UNMAP = struct.Struct("<BxxxxxxxQQQ")


def _pad(n: int) -> int:
    return (n + _MASK) & ~_MASK


def _tail(raw: bytes) -> bytes:
    extra = _pad(len(raw)) - len(raw)
    return raw + b"\0" * extra if extra else raw


def inode(ino: int, mode: int, uid: int, gid: int, nlink: int, rdev: int, size: int,
          atime: int, mtime: int, ctime: int) -> bytes:
    return INODE.pack(T_INODE, mode, ino, uid, gid, nlink, rdev, size, atime, mtime, ctime)


def link(parent: int, name: bytes, ino: int) -> bytes:
    return LINK.pack(T_LINK, len(name), parent, ino) + _tail(name)


def unlink(parent: int, name: bytes) -> bytes:
    return UNLINK.pack(T_UNLINK, len(name), parent) + _tail(name)


def map_run(ino: int, fblk: int, pblk: int, count: int, flags: int = 0) -> bytes:
    return MAP.pack(T_MAP, flags, count, ino, fblk, pblk)


def trunc(ino: int, fblk: int) -> bytes:
    return TRUNC.pack(T_TRUNC, ino, fblk)


def free(ino: int) -> bytes:
    return FREE.pack(T_FREE, ino)


def symlink(ino: int, target: bytes) -> bytes:
    return SYMLINK.pack(T_SYMLINK, len(target), ino) + _tail(target)


def xset(ino: int, name: bytes, value: bytes) -> bytes:
    return XSET.pack(T_XSET, len(name), len(value), ino) + _tail(name + value)


def xdel(ino: int, name: bytes) -> bytes:
    return XDEL.pack(T_XDEL, len(name), ino) + _tail(name)


def next_ino(value: int) -> bytes:
    return NEXTINO.pack(T_NEXTINO, value)


def unmap(ino: int, fblk: int, count: int) -> bytes:
    return UNMAP.pack(T_UNMAP, ino, fblk, count)


def frame(seq: int, payload: bytes) -> bytes:
    """A whole record, padded to 8 bytes, ready to copy into a log area."""
    head = _LEN_SEQ.pack(len(payload), seq)
    crc = crc32c(payload, crc32c(head))
    return _CRC.pack(crc) + head + _tail(payload)


class RecordView(NamedTuple):
    offset: int  # within the area
    length: int  # whole record on the pool, header and padding included
    seq: int
    payload: memoryview


def read_record(area: memoryview, off: int, seq: int) -> RecordView | None:
    """The record at off if it is intact and has sequence number seq, else None (a mount
    reads them all at once: native.log_scan)."""
    if off + REC_BYTES > len(area):
        return None
    want, length, got_seq = REC.unpack_from(area, off)
    if got_seq != seq or length == 0 or off + REC_BYTES + length > len(area):
        return None
    # The CRC covers length, seq and payload, which lie side by side.
    if crc32c(area[off + CRC_FROM: off + REC_BYTES + length]) != want:
        return None
    return RecordView(off, REC_BYTES + _pad(length), seq, area[off + REC_BYTES: off + REC_BYTES + length])


def find_later_record(area: memoryview, off: int, seq: int, window: int = 256 << 10) -> int | None:
    """Offset of an intact record numbered above seq within window bytes after off.

    Used only after a record failed its checksum, to tell a torn tail (nothing intact
    follows) from damage in the middle of the log (intact, newer records follow).
    """
    end = min(len(area) - REC_BYTES, off + window)
    probes: list[int] | range = range(off + ALIGN, end + 1, ALIGN)
    if off + REC_BYTES <= len(area):  # the damaged record's own length, when it is plausible
        _crc, length, _seq = REC.unpack_from(area, off)
        nxt = off + REC_BYTES + _pad(length)
        if length > 0 and nxt + REC_BYTES <= len(area):
            probes = [nxt, *probes]
    for probe in probes:
        _crc, length, got = REC.unpack_from(area, probe)
        if seq < got < seq + (1 << 20) and read_record(area, probe, got) is not None:
            return probe
    return None


# Entries of a fixed size, and entries followed by a tail whose length their fields give.
_FIXED: dict[int, struct.Struct] = {
    T_INODE: INODE, T_MAP: MAP, T_TRUNC: TRUNC, T_FREE: FREE, T_NEXTINO: NEXTINO, T_UNMAP: UNMAP,
}
_TAILED: dict[int, tuple[struct.Struct, Callable[[tuple[int, ...]], int]]] = {
    T_LINK: (LINK, lambda f: f[1]),
    T_UNLINK: (UNLINK, lambda f: f[1]),
    T_SYMLINK: (SYMLINK, lambda f: f[1]),
    T_XSET: (XSET, lambda f: f[1] + f[2]),
    T_XDEL: (XDEL, lambda f: f[1]),
}


def entry_at(payload: memoryview, off: int) -> tuple[int, tuple[Any, ...], bytes, int]:
    """The entry at ``off`` of a payload: (tag, fixed fields, trailing bytes, offset of the
    next entry)."""
    tag = payload[off]
    fixed = _FIXED.get(tag)
    if fixed is not None:
        return tag, fixed.unpack_from(payload, off), b"", off + fixed.size
    tailed = _TAILED.get(tag)
    if tailed is None:
        raise ValueError(f"unknown entry tag {tag} at payload offset {off}")
    st, tail_len = tailed
    f = st.unpack_from(payload, off)
    start = off + st.size
    k = tail_len(f)
    return tag, f, bytes(payload[start: start + k]), start + _pad(k)


def entries(payload: memoryview) -> Iterator[tuple[int, tuple[Any, ...], bytes]]:
    """Yield (tag, fixed fields, trailing bytes) for each entry of a payload."""
    off = 0
    n = len(payload)
    while off < n:
        tag, f, tail, off = entry_at(payload, off)
        yield tag, f, tail
