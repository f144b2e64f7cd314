"""The in-memory inode: what the index knows about one file, directory or symlink."""

from __future__ import annotations

import stat
import time

from rpmemfs.fs import records as R
from rpmemfs.pool.layout import BLOCK_SHIFT


class Inode:
    __slots__ = (
        "ino", "mode", "uid", "gid", "nlink", "rdev", "size", "atime", "mtime", "ctime",
        "blocks", "children", "parent", "target", "xattrs", "lookups", "opens", "dirty",
    )

    def __init__(self, ino: int, mode: int, uid: int = 0, gid: int = 0, nlink: int = 1,
                 rdev: int = 0, size: int = 0, atime: int = 0, mtime: int = 0,
                 ctime: int = 0) -> None:
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.nlink = nlink
        self.rdev = rdev
        self.size = size
        self.atime = atime
        self.mtime = mtime
        self.ctime = ctime
        self.blocks: dict[int, int] = {}  # file block -> pool block
        self.children: dict[bytes, int] | None = {} if stat.S_ISDIR(mode) else None
        self.parent = 0  # directories only: for '..' and the rename-into-itself check
        self.target = b""  # symlinks only
        self.xattrs: dict[bytes, bytes] = {}
        self.lookups = 0  # kernel references (FUSE lookup count)
        self.opens = 0
        # Map changes not yet in the log, in order; None when only attributes are dirty.
        self.dirty: list[bytes] | None = None

    def tick(self, mtime: bool = False) -> int:
        """Advance ctime (and mtime with it when asked) to now, and return it.

        Some times come from the kernel's clock (utimensat with given times), which is
        coarser than this one and may be behind it, and the wall clock may be set back: a
        change still never takes ctime back nor leaves it unchanged, and an mtime set here
        is never before one set here earlier, as both come after the last ctime.
        """
        now = time.time_ns()
        if now <= self.ctime:
            now = self.ctime + 1
        self.ctime = now
        if mtime:
            self.mtime = now
        return now

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    def attr_entry(self) -> bytes:
        return R.inode(self.ino, self.mode, self.uid, self.gid, self.nlink, self.rdev,
                       self.size, self.atime, self.mtime, self.ctime)

    def runs(self, first: int = 0) -> list[tuple[int, int, int]]:
        """(file block, pool block, count) runs of the mapping from file block `first` on."""
        out: list[tuple[int, int, int]] = []
        for fb in sorted(b for b in self.blocks if b >= first):
            pb = self.blocks[fb]
            if out:
                f0, p0, n = out[-1]
                if f0 + n == fb and p0 + n == pb:
                    out[-1] = (f0, p0, n + 1)
                    continue
            out.append((fb, pb, 1))
        return out

    def snapshot_entries(self) -> list[bytes]:
        """Everything needed to rebuild this inode (but not its name in the parent)."""
        out = [self.attr_entry()]
        if self.target:
            out.append(R.symlink(self.ino, self.target))
        for name, value in self.xattrs.items():
            out.append(R.xset(self.ino, name, value))
        for fb, pb, n in self.runs():
            out.append(R.map_run(self.ino, fb, pb, n))
        return out

    def used_blocks(self) -> int:
        return len(self.blocks)

    def nblocks_for_size(self) -> int:
        return (self.size + (1 << BLOCK_SHIFT) - 1) >> BLOCK_SHIFT
