"""Pools a target keeps on device DAX (`rpmemfs target --pool-dev NAME=/dev/daxX.Y`).

The administrator gives each such pool its device at start; the target opens every device
then and holds an exclusive lock on it for as long as it runs (the lock pools have: a mount,
mkfs or another target that would write the device is refused, and a device held elsewhere
stops the target from starting, saying who holds it). A device DAX has no file to exist or
not and no size but its own, so whether pool NAME exists, and how big it is, is recorded
beside the owner records in the pool directory: ``.NAME.dev`` (JSON: size and device), written
durably (write, fsync, rename, fsync the directory) before create answers. The owner record
stays in the directory too, as for every pool (target/owners.py): a primary writes the
device's bytes, never the record that fences it.

A pool on a device is zeroed when created (as a new pool file is), may be created smaller
than the device, grows up to the device's size and no further, and on removal loses its
header and its record.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from dataclasses import dataclass

from rpmemfs.devdax import DaxDevice, DevDaxError, probe
from rpmemfs.holders import describe_process, lock_holders
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool.layout import BACKUP_OFF, HEADER_BYTES
from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.target.errors import TargetError
from rpmemfs.target.pooldir import PoolDir
from rpmemfs.units import human

log = logging.getLogger("rpmemfs.target.pooldevs")

MAX_RECORD = 4096
_ZERO_CHUNK = 32 << 20


class PoolDevError(TargetError):
    """A --pool-dev cannot be used, or a request on a device pool is refused; ``code`` as
    pools.PoolError's."""

    def __init__(self, message: str, code: str = "pool") -> None:
        super().__init__(message)
        self.code = code


def parse_pool_dev(text: str) -> tuple[str, str]:
    """NAME=PATH, as --pool-dev takes it; PoolDevError saying what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise PoolDevError(f"--pool-dev {text!r}: give NAME=/dev/daxX.Y")
    try:
        return check_name(name), path
    except PoolNameError as exc:
        raise PoolDevError(f"--pool-dev {text!r}: {exc}") from None


@dataclass
class _Dev:
    info: DaxDevice
    fd: int  # open for the target's life, holding the exclusive lock


class PoolDevices:
    def __init__(self, pool_dir: PoolDir, given: list[tuple[str, str]]) -> None:
        self.dir = pool_dir
        self._devs: dict[str, _Dev] = {}
        try:
            for name, path in given:
                self._add(name, path)
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, path: str) -> None:
        if name in self._devs:
            raise PoolDevError(f"--pool-dev names pool {name!r} twice")
        try:
            info = probe(path)
        except DevDaxError as exc:
            raise PoolDevError(f"--pool-dev {name}={path}: {exc}") from None
        if info is None:
            raise PoolDevError(f"--pool-dev {name}={path}: no such device, or not a character device: "
                               "give a device DAX (/dev/daxX.Y, ndctl create-namespace -m devdax)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise PoolDevError(f"--pool-dev {name}={path}: {exc.strerror}") from None
        try:
            rdev = os.fstat(fd).st_rdev
            for other, dev in self._devs.items():
                if os.fstat(dev.fd).st_rdev == rdev:
                    raise PoolDevError(f"--pool-dev {name}={path}: the device of pool {other!r} "
                                       f"({dev.info.path}) already")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = "; ".join(describe_process(pid) for pid in lock_holders(fd))
                raise PoolDevError(f"--pool-dev {name}={path}: the device is in use ("
                                   f"{who or 'holder not visible from here'}); stop that process "
                                   "first") from None
            with contextlib.suppress(FileNotFoundError):
                self.dir.lstat(name)
                raise PoolDevError(f"--pool-dev {name}={path}: the pool directory {self.dir.path} has "
                                   f"a file named {name!r} too; remove or rename one of them")
        except BaseException:
            os.close(fd)
            raise
        self._devs[name] = _Dev(info, fd)
        log.info("pool %s lives on device DAX %s (%d bytes, alignment %d)", name, path, info.size,
                 info.align)

    def close(self) -> None:
        for dev in self._devs.values():
            os.close(dev.fd)
        self._devs.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._devs

    def device(self, name: str) -> DaxDevice:
        return self._devs[name].info

    # -- the record ---------------------------------------------------------------------
    def _record(self, name: str) -> str:
        return f".{check_name(name)}.dev"

    def size(self, name: str) -> int | None:
        """The pool's size when it exists, else None."""
        try:
            raw = self.dir.read_record(self._record(name), MAX_RECORD, "device pool record")
        except PoolNameError:
            return None
        try:
            size = json.loads(raw)["size"]
            if not isinstance(size, int) or not 0 < size <= self.device(name).size:
                raise ValueError(f"size {size!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise PoolDevError(f"the record of pool {name!r} on {self.device(name).path} is unreadable "
                               f"({exc}): remove the pool and create it again", "io") from None
        return size

    def _set_size(self, name: str, size: int) -> None:
        self.dir.write_record(self._record(name),
                              json.dumps({"size": size, "device": self.device(name).path}).encode())

    def names(self) -> list[str]:
        """The device pools that exist."""
        return sorted(n for n in self._devs if self.size(n) is not None)

    # -- what a pool's life asks --------------------------------------------------------
    def map(self, name: str, mode: str) -> PoolMapping:
        """The existing pool ``name``, mapped (its device whole, the pool's size shown)."""
        size = self.size(name)
        if size is None:
            raise PoolNameError(f"pool {name!r} does not exist (its device {self.device(name).path} "
                                "holds no pool yet)")
        fd = self._devs[name].fd
        try:
            return PoolMapping.open(self.device(name).path, mode, exclusive=True, length=size,
                                    opener=lambda _path, _flags: os.dup(fd))
        except PmemError as exc:
            raise PoolDevError(str(exc), "io") from exc

    def _zero(self, name: str, start: int, end: int) -> None:
        with self.map_whole(name, end) as pm:
            zeros = memoryview(bytes(min(_ZERO_CHUNK, end - start)))
            for at in range(start, end, len(zeros)):
                pm.write_nt(at, zeros[: min(len(zeros), end - at)])

    def map_whole(self, name: str, length: int) -> PoolMapping:
        fd = self._devs[name].fd
        return PoolMapping.open(self.device(name).path, exclusive=True, length=length,
                                opener=lambda _path, _flags: os.dup(fd))

    def create(self, name: str, size: int) -> None:
        """Make pool ``name`` of ``size`` bytes on its device: zeroes, then the record."""
        dev = self.device(name)
        if self.size(name) is not None:
            raise PoolDevError(f"pool {name!r} already exists", "exists")
        if size > dev.size:
            raise PoolDevError(f"pool {name!r} lives on device DAX {dev.path}, which holds {dev.size} "
                               f"bytes ({human(dev.size)}); a pool of {human(size)} does not fit",
                               "no-space")
        self._zero(name, 0, size)
        self._set_size(name, size)
        log.info("pool %s created on %s (%d bytes)", name, dev.path, size)

    def grow(self, name: str, size: int) -> bool:
        """Grow pool ``name`` to ``size`` bytes within its device; False when it is that size."""
        dev = self.device(name)
        old = self.size(name)
        if old is None:
            raise PoolNameError(f"pool {name!r} does not exist")
        if size < old:
            raise PoolDevError(f"pool {name!r} is {old} bytes; pools only grow", "size")
        if size == old:
            return False
        if size > dev.size:
            raise PoolDevError(f"pool {name!r} lives on device DAX {dev.path}, which holds {dev.size} "
                               f"bytes ({human(dev.size)}): a device cannot grow", "no-space")
        self._zero(name, old, size)
        self._set_size(name, size)
        log.info("pool %s grown to %d bytes on %s", name, size, dev.path)
        return True

    def remove(self, name: str) -> None:
        """Forget pool ``name``: its header goes (nothing takes the device for a pool any more),
        then its record."""
        size = self.size(name)
        if size is None:
            raise PoolNameError(f"pool {name!r} does not exist")
        self._zero(name, 0, min(size, BACKUP_OFF + HEADER_BYTES))
        self.dir.unlink(self._record(name))
        self.dir.sync()
        log.info("pool %s removed from %s", name, self.device(name).path)
