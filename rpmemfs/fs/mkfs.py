"""Making a new pool: a file, or on a device DAX (where the pool may be smaller than the device)."""

from __future__ import annotations

import os
import shutil
import stat
import time
import uuid as uuidlib
from collections.abc import Callable

from rpmemfs import safeopen
from rpmemfs.devdax import DaxDevice, DevDaxError, probe
from rpmemfs.fs import records as R
from rpmemfs.fs.errors import MkfsError
from rpmemfs.fs.log import Ranges
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.holders import busy
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool import position
from rpmemfs.pool.header import find_header
from rpmemfs.pool.layout import (
    AREA_RECORDS_OFF,
    BACKUP_OFF,
    HEADER_BYTES,
    HEADER_OFF,
    AreaHeader,
    Header,
    PoolFormatError,
    plan,
)
from rpmemfs.pool.syncmap import format_map


def _zero(fd: int, size: int, progress: Callable[[int, int], None] | None) -> None:
    # fallocate reserves the space now, so a full disk fails here rather than as SIGBUS later.
    chunk = 256 << 20
    done = 0
    while done < size:
        n = min(chunk, size - done)
        try:
            os.posix_fallocate(fd, done, n)
        except OSError as e:
            raise MkfsError(f"cannot allocate {size} bytes for the pool: {e.strerror}") from e
        done += n
        if progress:
            progress(done, size)


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
        return probe(path)
    except DevDaxError as e:
        raise MkfsError(str(e)) from None


def _mkfs_device(path: str, hdr: Header, force: bool, uid: int, gid: int,
                 progress: Callable[[int, int], None] | None) -> Header:
    size = hdr.pool_size
    try:
        # Exclusive, as every writer of a pool: a device a mount or target has is refused.
        pm = PoolMapping.open(path, exclusive=True, length=size)
    except PmemError as e:
        raise MkfsError(str(e)) from None
    with pm:
        old = find_header(pm.buf)
        if old is not None and not force:
            raise MkfsError(f"{path} holds an rpmemfs pool (uuid {old.uuid_str}); use --force to "
                            "overwrite it")
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
    """Undo a mkfs: unlink the pool file, or on a device DAX make it no pool (both header
    copies zeroed)."""
    if device_at(path) is None:
        os.unlink(path)
        return
    with PoolMapping.open(path, exclusive=True) as pm:
        # Neither copy left: nothing takes it for a pool, and mkfs needs no --force on it.
        pm.write_nt(HEADER_OFF, bytes(BACKUP_OFF + HEADER_BYTES - HEADER_OFF))


def mkfs(path: str, size: int, force: bool = False, uid: int | None = None, gid: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> Header:
    """Create the pool at path (a file, or a device DAX) with an empty root directory; returns
    its header."""
    try:
        hdr = plan(size, uuidlib.uuid4().bytes, time.time_ns())
    except PoolFormatError as e:
        raise MkfsError(str(e)) from None
    try:
        safeopen.refuse_link(path)  # a pool is written where it is named, device DAX or file
    except OSError as e:
        raise MkfsError(str(e)) from None
    if device_at(path) is not None:
        return _mkfs_device(path, hdr, force, os.getuid() if uid is None else uid,
                            os.getgid() if gid is None else gid, progress)
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        # --force replaces a pool file; a block device, FIFO or socket is never unlinked.
        raise MkfsError(f"{path} is not a regular file: a pool is a file or a device DAX (/dev/daxX.Y)")
    if os.path.lexists(path) and not force:
        raise MkfsError(f"{path} exists; use --force to overwrite it")
    if force and (who := busy(path)):
        raise MkfsError(f"{path} is in use ({who}): stop that process before replacing the pool")
    if os.path.isdir(path):
        raise MkfsError(f"{path} is a directory")
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(parent):
        raise MkfsError(f"directory {parent} does not exist")
    existing = os.path.getsize(path) if os.path.isfile(path) else 0
    free = shutil.disk_usage(parent).free + existing
    if size > free:
        raise MkfsError(f"not enough free space in {parent}: pool needs {size} bytes, "
                        f"{free} available")
    try:
        # Never through a link, nor into a file someone else left at the name: --force
        # replaces the name's file by a new one (rpmemfs/safeopen.py).
        fd = safeopen.replace(path) if force else safeopen.create(path)
    except safeopen.RefusedPath as e:
        raise MkfsError(str(e)) from None
    except FileExistsError:
        raise MkfsError(f"{path} exists; use --force to overwrite it") from None
    except OSError as e:
        raise MkfsError(f"cannot create {path}: {e.strerror}") from e
    try:
        _zero(fd, size, progress)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    with PoolMapping.open(path, "msync", opener=safeopen.opener) as pm:
        pm.persist(format_pool(pm.buf, hdr, os.getuid() if uid is None else uid,
                               os.getgid() if gid is None else gid))
    fd = safeopen.opener(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return hdr
