"""Growing a pool file (offline): the layout of the bigger pool, and the switch to it.

The data blocks grow into what was the sync map and the new space; the sync map moves to the
new end. The area size and the data offset stay (they were chosen for the old size; a log area
a little small for the new size costs only more frequent checkpoints).

Crash safety: everything is written where the old pool does not look (past its end, then the
old map's place, which the old header counts as map, not data) before the header switches;
the backup header first, then the primary. A crash before the primary is written leaves the old
pool as it was (a longer file is fine); after it, the new one, complete.

A pool on a device DAX grows the same way into the rest of its device, and no further: a
device has the size of its namespace.
"""

from __future__ import annotations

import os
from dataclasses import replace

from rpmemfs.devdax import DevDaxError, probe
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header, write_header
from rpmemfs.pool.layout import BLOCK, MAP_SLOTS, Header, PoolFormatError, map_bytes, map_shift_for
from rpmemfs.pool.syncmap import S_FULL, encode_head
from rpmemfs.units import human


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


def check_room(path: str, size: int) -> None:
    """PoolFormatError when ``path`` is a device DAX too small for a pool of ``size`` bytes."""
    try:
        dev = probe(path)
    except DevDaxError as exc:
        raise PoolFormatError(str(exc)) from None
    if dev is not None and size > dev.size:
        raise PoolFormatError(
            f"the pool is on the device DAX {path}, which holds {dev.size} bytes ({human(dev.size)}); "
            f"a device cannot grow: make a pool of {human(size)} on a larger namespace (ndctl "
            "create-namespace -m devdax) and copy the files into it")


def grow_file(path: str, size: int) -> Header:
    """Grow the (unmounted) pool at ``path`` to ``size`` bytes; the new header.

    The new sync map says every replica must be compared in full: the replicas' copies of the
    old map's place differ from the zeroes it holds now.
    """
    with PoolMapping.open(path, "msync", readonly=True) as pm:
        old, _ = read_header(pm.buf)
    new = grown(old, size)
    check_room(path, size)
    device = probe(path) is not None
    if not device:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, old.pool_size, size - old.pool_size)
            os.fsync(fd)
        finally:
            os.close(fd)
    # On a device the header still says the old size: the view is given the new one.
    with PoolMapping.open(path, "msync", exclusive=True, length=size if device else None) as pm:
        buf = pm.buf
        # The old map's place becomes free data blocks: zeroes, as on every replica; so does
        # the rest of a device, which holds whatever it held (a file grows with zeroes).
        old_map = old.map_off
        end = size if device else old.pool_size
        zeros = bytes(min(end - old_map, 64 << 20))
        for at in range(old_map, end, len(zeros)):
            n = min(len(zeros), end - at)
            buf[at: at + n] = zeros[:n]
        head = encode_head(0, new.epoch, [S_FULL] * MAP_SLOTS)
        buf[new.map_off: new.map_off + len(head)] = head
        pm.persist([(old_map, size - old_map)])
        pm.persist(write_header(buf, new))
    return new
