"""The pools a target serves: files under the pool directory, or device DAX namespaces given by
--pool-dev (pooldevs.py), mapped while any session uses them."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Any

from rpmemfs.latency import BOUNDS_S, Snapshot
from rpmemfs.native import ffi, lib
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool.header import find_header
from rpmemfs.pool.layout import Header
from rpmemfs.poolname import PoolNameError
from rpmemfs.target.errors import TargetError
from rpmemfs.target.pooldevs import PoolDevError, PoolDevices
from rpmemfs.target.pooldir import PoolDir
from rpmemfs.units import human

log = logging.getLogger("rpmemfs.target.pools")

PAGE = 4096
# Persists of more than this run in a worker thread, so one initiator's large flush does not
# stall every other connection; smaller ones are not worth the hop. msync on a slow disk
# costs far more per byte than writing back cache lines, hence two bounds.
THREAD_PERSIST_MIN = 1 << 20
THREAD_FLUSH_MIN = 16 << 20


class PoolError(TargetError):
    """A pool operation is refused or failed; the message goes back to the initiator."""

    def __init__(self, message: str, code: str = "pool") -> None:
        super().__init__(message)
        self.code = code


# The lanes' C loops count persist latencies in the buckets of the daemon's histograms.
lib.rpm_persist_bounds([round(b * 1e9) for b in BOUNDS_S], len(BOUNDS_S))


class PoolCounters:
    """What initiators did to one pool, kept in C memory: the lanes' C threads count too."""

    FIELDS = ("writes", "bytes", "flushes", "reads", "atomics", "persisted_ranges", "persisted_bytes",
              "persists", "persist_ns")

    def __init__(self) -> None:
        self.c: Any = ffi.new("struct rpm_counters *")

    def add(self, field: str, n: int = 1) -> None:
        lib.rpm_count(ffi.addressof(self.c[0], field), n)

    def persisted(self, ns: int, nbytes: int) -> None:
        lib.rpm_count_persist(self.c, ns, nbytes)

    def persist_latency(self) -> Snapshot:
        """Flushes' write-backs (general-purpose method; under apm each write is written back
        as it is placed and there is no separate persist to time)."""
        total, cumulative = 0, []
        for i in range(len(BOUNDS_S) + 1):
            total += int(self.c.persist_hist[i])
            cumulative.append(total)
        return Snapshot(tuple(cumulative), int(self.c.persist_ns) / 1e9, int(self.c.persists))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f: int(getattr(self.c, f)) for f in self.FIELDS}
        out["persist_buckets"] = list(self.persist_latency().buckets)
        return out


class Pool:
    """One mapped pool file. ``users`` counts tasks inside an await with a view of the mapping;
    the mapping is unmapped only when no region refers to it and no task is using it."""

    def __init__(self, name: str, fd: int | None, mapping: PoolMapping, counters: PoolCounters) -> None:
        self.name = name
        # For the fsync at close: the file that was mapped, not what has its name now. None
        # for a device DAX: nothing of it is dirty (every persist wrote its lines back), and it
        # refuses fsync.
        self._fd = fd
        self.mapping = mapping
        self.buf = mapping.buf
        self.size = mapping.size
        self.counters = counters
        self.refs = 0
        self.users = 0
        self._closing = False
        # Page faults on first stores cost as much as the copy itself: a fresh replica
        # would take them inside barriers. Fault the pool in from a thread (the C call
        # drops the GIL) while the first barriers arrive.
        self._populated = threading.Event()
        self._populator = threading.Thread(target=mapping.populate, args=(self._populated,),
                                           name=f"populate {name}", daemon=True)
        self._populator.start()

    @property
    def uuid(self) -> bytes | None:
        hdr = self.header
        return hdr.uuid if hdr else None

    @property
    def epoch(self) -> int | None:
        hdr = self.header
        return hdr.epoch if hdr else None

    @property
    def header(self) -> Header | None:
        """The pool header (primary copy, else the backup), or None while there is none."""
        return find_header(self.buf)

    def needs_thread(self, ranges: list[tuple[int, int]]) -> bool:
        """Whether persisting these (merged) ranges is long enough for a worker thread."""
        bound = THREAD_FLUSH_MIN if self.mapping.is_pmem else THREAD_PERSIST_MIN
        return sum(length for _, length in ranges) > bound

    def persist(self, merged: list[tuple[int, int]], named: int) -> None:
        """Persist ``merged`` (merge_ranges of the ``named`` ranges an initiator asked for:
        callers merge once, to decide on a thread too), timed and counted."""
        started = time.monotonic_ns()
        self.mapping.persist(merged)
        self.counters.persisted(time.monotonic_ns() - started, sum(length for _, length in merged))
        self.counters.add("persisted_ranges", named)

    def acquire(self) -> None:
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0 and self._closing:
            self._finish_close()

    def close(self) -> None:
        self._closing = True
        if self.users == 0:
            self._finish_close()

    def _finish_close(self) -> None:
        self._populated.set()
        self._populator.join()
        try:
            # fsync writes back what is dirty, whatever the mapping kind, in proportion to
            # what is dirty rather than to the pool's size.
            if self._fd is not None:
                os.fsync(self._fd)
        except OSError as exc:
            log.error("pool %s: persisting at close failed: %s", self.name, exc.strerror)
        finally:
            if self._fd is not None:
                os.close(self._fd)
        self.buf = memoryview(b"")
        try:
            self.mapping.close()
        except BufferError:
            log.error("pool %s: still referenced at close; left mapped", self.name)


class PoolStore:
    def __init__(self, pool_dir: str, pmem_mode: str, max_pool_size: int,
                 pool_devs: list[tuple[str, str]] | None = None) -> None:
        self.pool_dir = os.path.realpath(pool_dir)
        self.dir = PoolDir(self.pool_dir)
        try:
            self.devices = PoolDevices(self.dir, pool_devs or [])
        except BaseException:
            self.dir.close()
            raise
        self.pmem_mode = pmem_mode
        self.max_pool_size = max_pool_size
        self._open: dict[str, Pool] = {}
        self._counters: dict[str, PoolCounters] = {}

    def probe_kind(self) -> str:
        """Map a scratch file in the pool directory the way pools will be mapped; its kind."""
        # A leading dot keeps the probe out of the pool namespace: no pool name starts with one.
        name = f".rpmemfs-probe-{os.getpid()}"
        try:
            self.dir.unlink(name, missing_ok=True)  # left by a target that was killed
            fd = self.dir.create(name, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, PAGE)
            finally:
                os.close(fd)
            with PoolMapping.open(name, self.pmem_mode, opener=self.dir.opener) as pm:
                return pm.kind
        except OSError as exc:
            raise PoolError(f"cannot use pool directory {self.pool_dir}: {exc.strerror}") from exc
        except PmemError as exc:
            raise PoolError(f"cannot map pools in {self.pool_dir}: {exc}") from exc
        finally:
            self.dir.unlink(name, missing_ok=True)

    @staticmethod
    def _on_device(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except PoolDevError as exc:
            raise PoolError(str(exc), exc.code) from None
        except PmemError as exc:
            raise PoolError(str(exc), "io") from None

    def _check_size(self, name: str, size: object, disk: bool = True) -> int:
        if not isinstance(size, int) or isinstance(size, bool):
            raise PoolError("pool size must be an integer number of bytes", "size")
        if size < PAGE or size % PAGE:
            raise PoolError(f"pool size {size} must be a positive multiple of {PAGE} bytes", "size")
        if size > self.max_pool_size:
            raise PoolError(
                f"pool size {size} ({human(size)}) exceeds this target's limit of "
                f"{self.max_pool_size} ({human(self.max_pool_size)})",
                "size",
            )
        if not disk:
            return size
        free = shutil.disk_usage(self.pool_dir).free
        if size > free:
            raise PoolError(
                f"not enough free space in {self.pool_dir} for pool {name!r}: it needs {size} bytes "
                f"({human(size)}), {free} ({human(free)}) available",
                "no-space",
            )
        return size

    def create_file(self, name: str, size: object) -> None:
        """Make a zero-filled pool file of ``size`` bytes (blocking: run it in a thread)."""
        if name in self.devices:
            self._on_device(self.devices.create, name, self._check_size(name, size, disk=False))
            return
        size = self._check_size(name, size)
        try:
            fd = self.dir.create(name, os.O_RDWR)
        except FileExistsError:
            raise PoolError(f"pool {name!r} already exists", "exists") from None
        except OSError as exc:
            raise PoolError(f"cannot create pool {name!r}: {exc.strerror}", "io") from exc
        try:
            # Reserving every block now makes a full disk fail here, with a message, rather
            # than as SIGBUS when a write lands on a hole later.
            os.posix_fallocate(fd, 0, size)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self.dir.unlink(name)
            raise PoolError(
                f"cannot allocate {size} bytes for pool {name!r}: {exc.strerror}", "no-space"
            ) from exc
        os.close(fd)
        self.dir.sync()
        log.info("pool %s created (%d bytes)", name, size)

    def grow_file(self, name: str, size: object) -> bool:
        """Grow pool ``name`` to ``size`` bytes (blocking: run it in a thread); False when it
        is that size already. Only a pool no session has open: a mapping is not resized under
        a lane."""
        if not isinstance(size, int) or isinstance(size, bool) or size % PAGE:
            raise PoolError(f"pool size must be a multiple of {PAGE} bytes", "size")
        if size > self.max_pool_size:
            raise PoolError(f"pool size {size} ({human(size)}) exceeds this target's limit of "
                            f"{self.max_pool_size} ({human(self.max_pool_size)})", "size")
        if name in self._open:
            raise PoolError(f"pool {name!r} is open; it grows only when no session has it open", "busy")
        if name in self.devices:
            return bool(self._on_device(self.devices.grow, name, size))
        fd = self.dir.open(name, os.O_RDWR)  # relative to the pool directory, no links followed
        try:
            st = os.fstat(fd)
            if size < st.st_size:
                raise PoolError(f"pool {name!r} is {st.st_size} bytes; pools only grow", "size")
            if size == st.st_size:
                return False
            if size - st.st_size > shutil.disk_usage(self.pool_dir).free:
                raise PoolError(f"not enough free space in {self.pool_dir} to grow pool {name!r} "
                                f"to {human(size)}", "no-space")
            try:
                os.posix_fallocate(fd, st.st_size, size - st.st_size)
                os.fsync(fd)
            except OSError as exc:
                os.ftruncate(fd, st.st_size)
                raise PoolError(f"cannot grow pool {name!r}: {exc.strerror}", "no-space") from exc
        finally:
            os.close(fd)
        log.info("pool %s grown to %d bytes", name, size)
        return True

    def open(self, name: str) -> Pool:
        """The pool, mapped, with one more reference."""
        pool = self._open.get(name)
        if pool is None:
            pool = self._map(name)
            self._open[name] = pool
        pool.refs += 1
        return pool

    def _map(self, name: str) -> Pool:
        if name in self.devices:
            mapping = self._on_device(self.devices.map, name, self.pmem_mode)
            log.info("pool %s mapped (%d bytes of device DAX %s)", name, mapping.size, mapping.path)
            return Pool(name, None, mapping, self._counters.setdefault(name, PoolCounters()))
        fd = self.dir.open(name, os.O_RDWR)
        try:
            # The one file opened and checked here is the one mapped (and fsynced at close).
            mapping = PoolMapping.open(name, self.pmem_mode, exclusive=True,
                                       opener=lambda _name, _flags: os.dup(fd))
        except PmemError as exc:
            os.close(fd)
            raise PoolError(str(exc), "io") from exc
        except BaseException:
            os.close(fd)
            raise
        counters = self._counters.setdefault(name, PoolCounters())
        log.info("pool %s mapped (%d bytes, %s)", name, mapping.size, mapping.kind)
        return Pool(name, fd, mapping, counters)

    def release(self, pool: Pool) -> None:
        pool.refs -= 1
        if pool.refs == 0:
            del self._open[pool.name]
            pool.close()
            log.info("pool %s closed", pool.name)

    def remove(self, name: str) -> None:
        if name in self.devices:
            if name in self._open:
                raise PoolError(f"pool {name!r} is open; close it in every session first", "busy")
            self._on_device(self.devices.remove, name)
            self._counters.pop(name, None)
            return
        os.close(self.dir.open(name, os.O_RDONLY))  # a pool, not a link or anything else
        if name in self._open:
            raise PoolError(f"pool {name!r} is open; close it in every session first", "busy")
        try:
            self.dir.unlink(name)
            self.dir.sync()
        except OSError as exc:
            raise PoolError(f"cannot remove pool {name!r}: {exc.strerror}", "io") from exc
        self._counters.pop(name, None)
        log.info("pool %s removed", name)

    def names(self) -> list[str]:
        """What may be a pool: the pool directory's entries and the device pools that exist."""
        return sorted({*self.dir.names(), *self.devices.names()})

    def head(self, name: str, nbytes: int) -> tuple[int, bytes]:
        """(size, its first ``nbytes``) of pool ``name``, without mapping a pool file;
        PoolNameError when there is no such pool."""
        if name in self.devices:
            size = self.devices.size(name)
            if size is None:
                raise PoolNameError(f"pool {name!r} does not exist")
            # A device DAX cannot be read(2); it is mapped (read-only, never written).
            with self._on_device(self.devices.map, name, self.pmem_mode) as pm:
                return size, bytes(pm.buf[:nbytes])
        fd = self.dir.open(name, os.O_RDONLY)
        try:
            return os.fstat(fd).st_size, os.pread(fd, nbytes, 0)
        finally:
            os.close(fd)

    def stats(self, name: str | None = None) -> dict[str, Any]:
        names = [name] if name is not None else sorted(self._counters)
        return {
            n: {**self._counters.get(n, PoolCounters()).as_dict(), "open": n in self._open}
            for n in names
        }

    def close_all(self) -> None:
        for pool in list(self._open.values()):
            pool.refs = 1
            self.release(pool)
