"""Rebuilding the in-memory index from log records (used by mount and by check)."""

from __future__ import annotations

from collections.abc import Iterable

from rpmemfs.fs import records as R
from rpmemfs.fs.inode import Inode

ROOT_INO = 1


class Index:
    """Inodes by number plus the next inode number; what replay produces."""

    def __init__(self) -> None:
        self.inodes: dict[int, Inode] = {}
        self.next_ino = ROOT_INO + 1
        self.problems: list[str] = []
        # inode -> file blocks last mapped with MAP_PREALLOC (fallocate), not unmapped since
        self.prealloc: dict[int, set[int]] = {}

    def apply(self, payloads: Iterable[memoryview]) -> int:
        """Apply every entry of every payload in order; returns the number of entries."""
        inodes = self.inodes
        count = 0
        for payload in payloads:
            for tag, f, tail in R.entries(payload):
                count += 1
                if tag == R.T_INODE:
                    _, mode, ino, uid, gid, nlink, rdev, size, at, mt, ct = f
                    node = inodes.get(ino)
                    if node is None:
                        inodes[ino] = Inode(ino, mode, uid, gid, nlink, rdev, size, at, mt, ct)
                        if ino >= self.next_ino:
                            self.next_ino = ino + 1
                    else:
                        node.mode, node.uid, node.gid, node.nlink, node.rdev = mode, uid, gid, nlink, rdev
                        node.size, node.atime, node.mtime, node.ctime = size, at, mt, ct
                elif tag == R.T_MAP:
                    _, flags, n, ino, fb, pb = f
                    node = inodes.get(ino)
                    if node is None:
                        self.problems.append(f"block map for missing inode {ino}")
                        continue
                    if n == 1:
                        node.blocks[fb] = pb
                    else:
                        node.blocks.update(zip(range(fb, fb + n), range(pb, pb + n), strict=True))
                    if flags & R.MAP_PREALLOC:
                        self.prealloc.setdefault(ino, set()).update(range(fb, fb + n))
                    elif ino in self.prealloc:
                        self.prealloc[ino].difference_update(range(fb, fb + n))
                elif tag == R.T_LINK:
                    _, _n, parent, ino = f
                    pnode = inodes.get(parent)
                    if pnode is None or pnode.children is None:
                        self.problems.append(f"entry {tail!r} in missing directory {parent}")
                        continue
                    pnode.children[tail] = ino
                    child = inodes.get(ino)
                    if child is not None and child.children is not None:
                        child.parent = parent
                elif tag == R.T_UNLINK:
                    _, _n, parent = f
                    pnode = inodes.get(parent)
                    if pnode is not None and pnode.children is not None:
                        pnode.children.pop(tail, None)
                elif tag == R.T_TRUNC:
                    _, ino, fb = f
                    node = inodes.get(ino)
                    if node is not None:
                        for b in [b for b in node.blocks if b >= fb]:
                            del node.blocks[b]
                    if ino in self.prealloc:
                        self.prealloc[ino] = {b for b in self.prealloc[ino] if b < fb}
                elif tag == R.T_UNMAP:
                    _, ino, fb, n = f
                    node = inodes.get(ino)
                    if node is not None:
                        gone = (range(fb, fb + n) if n <= len(node.blocks)
                                else [b for b in node.blocks if fb <= b < fb + n])
                        for b in gone:
                            node.blocks.pop(b, None)
                    if ino in self.prealloc:
                        self.prealloc[ino] = {b for b in self.prealloc[ino] if not fb <= b < fb + n}
                elif tag == R.T_FREE:
                    inodes.pop(f[1], None)
                    self.prealloc.pop(f[1], None)
                elif tag == R.T_SYMLINK:
                    node = inodes.get(f[2])
                    if node is not None:
                        node.target = tail
                elif tag == R.T_XSET:
                    _, nl, _vl, ino = f
                    node = inodes.get(ino)
                    if node is not None:
                        node.xattrs[tail[:nl]] = tail[nl:]
                elif tag == R.T_XDEL:
                    node = inodes.get(f[2])
                    if node is not None:
                        node.xattrs.pop(tail, None)
                elif tag == R.T_NEXTINO:
                    self.next_ino = max(self.next_ino, f[1])
        return count

    def orphans(self) -> list[int]:
        """Inodes that no directory names and whose link count is zero (open at a crash)."""
        return [ino for ino, n in self.inodes.items() if n.nlink == 0 and ino != ROOT_INO]

