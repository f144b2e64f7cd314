"""A checkpoint's snapshot: the whole in-memory index as log record payloads.

A checkpoint (rpmemfs.fs.changes) writes these into the other log area; a mount replays them
instead of the history they replace. Their order and grouping are what replay reads fastest
(rpmemfs.fs.bulk); what they say is exactly what Inode.snapshot_entries and prealloc_entries
say, in records of about SNAPSHOT_RECORD bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

from rpmemfs.fs import bulk
from rpmemfs.fs import records as R
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.replay import Index

SNAPSHOT_RECORD = 64 << 10


def prealloc_entries(node: Inode, unwritten: dict[int, set[int]]) -> list[bytes]:
    """MAP entries restating the blocks of ``node`` preallocated and not written since
    (``unwritten``: inode -> such file blocks, rpmemfs.fs.data)."""
    uw = unwritten.get(node.ino)
    if not uw:
        return []
    blocks = node.blocks
    out: list[tuple[int, int, int]] = []
    for fb in sorted(b for b in uw if b in blocks):
        pb = blocks[fb]
        if out and out[-1][0] + out[-1][2] == fb and out[-1][1] + out[-1][2] == pb:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((fb, pb, 1))
    return [R.map_run(node.ino, fb, pb, n, R.MAP_PREALLOC) for fb, pb, n in out]


def payloads(index: Index, unwritten: dict[int, set[int]]) -> Iterator[bytes]:
    """The whole index as record payloads: first the files of one block and nothing else as
    INODE+MAP pairs, then every other inode with its entries, then the LINK entries grouped
    by length (bulk.py: replay reads records of one kind of entry in bulk). Every inode's
    entries come after its INODE entry and every LINK after all inodes, which is all replay
    needs."""
    inodes = index.inodes
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
    parts: list[bytes] = [R.next_ino(index.next_ino)]
    size = 0
    for ino in others:
        node = inodes[ino]
        for e in node.snapshot_entries() + prealloc_entries(node, unwritten):
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
