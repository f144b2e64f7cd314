"""The filesystem on a mapped pool, as its callers see it: one object, ``Filesystem``.

The FUSE edge (rpmemfs.fuse) calls its operations, a durability point (rpmemfs.durability)
its handover (has_changes, take_changes, mark_durable), the mount daemon (rpmemfs.mountd)
its opening, checkpoints and numbers. Each call goes straight to the module that does the
work, all of them over one index of inodes (rpmemfs.fs.replay Index) and one change
tracker (rpmemfs.fs.changes ChangeTracker: what changed since the last durability point,
the log it goes to, the blocks it frees):

- namespace.py: names in directories, and inode lifetimes;
- attrs.py: setattr, xattrs and POSIX ACLs;
- data.py: read, write, truncate; extents.py: fallocate, SEEK_DATA/SEEK_HOLE,
  copy_file_range (``extents``);
- recovery.py: from the pool's bytes to a mounted filesystem (``open``);
- snapshot.py: the index as a checkpoint's records.

Changes land in the mapping at once; the log records describing them are written lazily
(attributes and block maps of an inode are batched until a durability point or a namespace
change). This layer never persists a change itself, except outside a point (a checkpoint),
and it knows nothing of replicas.
"""

from __future__ import annotations

from collections.abc import Callable

from rpmemfs.changeset import Changes, Persister
from rpmemfs.fs import recovery, snapshot
from rpmemfs.fs.attrs import Attributes
from rpmemfs.fs.changes import CHECKPOINT_MIN_TAIL, SNAPSHOT_LIMIT, ChangeTracker
from rpmemfs.fs.creds import Caller
from rpmemfs.fs.data import MAX_FILE_SIZE, Data, NeedSync
from rpmemfs.fs.errors import FsError
from rpmemfs.fs.extents import Extents
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.namespace import NAME_MAX, Namespace
from rpmemfs.pool.layout import BLOCK

__all__ = ["CHECKPOINT_MIN_TAIL", "MAX_FILE_SIZE", "NAME_MAX", "Changes", "Filesystem", "FsError",
           "NeedSync", "Persister"]

INODE_COST = 160  # rough snapshot bytes per small file, for statfs' inode numbers


class Filesystem:
    """A thin front: each method is one call into the module that does the work (the modules
    are its attributes: ``namespace``, ``attrs``, ``data``, ``extents``, ``changes``)."""

    def __init__(self, buf: memoryview, replayed: recovery.Replayed, persister: Persister,
                 copy_nt: Callable[[int, memoryview], None] | None = None) -> None:
        self.buf = buf
        self.hdr = replayed.hdr
        self.index = index = replayed.index
        self.inodes = index.inodes
        self.changes = ChangeTracker(replayed.log, replayed.alloc, persister,
                                     lambda: snapshot.payloads(index, self.data.unwritten))
        self.log = self.changes.log
        self.alloc = self.changes.alloc
        self.persister = persister
        self.data_off = self.hdr.data_off
        self.data = Data(buf, self.data_off, index, self.changes, copy_nt)
        self.attrs = Attributes(index, self.changes, self.data)
        self.namespace = Namespace(index, self.changes, self.attrs)
        self.extents = Extents(self.data)
        self.replay_stats = replayed.stats
        self.replay_tail = replayed.tail  # records and bytes replayed after the snapshot

    @classmethod
    def open(cls, buf: memoryview, persister: Persister, repair: bool = True,
             progress: Callable[[str], None] | None = None,
             copy_nt: Callable[[int, memoryview], None] | None = None) -> Filesystem:
        """Replay the pool's log (rpmemfs.fs.recovery). Orphans (files unlinked while open)
        are freed by a record that the first durability point makes durable, on the replicas
        too."""
        replayed = recovery.replay(buf, persister, repair)
        fs = cls(buf, replayed, persister, copy_nt)
        recovery.settle(replayed, fs.changes, fs.namespace, fs.data, repair, progress)
        return fs

    @property
    def next_ino(self) -> int:
        return self.index.next_ino

    @property
    def open_files(self) -> int:
        return self.namespace.open_files

    @property
    def posix_acl(self) -> bool:
        """ACLs kept in step with modes and inherited (off when the mount has no xattrs)."""
        return self.attrs.posix_acl

    @posix_acl.setter
    def posix_acl(self, on: bool) -> None:
        self.attrs.posix_acl = on

    # ---------------------------------------------------------------- namespace

    def node(self, ino: int) -> Inode:
        return self.index.node(ino)

    def lookup(self, parent: int, name: bytes) -> Inode:
        return self.namespace.lookup(parent, name)

    def readdir(self, ino: int) -> list[tuple[bytes, int]]:
        return self.namespace.readdir(ino)

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
               rdev: int = 0, umask: int = 0, caller: Caller | None = None) -> Inode:
        return self.namespace.create(parent, name, mode, uid, gid, rdev, umask, caller)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int, umask: int = 0,
              caller: Caller | None = None) -> Inode:
        return self.namespace.mkdir(parent, name, mode, uid, gid, umask, caller)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return self.namespace.symlink(parent, name, target, uid, gid)

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return self.namespace.link(ino, parent, name)

    def unlink(self, parent: int, name: bytes) -> None:
        self.namespace.unlink(parent, name)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.namespace.rmdir(parent, name)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        self.namespace.rename(old_parent, old_name, new_parent, new_name, flags)

    def opened(self, ino: int) -> Inode:
        return self.namespace.opened(ino)

    def released(self, ino: int) -> None:
        self.namespace.released(ino)

    def forget(self, ino: int, n: int) -> None:
        self.namespace.forget(ino, n)

    # ---------------------------------------------------------------- attributes

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime: int | None = None,
                mtime: int | None = None, atime_now: bool = False, mtime_now: bool = False,
                kill_suidgid: Caller | None = None) -> Inode:
        return self.attrs.setattr(ino, mode=mode, uid=uid, gid=gid, size=size, atime=atime,
                                  mtime=mtime, atime_now=atime_now, mtime_now=mtime_now,
                                  kill_suidgid=kill_suidgid)

    def kill_suidgid(self, node: Inode, caller: Caller, new_gid: int | None = None) -> None:
        self.attrs.kill_suidgid(node, caller, new_gid)

    def open_truncate(self, ino: int, caller: Caller) -> Inode:
        return self.attrs.open_truncate(ino, caller)

    def setxattr(self, ino: int, name: bytes, value: bytes, caller: Caller | None = None) -> None:
        self.attrs.setxattr(ino, name, value, caller)

    def getxattr(self, ino: int, name: bytes) -> bytes | None:
        return self.attrs.getxattr(ino, name)

    def removexattr(self, ino: int, name: bytes) -> None:
        self.attrs.removexattr(ino, name)

    # ---------------------------------------------------------------- data

    def read(self, ino: int, off: int, size: int) -> bytes:
        return self.data.read(ino, off, size)

    def write(self, ino: int, off: int, data: bytes | memoryview) -> int:
        return self.data.write(ino, off, data)

    # ---------------------------------------------------------------- durability

    def has_changes(self) -> bool:
        return self.changes.has_changes()

    def take_changes(self) -> Changes:
        return self.changes.take_changes()

    def mark_durable(self, seq: int, tail: int) -> None:
        self.changes.mark_durable(seq, tail)

    def checkpoint(self) -> None:
        self.changes.checkpoint()

    def wants_checkpoint(self) -> bool:
        return self.changes.wants_checkpoint()

    def checkpoint_if_long(self, when: str) -> bool:
        return self.changes.checkpoint_if_long(when)

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
