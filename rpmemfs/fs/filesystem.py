"""The filesystem on a mapped pool: namespace, file data, and what changed since the last
durability point.

Changes land in the mapping at once; the log records describing them are written lazily
(attributes and block maps of an inode are batched until a durability point or a namespace
change). A durability point (rpmemfs.durability) takes them with take_changes(): the data
ranges, then the log record that points at them, so that it can make the data durable first:
no durable record ever points at data that is not durable, and a crash never shows a file
bytes that were never written to it. This module never persists a change itself, except
outside a point (a checkpoint), and it knows nothing of replicas.

Why this module is long: every operation in it reads and changes the same state (the inode
index, the batch of log entries not yet written, the allocator's pending frees) under one set
of invariants (what is logged, what is dirty, when a block may be reused). Split in two, each
half would reach into the other's state; the parts that stand alone (records, log, allocator,
inodes, replay) are modules of their own already.
"""

from __future__ import annotations

import errno
import gc
import logging
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from rpmemfs.fs import acl as A
from rpmemfs.fs import bulk
from rpmemfs.fs import records as R
from rpmemfs.fs.alloc import Allocator, OutOfSpace
from rpmemfs.fs.creds import ROOT, Caller, suidgid_to_clear
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.log import Log, LogFull, LogScan, Ranges, scan
from rpmemfs.fs.replay import ROOT_INO, Index
from rpmemfs.pool import position
from rpmemfs.pool.header import read_header, write_header
from rpmemfs.pool.layout import BACKUP_OFF, BLOCK, BLOCK_SHIFT, HEADER_BYTES, Header, PoolFormatError

log = logging.getLogger("rpmemfs.fs")

NAME_MAX = 255
MAX_FILE_SIZE = 1 << 50
# A snapshot bigger than this share of an area leaves too little room to log after a
# checkpoint; new inodes are refused (ENOSPC) past it.
SNAPSHOT_LIMIT = 0.6
SNAPSHOT_RECORD = 64 << 10
# Copies this large go to the pool with non-temporal stores (when it is pmem): they bypass
# the cache, so the durability point has nothing to flush for them.
NT_MIN = 64 << 10
# A log tail shorter than this is replayed in a few milliseconds: not worth a checkpoint.
CHECKPOINT_MIN_TAIL = 64 << 10
INODE_COST = 160  # rough snapshot bytes per small file, for statfs' inode numbers
# At mount, blocks logged as preallocated are read to tell which are still zeros, up to
# this many (64 MiB); past it they all count as written.
PREALLOC_CHECK = 16384


class NeedSync(Exception):
    """Space would be freed by a durability point; persist, then retry the call."""


class Persister(Protocol):
    """Local persistence (PoolMapping satisfies it), for what the filesystem persists outside a
    durability point: a repaired header, a checkpoint."""

    def persist(self, ranges: Ranges) -> None: ...


@dataclass(slots=True)
class Changes:
    """What changed since the last durability point, handed over by take_changes()."""

    persisted: Ranges  # persisted here outside a point (checkpoints), in order
    stored: Ranges  # written with non-temporal stores: durable here already
    data: Ranges  # written through the cache: to flush before the log record is stored
    log: tuple[int, bytes] | None  # the staged log record (offset, bytes), to store last
    seq: int  # last log record covered
    tail: int  # log position after it
    # With a log record: the position stamp that says the point ended (offset, bytes), to
    # store once the record is persistent (rpmemfs.fs.log.scan reads it after a crash).
    stamp: tuple[int, bytes] | None = None


class Filesystem:
    def __init__(self, buf: memoryview, hdr: Header, found: LogScan, index: Index,
                 persister: Persister, copy_nt: Callable[[int, memoryview], None] | None = None) -> None:
        self.buf = buf
        self.hdr = hdr
        self.persister = persister
        self.log = Log(buf, hdr, found)
        self.inodes = index.inodes
        self.next_ino = index.next_ino
        self.open_files = 0  # the sum of every inode's opens, kept as they change
        self.data_off = hdr.data_off
        self.alloc = Allocator(hdr.data_blocks)
        self.alloc.mark_blocks(node.blocks for node in self.inodes.values() if node.blocks)
        self.dirty_inodes: dict[int, Inode] = {}
        self.dirty_data: Ranges = []
        # inode -> file blocks preallocated (rpmemfs.fs.extents) and not written since
        self.unwritten: dict[int, set[int]] = {}
        # Ranges written with non-temporal stores (``copy_nt``, given on pmem): durable
        # locally already, listed for replicas, which still have to get them.
        self.nt_data: Ranges = []
        self.copy_nt = copy_nt
        # Ranges persisted outside a durability point (checkpoints), in order, for the same.
        self.persisted: Ranges = []
        self.pending_bytes = 0  # log bytes the dirty inodes will need
        self.meta_full = False
        # POSIX ACLs kept in step with modes and inherited from default ACLs; off when the
        # mount has no xattrs (then nothing can set one, and the kernel checks modes only).
        self.posix_acl = True

    # ---------------------------------------------------------------- opening

    @classmethod
    def open(cls, buf: memoryview, persister: Persister, repair: bool = True,
             progress: Callable[[str], None] | None = None,
             copy_nt: Callable[[int, memoryview], None] | None = None) -> Filesystem:
        """Replay the pool's log. Orphans (files unlinked while open) are freed by a record
        that the first durability point makes durable, on the replicas too."""
        if len(buf) < HEADER_BYTES + BACKUP_OFF:
            raise PoolFormatError(f"pool file is truncated: {len(buf)} bytes is too small for a pool")
        hdr, problems = read_header(buf)
        if len(buf) < hdr.pool_size:
            raise PoolFormatError(
                f"pool file is truncated: header says {hdr.pool_size} bytes, file has {len(buf)}")
        if problems and repair:
            persister.persist(write_header(buf, hdr))
            log.warning("pool header repaired: %s", problems[0])
        t0 = time.perf_counter()
        # Replay makes a few objects per record and per inode, which the cyclic collector
        # would walk again and again while they are made (a third of the time of a mount of
        # 300,000 files), finding nothing to free.
        collecting = gc.isenabled()
        gc.disable()
        try:
            found = scan(buf, hdr)
            index = Index()
            try:
                entries = index.apply(r.payload for r in found.records)
            except ValueError as e:  # an entry this version does not know (a newer pool format)
                raise PoolFormatError(f"log replay failed: {e}") from None
            if index.problems:
                raise PoolFormatError("log replay found inconsistencies: " + "; ".join(index.problems[:5]))
            if ROOT_INO not in index.inodes:
                raise PoolFormatError("log replay produced no root directory")
            fs = cls(buf, hdr, found, index, persister, copy_nt)
        finally:
            if collecting:
                gc.enable()
        dt = time.perf_counter() - t0
        snap_end = found.area_header.snap_end_seq
        tail = sum(1 for r in found.records if r.seq > snap_end)
        log.info("replayed %d records (%d after the snapshot, %d entries, %d inodes) in %.3f s",
                 len(found.records), tail, entries, len(index.inodes), dt)
        if progress:
            progress(f"replayed {len(found.records)} records, {len(index.inodes)} inodes in {dt:.2f} s")
        if found.stale is not None and repair:
            fs._erase_stale(*found.stale)
        fs.replay_stats = (len(found.records), entries, dt)
        fs.replay_tail = (tail, fs.log.tail_bytes)
        fs._restore_unwritten(index.prealloc)
        orphans = index.orphans()
        if orphans:
            freed = [e for ino in orphans for e in fs._free_if_unused(fs.inodes[ino])]
            fs._commit(freed, freeing=orphans)
            log.info("reclaimed %d orphan inodes", len(orphans))
        return fs

    def _erase_stale(self, offset: int, length: int) -> None:
        """Zero the intact records a crash left past the log's tail (a point that never ended:
        fs/log.py scan) before anything is appended there: the records written next take the
        same numbers, and one of those left could otherwise pass for the next one written at
        its place. Replicas get the zeros with the next point."""
        self.buf[offset: offset + length] = bytes(length)
        self._persist([(offset, length)])
        log.warning("log: a crash tore the store of a point that never ended; dropped its "
                    "records (%d bytes at pool offset %d): none was acknowledged", length, offset)

    replay_stats: tuple[int, int, float] = (0, 0, 0.0)
    replay_tail: tuple[int, int] = (0, 0)  # records and bytes replayed after the snapshot

    # ---------------------------------------------------------------- helpers

    def node(self, ino: int) -> Inode:
        node = self.inodes.get(ino)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def _dir(self, ino: int) -> Inode:
        node = self.node(ino)
        if node.children is None:
            raise FsError(errno.ENOTDIR)
        return node

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    def _touch(self, node: Inode) -> None:
        if node.dirty is None:
            node.dirty = []
            self.dirty_inodes[node.ino] = node
            self.pending_bytes += R.INODE.size

    def _map_change(self, node: Inode, entry: bytes) -> None:
        self._touch(node)
        assert node.dirty is not None
        node.dirty.append(entry)
        self.pending_bytes += len(entry)

    def _room(self, extra: int) -> None:
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

    def _new_inode_room(self, extra: int) -> None:
        if self.meta_full:
            self._room(0)  # a checkpoint may have shrunk the snapshot
            if self.meta_full:
                raise FsError(errno.ENOSPC, "metadata area full")
        self._room(extra)

    def _commit(self, ns_entries: list[bytes], freeing: list[int] | None = None) -> None:
        """Write one record: every dirty inode's state, then the namespace entries."""
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

    def _free_if_unused(self, node: Inode) -> list[bytes]:
        """Entries that drop an inode nobody names or holds any more (else nothing)."""
        if node.nlink > 0 or node.lookups > 0 or node.opens > 0 or node.ino == ROOT_INO:
            return []
        self.alloc.defer([(pb, n) for _fb, pb, n in node.runs()])
        del self.inodes[node.ino]
        if node.dirty is not None:
            self.dirty_inodes.pop(node.ino, None)
            node.dirty = None
        return [R.free(node.ino)]

    # ---------------------------------------------------------------- durability

    def has_changes(self) -> bool:
        """Whether take_changes() would hand over anything (a periodic commit asks first)."""
        return bool(self.dirty_inodes or self.dirty_data or self.nt_data or self.persisted
                    or self.log.stage)

    def take_changes(self) -> Changes:
        """Hand every change so far to a durability point (rpmemfs.durability), which makes
        them durable and then calls mark_durable()."""
        data = self._take_dirty()
        seq = self.log.next_seq - 1
        tail = self.log.tail
        staged = self.log.take_staged()
        persisted, self.persisted = self.persisted, []
        stored = _coalesce(self.nt_data)
        self.nt_data = []
        stamp = None if staged is None else position.stamp(seq)
        return Changes(persisted, stored, data, staged, seq, tail, stamp)

    def _take_dirty(self) -> Ranges:
        """Log every dirty inode and hand over the changed data ranges, coalesced."""
        self._commit([])
        data = _coalesce(self.dirty_data)
        self.dirty_data = []
        return data

    def mark_durable(self, seq: int, tail: int) -> None:
        """Everything up to log record ``seq`` is durable wherever the policy requires: its log
        space may be reused, and blocks freed by it become reusable."""
        self.log.mark_durable(tail, seq)
        self.alloc.durable(seq)

    def _persist(self, ranges: Ranges) -> None:
        """Persist pool ranges written outside a durability point; the next point carries
        them to replicas, in order."""
        self.persister.persist(ranges)
        self.persisted.extend(ranges)

    def checkpoint(self) -> None:
        """Snapshot the whole index into the other log area and switch to it."""
        data = self._take_dirty()
        if data:
            self._persist(data)
        try:
            self.log.checkpoint(self._snapshot_payloads(), self._persist)
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

    def _snapshot_payloads(self) -> Iterator[bytes]:
        """The whole index as record payloads of about SNAPSHOT_RECORD bytes each: first
        the files of one block and nothing else as INODE+MAP pairs, then every other inode
        with its entries, then the LINK entries grouped by length (bulk.py: replay reads
        records of one kind of entry in bulk). Every inode's entries come after its INODE
        entry and every LINK after all inodes, which is all replay needs."""
        inodes, unwritten = self.inodes, self.unwritten
        order = sorted(inodes)
        others: list[int] = []
        pairs: list[bytes] = []
        per_record = SNAPSHOT_RECORD // bulk.PAIR.size
        for ino in order:
            node = inodes[ino]
            if len(node.blocks) != 1 or node.target or node.xattrs or ino in unwritten:
                others.append(ino)
                continue
            for fb, pb in node.blocks.items():
                pairs.append(bulk.pack_pair(node, fb, pb))
            if len(pairs) >= per_record:
                yield b"".join(pairs)
                pairs = []
        if pairs:
            yield b"".join(pairs)
        parts: list[bytes] = [R.next_ino(self.next_ino)]
        size = 0
        for ino in others:
            for e in inodes[ino].snapshot_entries() + self._prealloc_entries(ino):
                parts.append(e)
                size += len(e)
            if size >= SNAPSHOT_RECORD:
                yield b"".join(parts)
                parts, size = [], 0
        if parts:
            yield b"".join(parts)
        # LINK entries by their names' padded length: each as its fixed part and its name
        links: dict[int, list[bytes]] = {}
        link_pack, t_link = R.LINK.pack, R.T_LINK
        for ino in order:
            children = inodes[ino].children
            if children:
                for name, child in children.items():
                    k = len(name)
                    padded = (k + 7) & ~7
                    group = links.get(padded)
                    if group is None:
                        group = links[padded] = []
                    group.append(link_pack(t_link, k, ino, child))
                    group.append(name + bytes(padded - k) if padded != k else name)
        for padded in sorted(links):
            group = links[padded]
            step = 2 * max(1, SNAPSHOT_RECORD // (R.LINK.size + padded))
            for i in range(0, len(group), step):
                yield b"".join(group[i: i + step])

    # ---------------------------------------------------------------- namespace

    def lookup(self, parent: int, name: bytes) -> Inode:
        pnode = self._dir(parent)
        if name == b".":
            return pnode
        if name == b"..":
            return self.node(pnode.parent or ROOT_INO)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        assert pnode.children is not None
        ino = pnode.children.get(name)
        if ino is None:
            raise FsError(errno.ENOENT)
        return self.inodes[ino]

    def _make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
              target: bytes = b"", umask: int = 0, caller: Caller | None = None) -> Inode:
        """A new inode named ``name`` in ``parent``, owned as Linux's inode_init_owner and
        posix_acl_create make it on ext4: in a setgid directory it takes the directory's
        group (and a directory the setgid bit too); under a default ACL it gets an access
        ACL and a mode from it and the requested mode, and the umask is not applied; without
        one the umask is (FUSE_DONT_MASK: the kernel leaves it to us)."""
        self._check_name(name)
        pnode = self._dir(parent)
        assert pnode.children is not None
        if name in pnode.children:
            raise FsError(errno.EEXIST)
        is_dir = stat.S_ISDIR(mode)
        if pnode.mode & stat.S_ISGID:
            if is_dir:
                mode |= stat.S_ISGID
            elif (mode & (stat.S_ISGID | stat.S_IXGRP) == stat.S_ISGID | stat.S_IXGRP
                  and not (caller or ROOT).in_group_or_capable(pnode.gid)):
                mode &= ~stat.S_ISGID  # mode_strip_sgid: not a member of the group it gets
            gid = pnode.gid
        xattrs: dict[bytes, bytes] = {}
        if not stat.S_ISLNK(mode):
            default = self._default_acl(pnode)
            if default is None:
                mode &= ~(umask & 0o777)
            else:
                access, mode = A.create(default, mode)
                if access is not None:
                    xattrs[A.ACCESS] = A.encode(access)
                if is_dir:
                    xattrs[A.DEFAULT] = pnode.xattrs[A.DEFAULT]
        xbytes = sum(R.XSET.size + len(k) + len(v) + 8 for k, v in xattrs.items())
        self._new_inode_room(R.INODE.size * 2 + R.LINK.size + len(name) + len(target) + 16 + xbytes)
        now = time.time_ns()
        ino = self.next_ino
        self.next_ino += 1
        node = Inode(ino, mode, uid, gid, 2 if is_dir else 1, rdev, len(target), now, now, now)
        self.inodes[ino] = node
        entries: list[bytes] = []
        if target:
            node.target = target
            entries.append(R.symlink(ino, target))
        if is_dir:
            node.parent = parent
            pnode.nlink += 1
        pnode.children[name] = ino
        pnode.tick(mtime=True)
        self._touch(node)
        self._touch(pnode)
        for k, v in xattrs.items():
            node.xattrs[k] = v
            self._map_change(node, R.xset(ino, k, v))
        entries.append(R.link(parent, name, ino))
        self._commit(entries)
        return node

    def _default_acl(self, pnode: Inode) -> A.Acl | None:
        """The directory's default ACL, when ACLs are on and it has a valid one."""
        value = pnode.xattrs.get(A.DEFAULT) if self.posix_acl else None
        if value is None:
            return None
        try:
            return A.parse(value) or None
        except FsError:
            log.warning("inode %d: its default ACL is malformed; new entries ignore it", pnode.ino)
            return None

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
               rdev: int = 0, umask: int = 0, caller: Caller | None = None) -> Inode:
        return self._make(parent, name, mode, uid, gid, rdev, umask=umask, caller=caller)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int, umask: int = 0,
              caller: Caller | None = None) -> Inode:
        return self._make(parent, name, (mode & 0o7777) | stat.S_IFDIR, uid, gid, umask=umask,
                          caller=caller)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self._make(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        self._check_name(name)
        node = self.node(ino)
        if node.is_dir:
            raise FsError(errno.EPERM)
        pnode = self._dir(parent)
        assert pnode.children is not None
        if name in pnode.children:
            raise FsError(errno.EEXIST)
        self._room(R.INODE.size * 2 + R.LINK.size + len(name) + 8)
        node.nlink += 1
        node.tick()
        pnode.children[name] = ino
        pnode.tick(mtime=True)
        self._touch(node)
        self._touch(pnode)
        self._commit([R.link(parent, name, ino)])
        return node

    def unlink(self, parent: int, name: bytes) -> None:
        node = self.lookup(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        self._remove(parent, name, node)

    def rmdir(self, parent: int, name: bytes) -> None:
        if name == b".":
            raise FsError(errno.EINVAL)
        node = self.lookup(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        if node.ino == ROOT_INO:
            raise FsError(errno.EBUSY)
        self._remove(parent, name, node)

    def _remove(self, parent: int, name: bytes, node: Inode) -> None:
        self._room(R.INODE.size * 2 + R.UNLINK.size + len(name) + R.FREE.size + 8)
        pnode = self.inodes[parent]
        assert pnode.children is not None
        del pnode.children[name]
        if node.is_dir:
            node.nlink = 0
            pnode.nlink -= 1
        else:
            node.nlink -= 1
        node.tick()
        pnode.tick(mtime=True)
        self._touch(pnode)
        self._touch(node)
        entries = [R.unlink(parent, name)]
        freed = self._free_if_unused(node)
        entries.extend(freed)
        self._commit(entries, freeing=[node.ino] if freed else None)

    def _is_ancestor(self, ino: int, of: int) -> bool:
        """Is directory ino the same as, or an ancestor of, directory `of`?"""
        cur = of
        while True:
            if cur == ino:
                return True
            if cur == ROOT_INO or cur == 0:
                return False
            cur = self.inodes[cur].parent

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        noreplace, exchange = flags & 1, flags & 2  # RENAME_NOREPLACE, RENAME_EXCHANGE
        if noreplace and exchange:
            raise FsError(errno.EINVAL)
        self._check_name(new_name)
        src = self.lookup(old_parent, old_name)
        op = self._dir(old_parent)
        np_ = self._dir(new_parent)
        assert op.children is not None and np_.children is not None
        dst_ino = np_.children.get(new_name)
        dst = self.inodes[dst_ino] if dst_ino is not None else None
        if src.is_dir and self._is_ancestor(src.ino, new_parent):
            raise FsError(errno.EINVAL)
        if exchange:
            if dst is None:
                raise FsError(errno.ENOENT)
            if dst.is_dir and self._is_ancestor(dst.ino, old_parent):
                raise FsError(errno.EINVAL)
        elif dst is not None:
            if noreplace:
                raise FsError(errno.EEXIST)
            if dst.ino == src.ino:
                return
            if src.is_dir and not dst.is_dir:
                raise FsError(errno.ENOTDIR)
            if dst.is_dir and not src.is_dir:
                raise FsError(errno.EISDIR)
            if dst.is_dir and dst.children:
                raise FsError(errno.ENOTEMPTY)
        self._room(R.INODE.size * 4 + 2 * (R.LINK.size + R.UNLINK.size) + len(old_name)
                   + len(new_name) + R.FREE.size + 32)
        entries: list[bytes] = []
        freeing: list[int] = []
        if exchange:
            assert dst is not None
            op.children[old_name], np_.children[new_name] = dst.ino, src.ino
            entries += [R.link(old_parent, old_name, dst.ino), R.link(new_parent, new_name, src.ino)]
            if old_parent != new_parent:
                for moved, to, frm in ((src, np_, op), (dst, op, np_)):
                    if moved.is_dir:
                        moved.parent = to.ino
                        to.nlink += 1
                        frm.nlink -= 1
            dst.tick()
            self._touch(dst)
        else:
            if dst is not None:
                if dst.is_dir:
                    dst.nlink = 0
                    np_.nlink -= 1
                else:
                    dst.nlink -= 1
                dst.tick()
                self._touch(dst)
                freed = self._free_if_unused(dst)
                if freed:
                    freeing.append(dst.ino)
                entries += freed
            del op.children[old_name]
            np_.children[new_name] = src.ino
            entries += [R.unlink(old_parent, old_name), R.link(new_parent, new_name, src.ino)]
            if src.is_dir and old_parent != new_parent:
                src.parent = new_parent
                np_.nlink += 1
                op.nlink -= 1
        src.tick()
        op.tick(mtime=True)
        if np_ is not op:
            np_.tick(mtime=True)
        self._touch(src)
        self._touch(op)
        self._touch(np_)
        self._commit(entries, freeing=freeing or None)

    def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        node = self._dir(ino)
        assert node.children is not None
        return list(node.children.items())

    # ---------------------------------------------------------------- attributes

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime: int | None = None,
                mtime: int | None = None, atime_now: bool = False, mtime_now: bool = False,
                kill_suidgid: Caller | None = None) -> Inode:
        """Change attributes. A time given is stored as given (utimensat with a value: it may
        go back, as on ext4); ``*_now`` (UTIME_NOW, touch) takes this inode's next tick
        instead of the kernel's time, so that it never goes before the last change. A new
        mode rewrites the access ACL's owner, group (or mask) and other entries to match.
        ``kill_suidgid``: the kernel asks that setuid/setgid be cleared as this caller's chown
        or truncate clears them (see kill_suidgid); a mode given along still wins."""
        node = self.node(ino)
        if kill_suidgid is not None:
            self.kill_suidgid(node, kill_suidgid, new_gid=gid)
        acl_value = node.xattrs.get(A.ACCESS) if self.posix_acl and mode is not None else None
        self._room(R.INODE.size + R.TRUNC.size
                   + (R.XSET.size + len(A.ACCESS) + len(acl_value) + 8 if acl_value else 0))
        if size is not None and size != node.size:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_reg:
                raise FsError(errno.EINVAL)
            self.truncate(node, size)
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
            if acl_value is not None:
                acl = A.chmod(A.parse(acl_value), node.mode)
                value = A.encode(acl)
                node.xattrs[A.ACCESS] = value
                self._map_change(node, R.xset(ino, A.ACCESS, value))
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        now = node.tick()
        if atime_now:
            node.atime = now
        elif atime is not None:
            node.atime = atime
        if mtime_now:
            node.mtime = now
        elif mtime is not None:
            node.mtime = mtime
        self._touch(node)
        return node

    def kill_suidgid(self, node: Inode, caller: Caller, new_gid: int | None = None) -> None:
        """Clear setuid and setgid as the kernel would for a write or truncate by ``caller``
        that it already found lacks CAP_FSETID, or for a chown (to ``new_gid``, if the group
        changes) by anyone, root included: see suidgid_to_clear. The kernel asks for it
        (FUSE_HANDLE_KILLPRIV_V2) and leaves it to us; a chown asks for every non-directory,
        FIFOs, devices and sockets as well as regular files."""
        if node.is_dir:
            return
        kill = suidgid_to_clear(node.mode, node.gid, caller, new_gid)
        if kill:
            node.mode &= ~kill
            node.tick()
            self._touch(node)

    def open_truncate(self, ino: int, caller: Caller) -> Inode:
        """open(O_TRUNC): the kernel sends no setattr (atomic O_TRUNC), so what its truncate
        does is done here: size 0, new mtime, and setuid/setgid cleared as a write by the
        caller would clear them (should_remove_suid)."""
        node = self.node(ino)
        self._room(R.INODE.size + R.TRUNC.size)
        if node.is_reg and node.mode & (stat.S_ISUID | stat.S_ISGID) and not caller.capable_fsetid():
            node.mode &= ~suidgid_to_clear(node.mode, node.gid, caller)
        if node.size:
            self.truncate(node, 0)
        else:
            node.tick(mtime=True)
            self._touch(node)
        return node

    def truncate(self, node: Inode, size: int) -> None:
        if size > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG)
        if size < 0:
            raise FsError(errno.EINVAL)
        self._room(R.INODE.size + R.TRUNC.size)
        old = node.size
        if size > old:
            self._zero_tail(node, old, size)
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
                self._map_change(node, R.trunc(node.ino, first))
        node.size = size
        node.tick(mtime=True)
        self._touch(node)

    def _zero_tail(self, node: Inode, old_size: int, upto: int) -> None:
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
        self.dirty_data.append((a, n))

    # ---------------------------------------------------------------- xattrs

    def setxattr(self, ino: int, name: bytes, value: bytes, caller: Caller | None = None) -> None:
        node = self.node(ino)
        if len(name) > 255:
            raise FsError(errno.ERANGE)
        if len(value) > 65536:
            raise FsError(errno.E2BIG)
        if name in A.NAMES and self.posix_acl:
            self._set_acl(node, name, value, caller or ROOT)
            return
        self._new_inode_room(R.XSET.size + len(name) + len(value) + R.INODE.size + 8)
        node.xattrs[name] = value
        node.tick()
        self._map_change(node, R.xset(ino, name, value))

    def _set_acl(self, node: Inode, name: bytes, value: bytes, caller: Caller) -> None:
        """An ACL set as ext4 sets it (ext4_set_acl, posix_acl_update_mode): an access ACL
        gives the mode its permission bits, and is not kept when it says no more than they
        do; setgid is cleared unless the caller is in the file's group or has CAP_FSETID.
        The mode and the ACL go into one log record."""
        if not A.applies_to(node.mode):
            raise FsError(errno.EOPNOTSUPP)
        acl = A.parse(value)
        if name == A.DEFAULT and not node.is_dir:
            if acl:
                raise FsError(errno.EACCES)  # as set_posix_acl answers
            return
        self._new_inode_room(R.XSET.size + len(name) + len(value) + R.INODE.size + 8)
        keep: bytes | None = A.encode(acl) if acl else None
        if name == A.ACCESS and acl:
            equivalent, mode = A.equiv_mode(acl, node.mode)
            if not caller.in_group_or_capable(node.gid):
                mode &= ~stat.S_ISGID
            node.mode = mode
            if equivalent:
                keep = None
        if keep is not None:
            node.xattrs[name] = keep
            self._map_change(node, R.xset(node.ino, name, keep))
        elif name in node.xattrs:
            del node.xattrs[name]
            self._map_change(node, R.xdel(node.ino, name))
        node.tick()
        self._touch(node)

    def getxattr(self, ino: int, name: bytes) -> bytes | None:
        """The value, or None when the inode has no such attribute (ENODATA to the caller:
        the kernel asks for security.capability before every write, so no exception here)."""
        return self.node(ino).xattrs.get(name)

    def removexattr(self, ino: int, name: bytes) -> None:
        node = self.node(ino)
        if name not in node.xattrs:
            raise FsError(errno.ENODATA)
        self._room(R.XDEL.size + len(name) + R.INODE.size + 8)
        del node.xattrs[name]
        node.tick()
        self._map_change(node, R.xdel(ino, name))

    # ---------------------------------------------------------------- open files

    def opened(self, ino: int) -> Inode:
        node = self.node(ino)
        node.opens += 1
        self.open_files += 1
        return node

    def released(self, ino: int) -> None:
        node = self.inodes.get(ino)
        if node is None:
            return
        node.opens -= 1
        self.open_files -= 1
        self._drop_if_gone(node)

    def forget(self, ino: int, n: int) -> None:
        node = self.inodes.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - n)
        self._drop_if_gone(node)

    def _drop_if_gone(self, node: Inode) -> None:
        if node.nlink == 0 and node.lookups == 0 and node.opens == 0:
            try:
                self._room(R.FREE.size + 8)
            except FsError:
                return  # the orphan is reclaimed at the next mount instead
            freed = self._free_if_unused(node)
            if freed:
                self._commit(freed, freeing=[node.ino])

    # ---------------------------------------------------------------- data

    def read(self, ino: int, off: int, size: int) -> bytes:
        node = self.node(ino)
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
        node = self.node(ino)
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
            self.dirty_data.append((a, n))
        else:
            self._write_slow(node, off, data)
        if end > node.size:
            node.size = end
        now = time.time_ns()
        if now <= node.ctime:  # Inode.tick, inline: this is the write path
            now = node.ctime + 1
        node.mtime = node.ctime = now
        if node.dirty is None:
            self._touch(node)
        if self.unwritten:
            self._written(ino, off, end)
        return n

    def _prealloc_entries(self, ino: int) -> list[bytes]:
        """MAP entries restating the blocks of ``ino`` preallocated and not written since."""
        uw = self.unwritten.get(ino)
        if not uw:
            return []
        blocks = self.inodes[ino].blocks
        out: list[tuple[int, int, int]] = []
        for fb in sorted(b for b in uw if b in blocks):
            pb = blocks[fb]
            if out and out[-1][0] + out[-1][2] == fb and out[-1][1] + out[-1][2] == pb:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((fb, pb, 1))
        return [R.map_run(ino, fb, pb, n, R.MAP_PREALLOC) for fb, pb, n in out]

    def _restore_unwritten(self, prealloc: dict[int, set[int]]) -> None:
        """After replay: the blocks logged as preallocated that still read as zeros are
        unwritten again (holes to SEEK_DATA). Writes log no change of that state, so a block
        written since must be told by its bytes: a hole is never reported where data reads
        back. Past PREALLOC_CHECK blocks to read, none is taken (they are data: also safe)."""
        total = sum(len(fbs) for fbs in prealloc.values())
        if not total:
            return
        if total > PREALLOC_CHECK:
            log.info("%d preallocated blocks: reported as data until written or punched", total)
            return
        zero = bytes(BLOCK)
        for ino, fbs in prealloc.items():
            node = self.inodes.get(ino)
            if node is None:
                continue
            keep = set()
            for fb in fbs:
                pb = node.blocks.get(fb)
                if pb is not None:
                    a = self.data_off + (pb << BLOCK_SHIFT)
                    if self.buf[a: a + BLOCK] == zero:
                        keep.add(fb)
            if keep:
                self.unwritten[ino] = keep

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
                self._room((len(runs) + gaps) * R.MAP.size + R.INODE.size)
            except FsError:
                self.alloc.release(runs)
                raise
        if off > node.size:
            self._zero_tail(node, node.size, off)
        if missing:
            self._map_new(node, missing, runs, off, end)
        mv = memoryview(data)
        buf = self.buf
        base = self.data_off
        pos = off
        dirty = self.dirty_data
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
                self.nt_data.append((a, stop - pos))
            else:
                buf[a: a + stop - pos] = mv[pos - off: stop - off]
                dirty.append((a, stop - pos))
            pos = stop

    def _map_new(self, node: Inode, missing: list[int], runs: list[tuple[int, int]],
                 off: int, end: int) -> None:
        """Map freshly allocated blocks and zero what the write will not cover in them."""
        blocks = node.blocks
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
                        self._map_change(node, R.map_run(node.ino, entry_start[0], entry_start[1], count))
                    entry_start, count = (fb, pb), 1
        if entry_start:
            self._map_change(node, R.map_run(node.ino, entry_start[0], entry_start[1], count))
        base = self.data_off
        head = missing[0]
        if head == off >> BLOCK_SHIFT and off & (BLOCK - 1):
            a = base + (blocks[head] << BLOCK_SHIFT)
            self.buf[a: a + (off & (BLOCK - 1))] = bytes(off & (BLOCK - 1))
            self.dirty_data.append((a, off & (BLOCK - 1)))
        tail = missing[-1]
        if tail == (end - 1) >> BLOCK_SHIFT and end & (BLOCK - 1):
            a = base + (blocks[tail] << BLOCK_SHIFT) + (end & (BLOCK - 1))
            k = BLOCK - (end & (BLOCK - 1))
            self.buf[a: a + k] = bytes(k)
            self.dirty_data.append((a, k))
        # Blocks inside [off, end) that the write skips cannot exist: it is contiguous.

    # ---------------------------------------------------------------- numbers

    def statfs(self) -> dict[str, int]:
        cap = self.log.capacity * SNAPSHOT_LIMIT
        files = int(cap // INODE_COST)
        return {
            "bsize": BLOCK,
            "blocks": self.hdr.data_blocks,
            "bfree": self.alloc.free + self.alloc.pending_blocks,
            "files": max(files, len(self.inodes)),
            "ffree": max(0, files - len(self.inodes)),
            "namemax": NAME_MAX,
        }


def _coalesce(ranges: Ranges) -> Ranges:
    if len(ranges) <= 1:
        return list(ranges)
    ranges = sorted(ranges)
    out = [ranges[0]]
    for a, n in ranges[1:]:
        pa, pn = out[-1]
        if a <= pa + pn:
            if a + n > pa + pn:
                out[-1] = (pa, a + n - pa)
        else:
            out.append((a, n))
    return out
