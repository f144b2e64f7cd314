"""Growing a pool file (offline): the layout of the bigger pool, and the switch to it.

The data blocks grow into what was the sync map and the new space; the sync map moves to the
new end. The area size and the data offset stay (they were chosen for the old size; a log area
a little small for the new size costs only more frequent checkpoints).

Crash safety: everything is written where the old pool does not look (past its end, then the
old map's place, which the old header counts as map, not data) before the header switches;
the backup header first, then the primary. A crash before the primary is written leaves the old
pool as it was (a longer file is fine); after it, the new one, complete.
"""

from __future__ import annotations

import os
from dataclasses import replace

from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header, write_header
from rpmemfs.pool.layout import BLOCK, MAP_SLOTS, Header, PoolFormatError, map_bytes, map_shift_for
from rpmemfs.pool.syncmap import S_FULL, encode_head


def grown(hdr: Header, size: int) -> Header:
    """The header of ``hdr``'s pool grown to ``size`` bytes; PoolFormatError if it cannot."""
    if not hdr.map_shift:
        raise PoolFormatError("a version 1 pool (no sync map) cannot be grown; copy it into a new pool")
    if size % BLOCK:
        raise PoolFormatError(f"size {size} is not a multiple of {BLOCK} bytes")
    if size <= hdr.pool_size:
        raise PoolFormatError(f"the pool is {hdr.pool_size} bytes already; it only grows")
    # Never a finer chunk than the pool has: a pool made with 64 KiB chunks keeps them, as it
    # keeps its log areas.
    shift = max(hdr.map_shift, map_shift_for(size))
    map_off = (size - map_bytes(size, shift)) // BLOCK * BLOCK
    new = replace(hdr, pool_size=size, map_shift=shift, data_blocks=(map_off - hdr.data_off) // BLOCK)
    new.validate()
    if new.data_blocks < hdr.data_blocks:
        raise PoolFormatError(f"growing to {size} bytes leaves fewer data blocks (the sync map takes "
                              "the new space); grow by more")
    return new


def grow_file(path: str, size: int) -> Header:
    """Grow the (unmounted) pool at ``path`` to ``size`` bytes; the new header.

    The new sync map says every replica must be compared in full: the replicas' copies of the
    old map's place differ from the zeroes it holds now.
    """
    with PoolMapping.open(path, "msync", readonly=True) as pm:
        old, _ = read_header(pm.buf)
    new = grown(old, size)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, old.pool_size, size - old.pool_size)
        os.fsync(fd)
    finally:
        os.close(fd)
    with PoolMapping.open(path, "msync", exclusive=True) as pm:
        buf = pm.buf
        # The old map's place becomes free data blocks: zeroes, as on every replica.
        old_map = old.map_off
        buf[old_map: old.pool_size] = bytes(old.pool_size - old_map)
        head = encode_head(0, new.epoch, [S_FULL] * MAP_SLOTS)
        buf[new.map_off: new.map_off + len(head)] = head
        pm.persist([(old_map, size - old_map)])
        pm.persist(write_header(buf, new))
    return new
