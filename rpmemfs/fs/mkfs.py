"""Making a new pool: a file, or on a device DAX (where the pool may be smaller than the device)."""

from __future__ import annotations

import os
import stat
import time
import uuid as uuidlib
from collections.abc import Callable

from rpmemfs import safeopen
from rpmemfs.devdax import DaxDevice
from rpmemfs.fs import records as R
from rpmemfs.fs.errors import MkfsError
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool import position
from rpmemfs.pool.layout import (
    AREA_RECORDS_OFF,
    BACKUP_OFF,
    HEADER_OFF,
    AreaHeader,
    Header,
    PoolFormatError,
    plan,
)
from rpmemfs.pool.syncmap import format_map
from rpmemfs.poolfile import place
from rpmemfs.ranges import Ranges


def format_pool(buf: memoryview, hdr: Header, uid: int, gid: int) -> Ranges:
    """Write an empty filesystem (a root directory owned by uid:gid) into ``buf``, zero-filled
    and ``hdr.pool_size`` bytes long; returns the ranges to persist. mkfs does it on the mapped
    file; the unit tests do it on memory."""
    now = time.time_ns()
    payload = b"".join([
        R.next_ino(ROOT_INO + 1),
        R.inode(ROOT_INO, stat.S_IFDIR | 0o755, uid, gid, 2, 0, 0, now, now, now),
    ])
    base = hdr.area_off(0)
    rec = R.frame(1, payload)
    buf[base + AREA_RECORDS_OFF: base + AREA_RECORDS_OFF + len(rec)] = rec
    ah = AreaHeader(1, 1, 1, hdr.uuid).encode()
    buf[base: base + len(ah)] = ah
    raw = hdr.encode()
    buf[BACKUP_OFF: BACKUP_OFF + len(raw)] = raw
    buf[HEADER_OFF: HEADER_OFF + len(raw)] = raw
    # As every durability point after it: its last record is stamped (fs/log.py scan).
    off, stamp = position.stamp(1, now)
    buf[off: off + len(stamp)] = stamp
    return [(0, hdr.data_off), *format_map(buf, hdr)]


def device_at(path: str) -> DaxDevice | None:
    """The device DAX at ``path``, None for anything that is no character device; MkfsError
    for a character device of another kind."""
    try:
        return place.device_at(path)
    except place.PlaceError as e:
        raise MkfsError(str(e)) from None


def _mkfs_device(path: str, hdr: Header, uid: int, gid: int,
                 progress: Callable[[int, int], None] | None) -> Header:
    size = hdr.pool_size
    try:
        # Exclusive, as every writer of a pool: a device a mount or target has is refused.
        pm = PoolMapping.open(path, exclusive=True, length=size)
    except PmemError as e:
        raise MkfsError(str(e)) from None
    with pm:
        # A file starts as zeroes; a device holds whatever it held, and a replica made from
        # this pool starts as zeroes too.
        zeros = memoryview(bytes(min(size, 32 << 20)))
        for at in range(0, size, len(zeros)):
            pm.write_nt(at, zeros[: min(len(zeros), size - at)])
            if progress:
                progress(min(at + len(zeros), size), size)
        pm.persist(format_pool(pm.buf, hdr, uid, gid))
    return hdr


def remove_pool(path: str) -> None:
    """Undo a mkfs: unlink the pool file, or on a device DAX make it no pool."""
    place.unmake(path)


def mkfs(path: str, size: int, force: bool = False, uid: int | None = None, gid: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> Header:
    """Create the pool at path (a file, or a device DAX) with an empty root directory; returns
    its header."""
    try:
        hdr = plan(size, uuidlib.uuid4().bytes, time.time_ns())
    except PoolFormatError as e:
        raise MkfsError(str(e)) from None
    uid = os.getuid() if uid is None else uid
    gid = os.getgid() if gid is None else gid
    try:
        place.refuse_link(path)
        dev = place.device_at(path)
        if dev is not None:
            place.check_device(dev, size, force)
            return _mkfs_device(path, hdr, uid, gid, progress)
        os.close(place.new_file(path, size, force, progress))
    except place.PlaceError as e:
        raise MkfsError(str(e)) from None
    with PoolMapping.open(path, "msync", opener=safeopen.opener) as pm:
        pm.persist(format_pool(pm.buf, hdr, uid, gid))
    fd = safeopen.opener(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return hdr
