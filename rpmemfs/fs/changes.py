"""What changed since the last durability point: the one record of it, and its handover.

Every operation changes the mapping at once and tells the ChangeTracker what it changed; the
tracker alone decides what goes into the log and when. An inode whose attributes changed is
``touch``ed, a block-map or xattr entry for it is queued with ``map_change``; both are
batched until a namespace change ``commit``s them with its own entries in one log record, or
a durability point takes everything. Data written through the cache is listed in ``data``,
data written with non-temporal stores in ``stored``: the data path appends to those lists
itself (they are never rebound: a write costs an append, not a call).

A durability point (rpmemfs.durability) calls ``take_changes``: the data ranges, then the log
record that points at them, so that it can make the data durable first: no durable record
ever points at data that is not durable, and a crash never shows a file bytes that were never
written to it. Once the point is durable wherever the policy requires, ``mark_durable`` lets
the log space and the blocks it freed be reused.

The rules every module that changes the filesystem keeps with it:

- ``room`` (or ``new_inode_room``) before changing anything, so that a full log never
  leaves a change in memory that cannot be logged;
- a new block's bytes are written before the entry that maps it is queued;
- a freed block goes to ``alloc.defer``: reusable only once the record that frees it is
  durable (a crash could otherwise resurrect the old owner pointing at new data).

Nothing here persists a change itself, except outside a point (``persist``: a checkpoint, a
repaired header), and nothing here knows of replicas.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable

from rpmemfs.changeset import Changes, Persister
from rpmemfs.fs import records as R
from rpmemfs.fs.alloc import Allocator
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.log import Log, LogFull
from rpmemfs.pool import position
from rpmemfs.ranges import Ranges, merge_ranges

log = logging.getLogger("rpmemfs.fs")

# A snapshot bigger than this share of an area leaves too little room to log after a
# checkpoint; new inodes are refused (ENOSPC) past it.
SNAPSHOT_LIMIT = 0.6
# A log tail shorter than this is replayed in a few milliseconds: not worth a checkpoint.
CHECKPOINT_MIN_TAIL = 64 << 10


class ChangeTracker:
    """The changes not yet durable, the log they go to and the blocks they free.

    ``snapshot`` gives the whole index as checkpoint record payloads (rpmemfs.fs.snapshot):
    a checkpoint, which a full log forces at any ``room`` check, writes it.
    """

    def __init__(self, log: Log, alloc: Allocator, persister: Persister,
                 snapshot: Callable[[], Iterable[bytes]]) -> None:
        self.log = log
        self.alloc = alloc
        self.persister = persister
        self.snapshot = snapshot
        self.dirty_inodes: dict[int, Inode] = {}
        self.data: Ranges = []  # written through the cache, appended to by the data path
        # Written with non-temporal stores (on pmem): durable locally already, listed for
        # replicas, which still have to get them.
        self.stored: Ranges = []
        # Persisted outside a durability point (checkpoints), in order, for the same.
        self.persisted: Ranges = []
        self.pending_bytes = 0  # log bytes the dirty inodes will need
        self.meta_full = False

    # ---------------------------------------------------------------- recording

    def touch(self, node: Inode) -> None:
        """The inode's attributes changed: its INODE entry goes into the next record."""
        if node.dirty is None:
            node.dirty = []
            self.dirty_inodes[node.ino] = node
            self.pending_bytes += R.INODE.size

    def map_change(self, node: Inode, entry: bytes) -> None:
        """An entry about the inode (a block map or xattr change) for the next record."""
        self.touch(node)
        assert node.dirty is not None
        node.dirty.append(entry)
        self.pending_bytes += len(entry)

    def discard(self, node: Inode) -> None:
        """The inode is freed: nothing it had queued is logged."""
        if node.dirty is not None:
            self.dirty_inodes.pop(node.ino, None)
            node.dirty = None

    def room(self, extra: int) -> None:
        """Make sure the log can take the pending records plus `extra` bytes, or ENOSPC.

        Checked before an operation changes anything, so a full log never leaves a change
        in memory that cannot be logged.
        """
        need = self.pending_bytes + extra + 4 * R.REC_BYTES
        if need <= self.log.room():
            return
        self.checkpoint()
        if need > self.log.room():
            raise FsError(errno.ENOSPC, "metadata log full")

    def new_inode_room(self, extra: int) -> None:
        """``room``, and ENOSPC while the snapshot is too big to take more inodes."""
        if self.meta_full:
            self.room(0)  # a checkpoint may have shrunk the snapshot
            if self.meta_full:
                raise FsError(errno.ENOSPC, "metadata area full")
        self.room(extra)

    def commit(self, ns_entries: list[bytes], freeing: list[int] | None = None) -> None:
        """Write one record: every dirty inode's state, then the namespace entries. The
        inodes in ``freeing`` are not described: the entries free them."""
        parts: list[bytes] = []
        for ino, node in self.dirty_inodes.items():
            if freeing and ino in freeing:
                node.dirty = None
                continue
            parts.append(node.attr_entry())
            if node.dirty:
                parts.extend(node.dirty)
            node.dirty = None
        self.dirty_inodes.clear()
        self.pending_bytes = 0
        parts.extend(ns_entries)
        if not parts:
            return
        try:
            seq = self.log.append(b"".join(parts))
        except LogFull:
            # The snapshot holds the state this record would have described.
            self.checkpoint()
            return
        self.alloc.logged(seq)

    def persist(self, ranges: Ranges) -> None:
        """Persist pool ranges written outside a durability point; the next point carries
        them to replicas, in order."""
        self.persister.persist(ranges)
        self.persisted.extend(ranges)

    # ---------------------------------------------------------------- durability points

    def has_changes(self) -> bool:
        """Whether take_changes() would hand over anything (a periodic commit asks first)."""
        return bool(self.dirty_inodes or self.data or self.stored or self.persisted
                    or self.log.stage)

    def take_changes(self) -> Changes:
        """Hand every change so far to a durability point (rpmemfs.durability), which makes
        them durable and then calls mark_durable()."""
        data = self.take_dirty()
        seq = self.log.next_seq - 1
        tail = self.log.tail
        staged = self.log.take_staged()
        persisted, self.persisted = self.persisted, []
        stored = merge_ranges(self.stored)
        self.stored.clear()
        stamp = None if staged is None else position.stamp(seq)
        return Changes(persisted, stored, data, staged, seq, tail, stamp)

    def take_dirty(self) -> Ranges:
        """Log every dirty inode and hand over the changed data ranges, merged."""
        self.commit([])
        data = merge_ranges(self.data)
        self.data.clear()
        return data

    def mark_durable(self, seq: int, tail: int) -> None:
        """Everything up to log record ``seq`` is durable wherever the policy requires: its log
        space may be reused, and blocks freed by it become reusable."""
        self.log.mark_durable(tail, seq)
        self.alloc.durable(seq)

    # ---------------------------------------------------------------- checkpoints

    def checkpoint(self) -> None:
        """Snapshot the whole index into the other log area and switch to it."""
        data = self.take_dirty()
        if data:
            self.persist(data)
        try:
            self.log.checkpoint(self.snapshot(), self.persist)
        except LogFull:
            self.meta_full = True
            log.warning("metadata snapshot does not fit a log area; refusing new inodes")
            return
        # Nothing in the snapshot refers to blocks freed before it, logged or not; they
        # become reusable with the next durability point, which carries the snapshot to any
        # replica.
        self.alloc.logged(self.log.durable_seq)
        self.meta_full = self.log.snap_bytes > SNAPSHOT_LIMIT * self.log.capacity
        log.info("checkpoint %d: %d bytes of snapshot", self.log.gen, self.log.snap_bytes)

    def wants_checkpoint(self) -> bool:
        """Whether the log's tail (what every mount replays after the snapshot) has grown
        long enough to be worth a checkpoint now: over half the snapshot, so that the
        checkpoint costs no more than about two replays of the tail it saves (at least
        CHECKPOINT_MIN_TAIL, and always past a quarter of the log). Asked at unmount, and at
        mount after a crash left a long tail (else every later crash replays it again)."""
        tail = self.log.tail_bytes + len(self.log.stage) + self.pending_bytes
        return tail > min(self.log.capacity // 4, max(CHECKPOINT_MIN_TAIL, self.log.snap_bytes // 2))

    def checkpoint_if_long(self, when: str) -> bool:
        """A checkpoint if wants_checkpoint() says so; whether there was one."""
        if not self.wants_checkpoint():
            return False
        log.info("checkpoint %s: the log holds %d bytes after its snapshot", when,
                 self.log.tail_bytes)
        self.checkpoint()
        return True
