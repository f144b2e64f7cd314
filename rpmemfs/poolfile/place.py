"""Where a whole new pool is written: a file made for it, or a device DAX it is written onto.

mkfs, recover and promote each write a whole pool at a path the administrator names, so they
share one set of rules, refused in the same words:

- never through a symbolic link, nor into a file someone else left at the name (safeopen.py);
- a name that holds something is replaced only with --force, and never while a process has
  it open (a mount, a target, a check);
- a file gets all of its space at once (fallocate), so that a full disk fails here and not
  as a SIGBUS halfway through;
- a device DAX is never truncated, unlinked or replaced by a file: it must be device DAX, the
  pool must fit on it, and a device that holds a pool is overwritten only with --force;
- anything else that is not a regular file (a block device, a FIFO, /dev/null) is refused;
- a pool that could not be finished is unmade (``unmake``): a file is unlinked, a device gets
  both header copies zeroed, so that nothing later takes half a pool for a pool.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from rpmemfs import safeopen
from rpmemfs.devdax import DaxDevice, DevDaxError, probe
from rpmemfs.errors import RpmemfsError
from rpmemfs.holders import busy
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool.header import find_header
from rpmemfs.pool.layout import BACKUP_OFF, HEADER_BYTES, HEADER_OFF
from rpmemfs.units import human

_ALLOCATE_STEP = 256 << 20


class PlaceError(RpmemfsError):
    """The pool cannot be written at that path; the message says why and what to do."""


def device_at(path: str) -> DaxDevice | None:
    """The device DAX at ``path``, None for anything that is no character device; PlaceError
    for a character device of another kind."""
    try:
        return probe(path)
    except DevDaxError as exc:
        raise PlaceError(str(exc)) from None


def refuse_link(path: str) -> None:
    """A pool is written where it is named, device DAX or file: never through a link."""
    try:
        safeopen.refuse_link(path)
    except OSError as exc:
        raise PlaceError(str(exc)) from None


def _refuse_busy(path: str) -> None:
    if who := busy(path):
        raise PlaceError(f"{path} is in use ({who}): stop that process before replacing the pool")


def check_device(dev: DaxDevice, size: int, force: bool) -> None:
    """Whether a pool of ``size`` bytes may be written onto ``dev``: it fits, nothing has the
    device open, and it holds no pool unless ``force``."""
    if size > dev.size:
        raise PlaceError(f"device DAX {dev.path} holds {dev.size} bytes ({human(dev.size)}); a pool "
                         f"of {size} bytes ({human(size)}) does not fit on it")
    _refuse_busy(dev.path)
    if force:
        return
    try:
        with PoolMapping.open(dev.path, readonly=True) as pm:
            old = find_header(pm.buf)
            uuid = old.uuid_str if old is not None else None
    except PmemError as exc:
        raise PlaceError(str(exc)) from None
    if uuid is not None:
        raise PlaceError(f"{dev.path} holds an rpmemfs pool (uuid {uuid}); use --force to "
                         "overwrite it")


def new_file(path: str, size: int, force: bool,
             progress: Callable[[int, int], None] | None = None) -> int:
    """A new file of ``size`` bytes (zeroes, its space reserved) at ``path``, open read-write;
    with ``force`` in place of the file there."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        # --force replaces a pool file; a block device, FIFO or socket is never unlinked.
        raise PlaceError(f"{path} is not a regular file: a pool is a file or a device DAX (/dev/daxX.Y)")
    if os.path.lexists(path) and not force:
        raise PlaceError(f"{path} exists; use --force to overwrite it")
    if force:
        _refuse_busy(path)
    if os.path.isdir(path):
        raise PlaceError(f"{path} is a directory")
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(parent):
        raise PlaceError(f"directory {parent} does not exist")
    existing = os.path.getsize(path) if os.path.isfile(path) else 0
    free = shutil.disk_usage(parent).free + existing
    if size > free:
        raise PlaceError(f"not enough free space in {parent}: the pool needs {size} bytes, "
                         f"{free} available")
    try:
        fd = safeopen.replace(path) if force else safeopen.create(path)
    except safeopen.RefusedPath as exc:
        raise PlaceError(str(exc)) from None
    except FileExistsError:
        raise PlaceError(f"{path} exists; use --force to overwrite it") from None
    except OSError as exc:
        raise PlaceError(f"cannot create {path}: {exc.strerror}") from None
    try:
        for done in range(0, size, _ALLOCATE_STEP):
            n = min(_ALLOCATE_STEP, size - done)
            try:
                os.posix_fallocate(fd, done, n)
            except OSError as exc:
                raise PlaceError(f"cannot allocate {size} bytes for {path}: {exc.strerror}") from None
            if progress:
                progress(done + n, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def prepare(path: str, size: int, force: bool,
            progress: Callable[[int, int], None] | None = None) -> DaxDevice | None:
    """Make ``path`` ready to take a whole pool of ``size`` bytes: a device DAX checked (and
    returned), else a new file (zeroes) made; the caller then maps it and writes the pool."""
    refuse_link(path)
    dev = device_at(path)
    if dev is not None:
        check_device(dev, size, force)
        return dev
    os.close(new_file(path, size, force, progress))
    return None


def unmake(path: str) -> None:
    """Undo a pool that could not be finished: unlink the file, or on a device DAX make it no
    pool (both header copies zeroed), so that nothing takes it for one and mkfs needs no
    --force on it."""
    if device_at(path) is None:
        os.unlink(path)
        return
    with PoolMapping.open(path, exclusive=True) as pm:
        pm.write_nt(HEADER_OFF, bytes(BACKUP_OFF + HEADER_BYTES - HEADER_OFF))
