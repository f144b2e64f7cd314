"""File contents: read, write and truncate over the inodes' block maps.

The hot path of every write: a write into blocks the file has already is a copy into the
mapping and an append to the change tracker's list of dirty ranges (rpmemfs.fs.changes), and
nothing else. A write that needs blocks allocates them, zeroes what it will not cover in them
and queues the MAP entries, all after checking the log has room, so that an error leaves the
file as it was. Block-range operations (fallocate, SEEK_DATA/SEEK_HOLE, copy_file_range) are
rpmemfs.fs.extents, on top of this.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable

from rpmemfs.fs import records as R
from rpmemfs.fs.alloc import OutOfSpace
from rpmemfs.fs.changes import ChangeTracker
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.replay import Index
from rpmemfs.pool.layout import BLOCK, BLOCK_SHIFT

MAX_FILE_SIZE = 1 << 50
# Copies this large go to the pool with non-temporal stores (when it is pmem): they bypass
# the cache, so the durability point has nothing to flush for them.
NT_MIN = 64 << 10


class NeedSync(Exception):
    """Space would be freed by a durability point; persist, then retry the call."""


class Data:
    """The contents of the files of one mounted pool.

    ``unwritten``: inode -> file blocks preallocated (rpmemfs.fs.extents) and not written
    since; writes take blocks out of it. ``copy_nt``, given on pmem, copies with
    non-temporal stores.
    """

    def __init__(self, buf: memoryview, data_off: int, index: Index, changes: ChangeTracker,
                 copy_nt: Callable[[int, memoryview], None] | None = None) -> None:
        self.buf = buf
        self.data_off = data_off
        self.inodes = index.inodes
        self.node = index.node
        self.changes = changes
        self.alloc = changes.alloc
        # The change tracker's lists themselves (never rebound): a write appends to them.
        self.dirty = changes.data
        self.nt = changes.stored
        self.copy_nt = copy_nt
        self.unwritten: dict[int, set[int]] = {}

    def read(self, ino: int, off: int, size: int) -> bytes:
        node = self.inodes.get(ino)  # Index.node, inline: this is the read path
        if node is None:
            raise FsError(errno.ENOENT)
        end = min(off + size, node.size)
        if off >= end:
            return b""
        blocks = node.blocks
        buf = self.buf
        base = self.data_off
        fb = off >> BLOCK_SHIFT
        last = (end - 1) >> BLOCK_SHIFT
        if fb == last:
            pb = blocks.get(fb)
            if pb is None:
                return bytes(end - off)
            a = base + (pb << BLOCK_SHIFT) + (off & (BLOCK - 1))
            return bytes(buf[a: a + end - off])
        parts: list[bytes] = []
        pos = off
        while pos < end:
            fb = pos >> BLOCK_SHIFT
            pb = blocks.get(fb)
            # extend the run while file and pool blocks stay contiguous (or both holes)
            nfb = fb + 1
            if pb is None:
                while nfb <= last and nfb not in blocks:
                    nfb += 1
            else:
                while nfb <= last and blocks.get(nfb) == pb + (nfb - fb):
                    nfb += 1
            stop = min(end, nfb << BLOCK_SHIFT)
            if pb is None:
                parts.append(bytes(stop - pos))
            else:
                a = base + (pb << BLOCK_SHIFT) + (pos & (BLOCK - 1))
                parts.append(buf[a: a + stop - pos])  # type: ignore[arg-type]
            pos = stop
        return b"".join(parts)

    def write(self, ino: int, off: int, data: bytes | memoryview) -> int:
        n = len(data)
        if n == 0:
            return 0
        node = self.inodes.get(ino)  # Index.node, inline: this is the write path
        if node is None:
            raise FsError(errno.ENOENT)
        end = off + n
        if end > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG)
        blocks = node.blocks
        buf = self.buf
        base = self.data_off
        fb = off >> BLOCK_SHIFT
        last = (end - 1) >> BLOCK_SHIFT
        if fb == last and fb in blocks and off <= node.size:
            # the common overwrite-in-place case, kept short
            a = base + (blocks[fb] << BLOCK_SHIFT) + (off & (BLOCK - 1))
            buf[a: a + n] = data
            self.dirty.append((a, n))
        else:
            self._write_slow(node, off, data)
        if end > node.size:
            node.size = end
        now = time.time_ns()
        if now <= node.ctime:  # Inode.tick, inline: this is the write path
            now = node.ctime + 1
        node.mtime = node.ctime = now
        if node.dirty is None:
            self.changes.touch(node)
        if self.unwritten:
            self._written(ino, off, end)
        return n

    def _written(self, ino: int, off: int, end: int) -> None:
        """Bytes [off, end) of the file were written: their blocks are data to SEEK_DATA."""
        uw = self.unwritten.get(ino)
        if uw:
            uw.difference_update(range(off >> BLOCK_SHIFT, ((end - 1) >> BLOCK_SHIFT) + 1))
            if not uw:
                del self.unwritten[ino]

    def alloc_blocks(self, n: int) -> list[tuple[int, int]]:
        """``n`` free blocks as (first, count) runs; NeedSync when enough would be free once
        the blocks freed since the last durability point are reusable, else ENOSPC."""
        try:
            return self.alloc.alloc(n)
        except OutOfSpace as e:
            if e.pending:
                raise NeedSync from None
            raise FsError(errno.ENOSPC) from None

    def _write_slow(self, node: Inode, off: int, data: bytes | memoryview) -> None:
        n = len(data)
        end = off + n
        blocks = node.blocks
        fb0 = off >> BLOCK_SHIFT
        last = (end - 1) >> BLOCK_SHIFT
        missing = [b for b in range(fb0, last + 1) if b not in blocks]
        if missing:
            runs = self.alloc_blocks(len(missing))
            gaps = sum(1 for i in range(1, len(missing)) if missing[i] != missing[i - 1] + 1)
            try:
                self.changes.room((len(runs) + gaps) * R.MAP.size + R.INODE.size)
            except FsError:
                self.alloc.release(runs)
                raise
        if off > node.size:
            self.zero_tail(node, node.size, off)
        if missing:
            self._map_new(node, missing, runs, off, end)
        mv = memoryview(data)
        buf = self.buf
        base = self.data_off
        pos = off
        dirty = self.dirty
        nt = self.copy_nt
        while pos < end:
            fb = pos >> BLOCK_SHIFT
            pb = blocks[fb]
            nfb = fb + 1
            while nfb <= last and blocks.get(nfb) == pb + (nfb - fb):
                nfb += 1
            stop = min(end, nfb << BLOCK_SHIFT)
            a = base + (pb << BLOCK_SHIFT) + (pos & (BLOCK - 1))
            if nt is not None and stop - pos >= NT_MIN:
                nt(a, mv[pos - off: stop - off])
                self.nt.append((a, stop - pos))
            else:
                buf[a: a + stop - pos] = mv[pos - off: stop - off]
                dirty.append((a, stop - pos))
            pos = stop

    def _map_new(self, node: Inode, missing: list[int], runs: list[tuple[int, int]],
                 off: int, end: int) -> None:
        """Map freshly allocated blocks and zero what the write will not cover in them."""
        blocks = node.blocks
        map_change = self.changes.map_change
        i = 0
        entry_start: tuple[int, int] | None = None
        count = 0
        for pstart, pcount in runs:
            for k in range(pcount):
                fb = missing[i]
                pb = pstart + k
                blocks[fb] = pb
                i += 1
                if entry_start and entry_start[0] + count == fb and entry_start[1] + count == pb:
                    count += 1
                else:
                    if entry_start:
                        map_change(node, R.map_run(node.ino, entry_start[0], entry_start[1], count))
                    entry_start, count = (fb, pb), 1
        if entry_start:
            map_change(node, R.map_run(node.ino, entry_start[0], entry_start[1], count))
        base = self.data_off
        head = missing[0]
        if head == off >> BLOCK_SHIFT and off & (BLOCK - 1):
            a = base + (blocks[head] << BLOCK_SHIFT)
            self.buf[a: a + (off & (BLOCK - 1))] = bytes(off & (BLOCK - 1))
            self.dirty.append((a, off & (BLOCK - 1)))
        tail = missing[-1]
        if tail == (end - 1) >> BLOCK_SHIFT and end & (BLOCK - 1):
            a = base + (blocks[tail] << BLOCK_SHIFT) + (end & (BLOCK - 1))
            k = BLOCK - (end & (BLOCK - 1))
            self.buf[a: a + k] = bytes(k)
            self.dirty.append((a, k))
        # Blocks inside [off, end) that the write skips cannot exist: it is contiguous.

    def truncate(self, node: Inode, size: int) -> None:
        if size > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG)
        if size < 0:
            raise FsError(errno.EINVAL)
        self.changes.room(R.INODE.size + R.TRUNC.size)
        old = node.size
        if size > old:
            self.zero_tail(node, old, size)
        else:
            first = (size + BLOCK - 1) >> BLOCK_SHIFT
            gone = [b for b in node.blocks if b >= first]
            if gone:
                runs: list[tuple[int, int]] = []
                for b in sorted(node.blocks.pop(b) for b in gone):
                    if runs and runs[-1][0] + runs[-1][1] == b:
                        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                    else:
                        runs.append((b, 1))
                self.alloc.defer(runs)
                self.changes.map_change(node, R.trunc(node.ino, first))
        node.size = size
        node.tick(mtime=True)
        self.changes.touch(node)

    def zero_tail(self, node: Inode, old_size: int, upto: int) -> None:
        """Zero the bytes past the old end of file in its last block, before exposing them."""
        if old_size & (BLOCK - 1) == 0:
            return
        pb = node.blocks.get(old_size >> BLOCK_SHIFT)
        if pb is None:
            return
        stop = min(upto, (old_size | (BLOCK - 1)) + 1)
        a = self.data_off + (pb << BLOCK_SHIFT) + (old_size & (BLOCK - 1))
        n = stop - old_size
        self.buf[a: a + n] = bytes(n)
        self.dirty.append((a, n))
