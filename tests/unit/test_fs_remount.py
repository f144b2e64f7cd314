"""Mounting a big tree quickly, and the checkpoints that keep later mounts quick.

The replay's inline decoding and the snapshot's inline packing are checked against the
generic per-entry code they shortcut (the same index, the same snapshot bytes), on trees
made by random operations; the checkpoint a mount writes after a crash left a long log tail
is crashed at every persist call.
"""

from __future__ import annotations

import os
import random
import stat

import pytest
from mempool import MemPersister, durable, new_fs, reopen, tree
from test_fs_crash import Workload
from test_fs_falloc import KEEP_SIZE, falloc, mkfile

from rpmemfs import native
from rpmemfs.fs import bulk
from rpmemfs.fs import records as R
from rpmemfs.fs.alloc import Allocator
from rpmemfs.fs.check import check
from rpmemfs.fs.filesystem import CHECKPOINT_MIN_TAIL, Filesystem
from rpmemfs.fs.inode import Inode
from rpmemfs.fs.log import scan
from rpmemfs.fs.replay import ROOT_INO, Index
from rpmemfs.fs.snapshot import payloads, prealloc_entries
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK

REG = stat.S_IFREG | 0o644


def reference_index(buf: memoryview) -> Index:
    """The index as replay built it before the inline decoding: entry by entry."""
    hdr, _ = read_header(buf)
    index = Index()
    for rec in scan(buf, hdr).records:
        for tag, f, tail in R.entries(rec.payload):
            index.apply_entry(tag, f, tail)
    return index


def fast_index(buf: memoryview) -> Index:
    hdr, _ = read_header(buf)
    index = Index()
    index.apply(r.payload for r in scan(buf, hdr).records)
    return index


def inode_state(node: Inode) -> tuple[object, ...]:
    return (node.ino, node.mode, node.uid, node.gid, node.nlink, node.rdev, node.size,
            node.atime, node.mtime, node.ctime, sorted(node.blocks.items()),
            None if node.children is None else sorted(node.children.items()), node.parent,
            node.target, sorted(node.xattrs.items()))


def assert_same_index(got: Index, want: Index) -> None:
    assert got.next_ino == want.next_ino
    assert got.problems == want.problems
    assert {i: sorted(b) for i, b in got.prealloc.items()} == {i: sorted(b) for i, b in want.prealloc.items()}
    assert sorted(got.inodes) == sorted(want.inodes)
    for ino, node in want.inodes.items():
        assert inode_state(got.inodes[ino]) == inode_state(node), ino


def reference_snapshot(fs: Filesystem) -> list[bytes]:
    """Every entry of a snapshot as Inode.snapshot_entries makes them, in snapshot order."""
    out = [R.next_ino(fs.next_ino)]
    order = sorted(fs.inodes)
    for ino in order:
        out += fs.inodes[ino].snapshot_entries() + prealloc_entries(fs.inodes[ino], fs.data.unwritten)
    for ino in order:
        for name, child in (fs.inodes[ino].children or {}).items():
            out.append(R.link(ino, name, child))
    return out


def falloc_fs(seed: int) -> Filesystem:
    """A tree with preallocated, punched and truncated files beside plain ones."""
    rng = random.Random(seed)
    fs, _ = new_fs()
    inos = [mkfile(fs, b"f%d" % i, os.urandom(rng.choice((1, 100, BLOCK + 3)))) for i in range(12)]
    for _ in range(40):
        ino = rng.choice(inos)
        op = rng.randrange(4)
        if op == 0:
            falloc(fs, ino, KEEP_SIZE, rng.randrange(8) * BLOCK, rng.randrange(1, 5) * BLOCK)
        elif op == 1:
            fs.write(ino, rng.randrange(6 * BLOCK), os.urandom(rng.randrange(1, 2 * BLOCK)))
        elif op == 2:
            fs.setattr(ino, size=rng.randrange(5 * BLOCK))
        else:
            durable(fs)
    durable(fs)
    return fs


def small_files_fs() -> Filesystem:
    """1,600 files of one block, with names of 1 to 14 bytes: snapshot records of INODE+MAP
    pairs and of LINK entries of two lengths."""
    fs, _ = new_fs(32 << 20)
    for d in range(4):
        dino = fs.mkdir(ROOT_INO, b"d%d" % d, stat.S_IFDIR | 0o755, 0, 0).ino
        for i in range(400):
            fs.write(fs.create(dino, b"n" * (i % 12) + b"%d" % i, REG, 0, 0).ino, 0, b"x")
    durable(fs)
    return fs


@pytest.mark.parametrize("seed", range(4))
def test_inline_replay_builds_the_index_entry_by_entry_replay_builds(seed: int) -> None:
    w = Workload(300 + seed)
    w.run(250)
    durable(w.fs)
    for fs in (w.fs, falloc_fs(seed), *((small_files_fs(),) if seed == 0 else ())):
        buf = memoryview(bytes(fs.buf))
        assert_same_index(fast_index(buf), reference_index(buf))
        fs.checkpoint()  # and from a snapshot, which the inline code is for
        durable(fs)
        buf = memoryview(bytes(fs.buf))
        want = reference_index(buf)
        assert_same_index(fast_index(buf), want)
        assert len(want.inodes) == len(fs.inodes)


def test_inline_replay_reports_the_same_problems() -> None:
    """Entries naming an inode or directory that is not there are refused alike."""
    index, want = Index(), Index()
    payload = memoryview(b"".join([
        R.inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, 2, 0, 0, 1, 1, 1),
        R.inode(5, REG, 0, 0, 1, 0, 10, 1, 1, 1),
        R.map_run(9, 0, 70, 1), R.map_run(9, 0, 70, 3), R.link(5, b"x", ROOT_INO),
        R.link(77, b"name", 5), R.map_run(5, 2, 40, 1, R.MAP_PREALLOC), R.map_run(5, 2, 41, 1),
    ]))
    assert index.apply([payload]) == 8
    for tag, f, tail in R.entries(payload):
        want.apply_entry(tag, f, tail)
    assert_same_index(index, want)
    assert len(index.problems) == 4
    with pytest.raises(ValueError, match="unknown entry tag 99 at payload offset 0"):
        Index().apply([memoryview(bytes([99]) + bytes(7))])


@pytest.mark.parametrize("seed", range(3))
def test_a_mount_claims_the_blocks_that_claiming_each_run_claims(seed: int) -> None:
    w = Workload(500 + seed)
    w.run(250)
    durable(w.fs)
    for fs in (w.fs, falloc_fs(20 + seed)):
        durable(fs)
        got, _ = reopen(bytearray(fs.buf))
        want = Allocator(got.hdr.data_blocks)
        for node in got.inodes.values():
            for _fb, pb, n in node.runs():
                want.mark_used(pb, n)
        assert got.alloc.map == want.map and got.alloc.free == want.free
        assert want.free < want.nblocks


def split(payload: bytes) -> list[bytes]:
    """A payload's entries, each as its bytes."""
    out, off = [], 0
    view = memoryview(payload)
    while off < len(payload):
        nxt = R.entry_at(view, off)[3]
        out.append(payload[off:nxt])
        off = nxt
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_snapshot_holds_what_snapshot_entries_make_in_records_of_one_kind(seed: int) -> None:
    w = Workload(400 + seed)
    w.run(250)
    big = small_files_fs()
    for fs in (w.fs, falloc_fs(10 + seed), big):
        fs.changes.take_dirty()
        records = list(payloads(fs.index, fs.data.unwritten))
        got = [e for r in records for e in split(r)]
        assert sorted(got) == sorted(reference_snapshot(fs))
        # Every inode's entries after its INODE entry, every LINK after every inode.
        tags = [e[0] for e in got]
        first_link = tags.index(R.T_LINK) if R.T_LINK in tags else len(tags)
        assert R.T_INODE not in tags[first_link:]
        seen: set[int] = set()
        for e in got[:first_link]:
            if e[0] == R.T_INODE:
                seen.add(R.INODE.unpack_from(e)[2])
            elif e[0] != R.T_NEXTINO:
                assert R.entry_at(memoryview(e), 0)[1][3 if e[0] in (R.T_MAP, R.T_XSET) else 2] in seen
        pairs = [r for r in records if bulk.apply_pairs(memoryview(r), {}, {}, lambda *a: None)[0]]
        links = [r for r in records if bulk.apply_links(memoryview(r), {}, [])]
        if fs is big:  # the bulk records are there (apply_links into no directory: problems)
            assert len(pairs) >= 2 and len(links) >= 2  # names padded to 8 and to 16


def long_tail_pool(files: int = 400, size: int = 4 << 20, orphan: bool = False
                   ) -> tuple[bytearray, dict[str, object]]:
    """A pool whose log holds many records after a small snapshot (a crash after a busy
    while), and its tree; with ``orphan``, also a file of several blocks unlinked while it
    was still open at the crash (the mount reclaims it)."""
    fs, _ = new_fs(size)
    for d in range(files // 50):
        dino = fs.mkdir(ROOT_INO, b"d%d" % d, stat.S_IFDIR | 0o755, 0, 0).ino
        for i in range(50):
            fs.write(fs.create(dino, b"f%d" % i, REG, 0, 0).ino, 0, b"%d/%d" % (d, i))
        durable(fs)
    if orphan:
        ino = fs.create(ROOT_INO, b"open", REG, 0, 0).ino
        fs.write(ino, 0, os.urandom(5 * BLOCK))
        fs.opened(ino)
        fs.unlink(ROOT_INO, b"open")
        durable(fs)
    assert fs.log.tail_bytes > CHECKPOINT_MIN_TAIL
    return bytearray(fs.buf), tree(fs)


def test_a_mount_after_a_long_tail_checkpoints_and_the_next_replays_only_the_snapshot() -> None:
    media, want = long_tail_pool()
    fs, _ = reopen(media)
    assert fs.replay_tail[0] > 400 and fs.replay_tail[1] == fs.log.tail_bytes
    assert fs.checkpoint_if_long("at mount")
    assert fs.log.tail_bytes == 0
    # A crash now, with nothing changed since: the next mount replays no tail.
    again, _ = reopen(bytearray(fs.buf))
    assert again.replay_tail == (0, 0)
    assert tree(again) == want
    assert not again.checkpoint_if_long("at mount")


def test_a_short_tail_is_not_worth_a_checkpoint() -> None:
    media, _ = long_tail_pool()
    fs, _ = reopen(media)
    fs.checkpoint()
    fs.write(fs.create(ROOT_INO, b"one", REG, 0, 0).ino, 0, b"1")
    durable(fs)
    assert 0 < fs.log.tail_bytes < CHECKPOINT_MIN_TAIL
    assert not fs.wants_checkpoint()
    gen = fs.log.gen
    assert not fs.checkpoint_if_long("at unmount")
    assert fs.log.gen == gen


def test_a_tail_past_half_the_snapshot_is_worth_one() -> None:
    """A big snapshot raises the bar: the checkpoint must save about what it costs."""
    media, _ = long_tail_pool(2000, 32 << 20)
    fs, _ = reopen(media)
    fs.checkpoint()
    durable(fs)
    snap = fs.log.snap_bytes
    assert snap // 2 > CHECKPOINT_MIN_TAIL
    n = 0
    while fs.log.tail_bytes <= snap // 2:
        assert not fs.wants_checkpoint()
        fs.write(fs.create(ROOT_INO, b"n%d" % n, REG, 0, 0).ino, 0, b"n")
        durable(fs)
        n += 1
    assert fs.wants_checkpoint()


@pytest.mark.parametrize(("evict", "orphan"), [(0.0, False), (0.5, False), (1.0, False),
                                               (0.0, True), (1.0, True)])
def test_crash_at_any_point_of_the_mount_checkpoint_keeps_the_tree(evict: float, orphan: bool) -> None:
    """Crashed before each persist call of the checkpoint a mount writes (and with cache
    lines it stored but did not persist yet written back in any share): the pool mounts,
    checks clean and holds the same tree, from the old area or the new one; a file the
    mount reclaimed (unlinked while open at the crash before) stays gone, its blocks free."""
    media, want = long_tail_pool(orphan=orphan)
    fs, p = reopen(media)
    free = fs.alloc.free + fs.alloc.pending_blocks
    assert fs.alloc.pending_blocks == (5 if orphan else 0)  # the orphan's, reclaimed
    before = bytearray(p.buf)
    assert fs.checkpoint_if_long("at mount")
    assert len(p.calls) >= 2
    rng = random.Random(int(evict * 10))
    for k in range(len(p.calls) + 1):
        # What was stored by then: the pool before the mount plus calls 0..k-1 (and call k's
        # stores, not persisted yet, which eviction may write back).
        stored = bytearray(before)
        for call in p.calls[: k + 1]:
            for off, data in call.ranges:
                stored[off: off + len(data)] = data
        crash = MemPersister(stored, formatted=bytes(before), calls=p.calls[:k])
        disk = crash.media(evict=evict, rng=rng)
        report = check(memoryview(bytes(disk)))
        assert not report["problems"], (k, report["problems"])
        got, _ = reopen(disk)
        assert tree(got) == want, f"crash before persist call {k} of {len(p.calls)}"
        durable(got)
        assert got.alloc.free == free, "blocks leaked or lost"


def python_scan(area: bytes, off: int, seq: int) -> list[int]:
    """What native.log_scan finds, found record by record in Python."""
    out: list[int] = []
    while (rec := R.read_record(memoryview(area), off, seq)) is not None:
        out += [off, len(rec.payload)]
        off += rec.length
        seq += 1
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_native_log_scan_stops_where_reading_record_by_record_stops(seed: int) -> None:
    """Torn, out-of-sequence, zero-length and overlong records end the scan alike."""
    rng = random.Random(seed)
    area = bytearray()
    for seq in range(5, 5 + rng.randrange(1, 60)):
        area += R.frame(seq, os.urandom(rng.randrange(1, 300)))
    area += bytes(rng.randrange(0, 40))
    damage = rng.randrange(6)
    at = rng.randrange(len(area))
    if damage == 1:
        area[at] ^= 1 << rng.randrange(8)  # a flipped bit: CRC, length or seq
    elif damage == 2:
        area[at:] = bytes(len(area) - at)  # the rest never written
    elif damage == 3:
        del area[at:]  # the area ends inside a record
    elif damage == 4:
        area[at: at + 8] = os.urandom(8)
    for off, seq in ((0, 5), (0, 6), (len(R.frame(5, b"x")), 6)):
        assert native.log_scan(bytes(area), off, seq) == python_scan(bytes(area), off, seq)
    if damage == 0:
        assert len(native.log_scan(bytes(area), 0, 5)) // 2 >= 1
