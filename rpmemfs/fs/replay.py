"""The in-memory index, rebuilt from log records (by mount and by check).

A mounted filesystem goes on using the index replay made: every module of it
(rpmemfs.fs.filesystem) finds inodes through the same one.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

from rpmemfs.fs import records as R
from rpmemfs.fs.bulk import apply_links, apply_pairs
from rpmemfs.fs.errors import FsError
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

    def node(self, ino: int) -> Inode:
        """The inode, or ENOENT."""
        node = self.inodes.get(ino)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def directory(self, ino: int) -> Inode:
        """The directory, or ENOENT or ENOTDIR."""
        node = self.node(ino)
        if node.children is None:
            raise FsError(errno.ENOTDIR)
        return node

    def apply(self, payloads: Iterable[memoryview]) -> int:
        """Apply every entry of every payload in order; returns the number of entries.

        A snapshot's records of one kind of entry are decoded in bulk (bulk.py); elsewhere
        the entries most of a tree is made of (INODE, MAP, LINK) are decoded here inline,
        the rest by apply_entry: a mount of a big tree spends most of its time in this loop,
        and a generator and a call per entry were half of it."""
        inodes = self.inodes
        inode_at, map_at, link_at = R.INODE.unpack_from, R.MAP.unpack_from, R.LINK.unpack_from
        inode_size, map_size, link_size = R.INODE.size, R.MAP.size, R.LINK.size
        t_inode, t_map, t_link = R.T_INODE, R.T_MAP, R.T_LINK
        count = 0
        for payload in payloads:
            # A snapshot's records of one kind of entry (bulk.py), in one go.
            n, highest = apply_pairs(payload, inodes, self.prealloc, self.apply_entry)
            if n:
                count += n
                if highest >= self.next_ino:
                    self.next_ino = highest + 1
                continue
            n = apply_links(payload, inodes, self.problems)
            if n:
                count += n
                continue
            off, end = 0, len(payload)
            while off < end:
                tag = payload[off]
                count += 1
                if tag == t_inode:
                    _, mode, ino, uid, gid, nlink, rdev, size, at, mt, ct = inode_at(payload, off)
                    off += inode_size
                    node = inodes.get(ino)
                    if node is None:
                        inodes[ino] = Inode(ino, mode, uid, gid, nlink, rdev, size, at, mt, ct)
                        if ino >= self.next_ino:
                            self.next_ino = ino + 1
                    else:
                        node.mode, node.uid, node.gid, node.nlink, node.rdev = mode, uid, gid, nlink, rdev
                        node.size, node.atime, node.mtime, node.ctime = size, at, mt, ct
                elif tag == t_map:
                    f = map_at(payload, off)
                    off += map_size
                    if f[2] == 1 and not f[1] and (node := inodes.get(f[3])) is not None \
                            and f[3] not in self.prealloc:
                        node.blocks[f[4]] = f[5]
                    else:
                        self.apply_entry(tag, f, b"")
                elif tag == t_link:
                    _, k, parent, ino = link_at(payload, off)
                    start = off + link_size
                    name = bytes(payload[start: start + k])
                    off = start + ((k + 7) & ~7)
                    pnode = inodes.get(parent)
                    if pnode is None or pnode.children is None:
                        self.problems.append(f"entry {name!r} in missing directory {parent}")
                        continue
                    pnode.children[name] = ino
                    child = inodes.get(ino)
                    if child is not None and child.children is not None:
                        child.parent = parent
                else:
                    tag, f, tail, off = R.entry_at(payload, off)
                    self.apply_entry(tag, f, tail)
        return count

    def apply_entry(self, tag: int, f: tuple[Any, ...], tail: bytes) -> None:
        """Apply one entry, of any kind (R.entries gives them)."""
        inodes = self.inodes
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
                return
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
                return
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

    def orphans(self) -> list[int]:
        """Inodes that no directory names and whose link count is zero (open at a crash)."""
        return [ino for ino, n in self.inodes.items() if n.nlink == 0 and ino != ROOT_INO]

