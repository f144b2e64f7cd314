"""Mapping of a pool (a file, or a device DAX) and the ways its stores are made durable.

Four kinds of mapping exist, after what the file system, the device and the caller allow:

* ``dax``: MAP_SYNC on a DAX file system. Stores reach persistent memory by cache
  write-back alone (clwb + sfence); the kernel keeps file metadata in step.
* ``devdax``: a device DAX (/dev/daxX.Y, devdax.py), mapped whole, whatever mode is asked:
  it is always synchronous, stores are made durable by cache write-back alone, and msync
  is refused by the kernel. A pool there may be smaller than the device: the mapping shows
  only the pool (as long as its header says), so everything above sees a pool of its size.
* ``force``: an ordinary shared mapping handled as if it were persistent memory,
  like PMDK's PMEM_IS_PMEM_FORCE. Fast, but durability is only emulated.
* ``msync``: an ordinary shared mapping made durable with msync(MS_SYNC).
"""

import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self

from rpmemfs.devdax import DevDaxError, describe
from rpmemfs.errors import RpmemfsError
from rpmemfs.holders import describe_process, lock_holders
from rpmemfs.native import BytesLike, ffi, lib
from rpmemfs.pool.header import find_header
from rpmemfs.units import human

log = logging.getLogger("rpmemfs.pmem")

PMEM_MODES = ("auto", "force", "msync")

# Linux values, absent from the mmap module; it hands flags to mmap(2) untouched, and
# MAP_SHARED_VALIDATE is what makes a kernel refuse MAP_SYNC instead of ignoring it.
MAP_SHARED_VALIDATE = 0x03
MAP_SYNC = 0x80000

_PAGE = mmap.PAGESIZE
_RW = mmap.PROT_READ | mmap.PROT_WRITE


class PmemError(RpmemfsError):
    """The pool file cannot be mapped or written as asked."""


def _map(fd: int, size: int, path: str, mode: str, readonly: bool) -> tuple[mmap.mmap, str]:
    plain_kind = "force" if mode == "force" else "msync"
    try:
        if readonly:
            # Nothing is ever written back through a read-only view, so MAP_SYNC buys nothing.
            return mmap.mmap(fd, size, access=mmap.ACCESS_READ), plain_kind
        if mode == "auto":
            try:
                flags = MAP_SHARED_VALIDATE | MAP_SYNC
                return mmap.mmap(fd, size, flags=flags, prot=_RW), "dax"
            except OSError as exc:
                # EOPNOTSUPP: not a DAX file system; EINVAL: a kernel older than MAP_SYNC.
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise PmemError(f"MAP_SYNC mapping of {path} failed: {exc.strerror}") from exc
                log.debug("MAP_SYNC refused for %s (%s); using msync", path, exc.strerror)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=_RW), plain_kind
    except OSError as exc:
        raise PmemError(f"cannot map pool {path}: {exc.strerror or exc}") from exc


def _map_device(fd: int, st: os.stat_result, path: str, readonly: bool,
                length: int | None) -> tuple[mmap.mmap, int]:
    """The whole device DAX mapped, and how much of it the pool is: ``length`` when given
    (mkfs), else what the pool's header says, else the whole device."""
    try:
        dev = describe(path, st)
    except DevDaxError as exc:
        raise PmemError(str(exc)) from None
    if length is not None and length > dev.size:
        raise PmemError(f"device DAX {path} holds {dev.size} bytes ({human(dev.size)}); a pool of "
                        f"{length} bytes ({human(length)}) does not fit on it")
    try:
        # Shared, never MAP_SYNC: a device DAX is synchronous by itself. Its whole size is a
        # multiple of its alignment, and the kernel aligns the start (dax_get_unmapped_area).
        if readonly:
            mm = mmap.mmap(fd, dev.size, access=mmap.ACCESS_READ)
        else:
            mm = mmap.mmap(fd, dev.size, flags=mmap.MAP_SHARED, prot=_RW)
    except OSError as exc:
        raise PmemError(f"cannot map device DAX {path} ({dev.size} bytes, alignment {dev.align}): "
                        f"{exc.strerror or exc}") from exc
    if length is None:
        # The pool format is read here only for its length: a device has no file size to say it.
        with memoryview(mm) as view:  # released at once: a view left would keep mm from closing
            hdr = find_header(view)
        length = hdr.pool_size if hdr is not None and 0 < hdr.pool_size <= dev.size else dev.size
    return mm, length


def _page_spans(pairs: list[int], size: int) -> list[tuple[int, int]]:
    """Page-aligned (start, end) spans covering the non-empty ranges, merged."""
    spans = sorted(
        (pairs[i] & -_PAGE, pairs[i] + pairs[i + 1]) for i in range(0, len(pairs), 2) if pairs[i + 1]
    )
    out: list[tuple[int, int]] = []
    for start, end in spans:
        end = min(-(-end // _PAGE) * _PAGE, size)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class PoolMapping:
    """A pool file mapped whole; use :meth:`open` to make one."""

    path: str
    size: int
    requested: str
    kind: str
    is_pmem: bool
    buf: memoryview

    def __init__(
        self, path: str, size: int, requested: str, kind: str, mm: mmap.mmap, readonly: bool
    ) -> None:
        self.path = path
        self.size = size
        self.requested = requested
        self.kind = kind
        self.is_pmem = kind in ("dax", "devdax", "force")
        self.readonly = readonly
        self._mm = mm
        # A pool on a device DAX may end before the device does: the view ends with the pool.
        self._whole = memoryview(mm)
        self.buf = self._whole if size == len(mm) else self._whole[:size]
        # One cffi view of the whole mapping, made here: a from_buffer per call would
        # cost more than the flushes it serves.
        self._base = ffi.from_buffer(mm)
        self._closed = False
        # How persists were done (status shows them): cache-line flushes and a fence, or msync.
        self.flushes = 0
        self.msyncs = 0

    @property
    def base(self) -> object:
        """The mapping as cffi sees it, for C code that places bytes into the pool."""
        return self._base

    @classmethod
    def open(cls, path: str, mode: str = "auto", readonly: bool = False, exclusive: bool = False,
             opener: Callable[[str, int], int] = os.open, length: int | None = None) -> Self:
        """Map the pool file, or device DAX. ``exclusive``: hold an advisory lock on it for as
        long as the mapping lives (mmap keeps a duplicate of the descriptor, and the lock with
        it), so that a mount and a target daemon never write the same pool as two primaries.
        ``opener(path, flags)`` opens it (a target opens pools inside its pool directory).
        ``length``: on a device DAX, the pool's size when its header does not say it yet."""
        if mode not in PMEM_MODES:
            raise ValueError(f"pmem mode must be one of {PMEM_MODES}, not {mode!r}")
        try:
            fd = opener(path, os.O_RDONLY if readonly else os.O_RDWR)
        except OSError as exc:
            raise PmemError(f"cannot open pool {path}: {exc.strerror}") from exc
        try:
            if exclusive:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    who = "; ".join(describe_process(pid) for pid in lock_holders(fd))
                    raise PmemError(f"pool {path} is in use: mounted, or open in a target daemon "
                                    f"as a replica ({who or 'holder not visible from here'}); "
                                    "stop that process first") from None
            st = os.fstat(fd)
            if stat.S_ISCHR(st.st_mode):
                mm, size = _map_device(fd, st, path, readonly, length)
                kind = "devdax"
            else:
                size = st.st_size
                if size == 0:
                    raise PmemError(f"pool {path} is empty: create it at its full size first")
                mm, kind = _map(fd, size, path, mode, readonly)
        finally:
            # The mapping does not need the descriptor (mmap keeps a duplicate of its own).
            os.close(fd)
        if kind == "force":
            log.warning(
                "pool %s: pmem mode 'force' treats an ordinary mapping as persistent memory; "
                "durability across power loss is only emulated",
                path,
            )
        return cls(path, size, mode, kind, mm, readonly)

    def _pairs(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        if self._closed:
            raise ValueError(f"pool mapping of {self.path} is closed")
        size = self.size
        flat: list[int] = []
        for off, length in ranges:
            if off < 0 or length < 0 or off + length > size:
                raise ValueError(f"range ({off}, {length}) is outside the pool of {size} bytes")
            flat += (off, length)
        return flat

    def _persist_pairs(self, pairs: list[int]) -> None:
        if self.is_pmem:
            # cffi turns the list into a temporary uint64_t array for the one call.
            lib.rpm_flush_ranges(self._base, pairs, len(pairs) >> 1)
            lib.rpm_drain()
            self.flushes += 1
        else:
            for start, end in _page_spans(pairs, self.size):
                self._mm.flush(start, end - start)
            self.msyncs += 1

    def persist(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Make the (offset, length) ranges durable; returns once they are."""
        pairs = self._pairs(ranges)
        if pairs:
            self._persist_pairs(pairs)

    def persist_ordered(self, first: Iterable[tuple[int, int]], then: Iterable[tuple[int, int]]) -> None:
        """Make ``first`` durable, then ``then``.

        Only the write-backs issued here are ordered: a store already made to a
        ``then`` range may reach the media early through cache eviction or kernel
        writeback, so a record that must not be seen before ``first`` has to be either
        stored after this returns or able to prove itself complete (a checksum).
        """
        # Both are checked before anything is flushed, so a bad range flushes nothing.
        a = self._pairs(first)
        b = self._pairs(then)
        if a:
            self._persist_pairs(a)
        if b:
            self._persist_pairs(b)

    def persist_then_store(
        self, first: Iterable[tuple[int, int]], offset: int, data: BytesLike,
        then: tuple[int, bytes] | None = None,
    ) -> None:
        """Make ``first`` durable, then store ``data`` at ``offset`` and make it durable, then
        the same for ``then`` (offset, bytes), when given.

        Each stored part cannot reach the media before what comes before it does, because it
        is stored only after that is fenced: the way to commit a log record (and then say
        that the point it ends has ended).
        """
        pairs = self._pairs(first)
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        stamp_off, stamp = then if then is not None else (0, b"")
        self._pairs(((offset, n), (stamp_off, len(stamp))))
        if self.readonly:
            raise PmemError(f"pool {self.path} is mapped read-only")
        if self.is_pmem:
            lib.rpm_persist_then_store(
                self._base, pairs, len(pairs) >> 1, offset, ffi.from_buffer(data), n,
                stamp_off, stamp, len(stamp),
            )
            self.flushes += 1
            return
        if pairs:
            self._persist_pairs(pairs)
        for at, part in ((offset, data), (stamp_off, stamp)):
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            if size:
                self._mm[at : at + size] = part
                self._persist_pairs([at, size])

    def populate(self, stop: threading.Event, chunk: int = 32 << 20) -> int:
        """Fault the whole mapping in for writing, chunk by chunk, until done or `stop` is set.

        Meant for a background thread: the C call drops the GIL. Returns bytes populated.
        """
        if self.readonly:
            return 0
        done = 0
        while done < self.size and not stop.is_set():
            n = min(chunk, self.size - done)
            if lib.rpm_populate(self._base + done, n) != 0:
                break  # a kernel without MADV_POPULATE_WRITE: faults stay lazy
            done += n
        return done

    def write_nt(self, offset: int, data: BytesLike) -> None:
        """Copy ``data`` to ``offset``; on pmem kinds it is durable on return."""
        if self.readonly:
            raise PmemError(f"pool {self.path} is mapped read-only")
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        self._pairs(((offset, n),))
        if self.is_pmem:
            lib.rpm_memcpy_nt(self._base + offset, ffi.from_buffer(data), n)
        else:
            self._mm[offset : offset + n] = data

    def close(self) -> None:
        if self._closed:
            return
        ffi.release(self._base)
        try:
            self.buf.release()
            self._whole.release()
            self._mm.close()
        except BufferError:
            # A caller still holds a view into the pool: keep the mapping whole and
            # usable rather than half closed.
            self._base = ffi.from_buffer(self._mm)
            self._whole = memoryview(self._mm)
            self.buf = self._whole if self.size == len(self._mm) else self._whole[: self.size]
            raise
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
