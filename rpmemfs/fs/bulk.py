"""Snapshot records of one kind of entry, which a mount reads in bulk.

Most of a big tree is small files: an INODE entry and one MAP entry each, and a LINK naming
it. A snapshot puts those files' INODE+MAP pairs in records of nothing else, and its LINK
entries in records of one entry length each (docs/format.md, "Checkpoint layout"), so that
replay decodes a whole record with one struct.iter_unpack instead of entry by entry. The
records stay ordinary ones: any reader applies their entries one by one with the same
result, and replay falls back to that for any record that is not exactly of one kind.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from rpmemfs.fs import records as R
from rpmemfs.fs.inode import Inode

# An INODE entry followed by a MAP entry, as one struct.
PAIR = struct.Struct("<" + R.INODE.format.lstrip("<") + R.MAP.format.lstrip("<"))
_LINKS: dict[int, struct.Struct] = {}  # entry length -> LINK entries with names of that padding

ApplyEntry = Callable[[int, tuple[int, ...], bytes], None]


def pack_pair(node: Inode, fb: int, pb: int) -> bytes:
    """The INODE entry of ``node`` and the MAP entry of its one block, as one."""
    return PAIR.pack(R.T_INODE, node.mode, node.ino, node.uid, node.gid, node.nlink, node.rdev,
                     node.size, node.atime, node.mtime, node.ctime, R.T_MAP, 0, 1, node.ino, fb, pb)


def _one_kind(payload: memoryview, step: int, tag: int) -> int:
    """How many entries of ``step`` bytes the payload holds if every one starts with
    ``tag`` (and it holds nothing else), else 0."""
    n = len(payload)
    if n == 0 or n % step:
        return 0
    count = n // step
    return count if payload[0::step].tobytes() == bytes((tag,)) * count else 0


def apply_pairs(payload: memoryview, inodes: dict[int, Inode], prealloc: dict[int, set[int]],
                apply_entry: ApplyEntry) -> tuple[int, int]:
    """Apply a record of INODE+MAP pairs: (its entries, the highest inode number it made),
    or (0, 0), having applied nothing, when it is not one. A pair that is not a new inode
    and its one block is applied entry by entry."""
    count = _one_kind(payload, PAIR.size, R.T_INODE)
    if not count or payload[R.INODE.size::PAIR.size].tobytes() != bytes((R.T_MAP,)) * count:
        return 0, 0
    highest = 0
    for (_, mode, ino, uid, gid, nlink, rdev, size, at, mt, ct,
         _m, flags, blocks, map_ino, fb, pb) in PAIR.iter_unpack(payload):
        if map_ino == ino and blocks == 1 and not flags and ino not in inodes and ino not in prealloc:
            node = inodes[ino] = Inode(ino, mode, uid, gid, nlink, rdev, size, at, mt, ct)
            node.blocks[fb] = pb
            if ino > highest:
                highest = ino
        else:
            apply_entry(R.T_INODE, (R.T_INODE, mode, ino, uid, gid, nlink, rdev, size, at, mt, ct), b"")
            apply_entry(R.T_MAP, (R.T_MAP, flags, blocks, map_ino, fb, pb), b"")
    return 2 * count, highest


def apply_links(payload: memoryview, inodes: dict[int, Inode], problems: list[str]) -> int:
    """Apply a record of LINK entries of one length; returns its entries, 0 (and applies
    nothing) when it is not one."""
    if len(payload) < R.LINK.size or payload[0] != R.T_LINK:
        return 0
    padded = (payload[2] | payload[3] << 8) + 7 & ~7
    count = _one_kind(payload, R.LINK.size + padded, R.T_LINK) if padded else 0
    if not count:
        return 0
    st = _LINKS.get(padded)
    if st is None:
        st = _LINKS[padded] = struct.Struct(R.LINK.format + f"{padded}s")
    rows = list(st.iter_unpack(payload))
    if any((k + 7) & ~7 != padded for _, k, _, _, _ in rows):
        return 0  # names of other lengths: the layout guessed is wrong
    for _, k, parent, ino, name in rows:
        name = name[:k]
        pnode = inodes.get(parent)
        if pnode is None or pnode.children is None:
            problems.append(f"entry {name!r} in missing directory {parent}")
            continue
        pnode.children[name] = ino
        child = inodes.get(ino)
        if child is not None and child.children is not None:
            child.parent = parent
    return count
