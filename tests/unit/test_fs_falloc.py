"""fallocate(2), SEEK_DATA/SEEK_HOLE and copy_file_range(2) on the filesystem over a pool in
memory (rpmemfs.fs.extents): each mode, st_blocks and free blocks, reuse of punched blocks,
hole maps, errors, and what a crash at any point leaves.
"""

from __future__ import annotations

import errno
import os
import random
import stat
from collections.abc import Callable

import pytest
from mempool import durable, new_fs, reopen
from test_fs_crash import Workload, crash_everywhere, crash_with_evictions

from rpmemfs.fs import records as R
from rpmemfs.fs.check import check
from rpmemfs.fs.extents import (
    COLLAPSE_RANGE,
    INSERT_RANGE,
    KEEP_SIZE,
    PUNCH_HOLE,
    SEEK_DATA,
    SEEK_HOLE,
    UNSHARE_RANGE,
    ZERO_RANGE,
    Extents,
)
from rpmemfs.fs.filesystem import MAX_FILE_SIZE, Filesystem, FsError, NeedSync
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.pool.layout import BLOCK, PoolFormatError

REG = stat.S_IFREG | 0o644


@pytest.fixture
def fs() -> Filesystem:
    return new_fs()[0]


def ext(fs: Filesystem) -> Extents:
    """The range operations on fs (one object per filesystem, as the FUSE edge keeps)."""
    return fs.extents


def mkfile(fs: Filesystem, name: bytes, data: bytes = b"") -> int:
    ino = fs.create(ROOT_INO, name, REG, 0, 0).ino
    if data:
        fs.write(ino, 0, data)
    return ino


def falloc(fs: Filesystem, ino: int, mode: int, off: int, length: int) -> None:
    """The FUSE edge's call: a durability point and a retry when freed blocks are pending."""
    try:
        ext(fs).fallocate(ino, mode, off, length)
    except NeedSync:
        durable(fs)
        ext(fs).fallocate(ino, mode, off, length)


def content(fs: Filesystem, ino: int) -> bytes:
    return fs.read(ino, 0, fs.node(ino).size)


def seek_map(fs: Filesystem, ino: int) -> list[tuple[str, int, int]]:
    """The file as (data|hole, start, end) extents found by SEEK_DATA/SEEK_HOLE alone."""
    out: list[tuple[str, int, int]] = []
    size = fs.node(ino).size
    pos = 0
    while pos < size:
        try:
            data = ext(fs).seek(ino, pos, SEEK_DATA)
        except FsError as e:
            assert e.errno == errno.ENXIO
            out.append(("hole", pos, size))
            break
        if data > pos:
            out.append(("hole", pos, data))
        hole = ext(fs).seek(ino, data, SEEK_HOLE)
        out.append(("data", data, hole))
        pos = hole
    return out


def remount(fs: Filesystem) -> Filesystem:
    durable(fs)
    return reopen(bytearray(fs.buf))[0]


def free_blocks(fs: Filesystem) -> int:
    return fs.statfs()["bfree"]


# ------------------------------------------------------------------ modes 0 and KEEP_SIZE


def test_mode_0_allocates_zeroed_blocks_and_grows_the_size(fs: Filesystem) -> None:
    # Only blocks that held another file's data are free: they must read as zeros.
    ino = mkfile(fs, b"f", b"head")
    old = mkfile(fs, b"old", os.urandom(7 * BLOCK))
    old_blocks = set(fs.node(old).blocks.values())
    filler = mkfile(fs, b"filler")
    ext(fs).fallocate(filler, 0, 0, free_blocks(fs) * BLOCK)
    fs.unlink(ROOT_INO, b"old")
    durable(fs)
    free0 = free_blocks(fs)
    assert free0 == 7
    ext(fs).fallocate(ino, 0, 0, 8 * BLOCK)
    assert set(fs.node(ino).blocks.values()) - {fs.node(ino).blocks[0]} == old_blocks
    node = fs.node(ino)
    assert node.size == 8 * BLOCK
    assert len(node.blocks) == 8
    assert free_blocks(fs) == free0 - 7
    assert content(fs, ino) == b"head" + bytes(8 * BLOCK - 4)
    assert old not in fs.inodes
    fs2 = remount(fs)
    assert content(fs2, ino) == b"head" + bytes(8 * BLOCK - 4)
    assert len(fs2.node(ino).blocks) == 8
    assert check(fs2.buf)["clean"]


def test_mode_0_zeroes_the_tail_of_the_old_last_block(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", b"x" * 100)
    fs.setattr(ino, size=10)  # bytes 10..99 of block 0 still hold x's in the pool
    ext(fs).fallocate(ino, 0, 0, 2 * BLOCK)
    assert content(fs, ino) == b"x" * 10 + bytes(2 * BLOCK - 10)


def test_keep_size_allocates_past_the_end_without_growing(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", b"abc")
    ext(fs).fallocate(ino, KEEP_SIZE, 0, 4 * BLOCK)
    node = fs.node(ino)
    assert node.size == 3
    assert sorted(node.blocks) == [0, 1, 2, 3]
    fs2 = remount(fs)
    assert sorted(fs2.node(ino).blocks) == [0, 1, 2, 3]
    report = check(fs2.buf)
    assert report["clean"], report["problems"]
    assert report["stats"]["blocks_past_eof"] == 3
    # Growing over preallocated blocks shows zeros; writing there uses them.
    fs2.write(ino, 2 * BLOCK, b"zz")
    assert content(fs2, ino) == b"abc" + bytes(2 * BLOCK - 3) + b"zz"
    assert sorted(fs2.node(ino).blocks) == [0, 1, 2, 3]
    # Truncating drops them, as ext4 does.
    fs2.setattr(ino, size=1)
    assert sorted(fs2.node(ino).blocks) == [0]


def test_fallocate_over_data_changes_nothing(fs: Filesystem) -> None:
    data = os.urandom(3 * BLOCK)
    ino = mkfile(fs, b"f", data)
    before = dict(fs.node(ino).blocks)
    ext(fs).fallocate(ino, 0, 100, 2 * BLOCK)
    assert fs.node(ino).blocks == before
    assert content(fs, ino) == data


def test_enospc_leaves_nothing_half_done(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", b"data")
    durable(fs)
    free0 = free_blocks(fs)
    with pytest.raises(FsError) as e:
        ext(fs).fallocate(ino, 0, 0, (free0 + 2) * BLOCK)
    assert e.value.errno == errno.ENOSPC
    assert free_blocks(fs) == free0
    assert fs.node(ino).size == 4 and len(fs.node(ino).blocks) == 1
    # A huge range is refused at once, without listing its blocks.
    with pytest.raises(FsError) as e:
        ext(fs).fallocate(ino, KEEP_SIZE, 0, 1 << 45)
    assert e.value.errno == errno.ENOSPC
    # Exactly the free space works.
    ext(fs).fallocate(ino, 0, BLOCK, free0 * BLOCK)
    assert free_blocks(fs) == 0


# ------------------------------------------------------------------ PUNCH_HOLE


def test_punch_frees_whole_blocks_and_zeroes_partial_ones(fs: Filesystem) -> None:
    data = os.urandom(8 * BLOCK)
    ino = mkfile(fs, b"f", data)
    durable(fs)
    free0 = free_blocks(fs)
    off, end = BLOCK + 100, 5 * BLOCK + 7  # frees blocks 2, 3, 4; zeroes parts of 1 and 5
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, off, end - off)
    expect = data[:off] + bytes(end - off) + data[end:]
    node = fs.node(ino)
    assert node.size == 8 * BLOCK
    assert sorted(node.blocks) == [0, 1, 5, 6, 7]
    assert content(fs, ino) == expect
    assert free_blocks(fs) == free0 + 3  # statfs counts them at once
    fs2 = remount(fs)
    assert content(fs2, ino) == expect
    assert sorted(fs2.node(ino).blocks) == [0, 1, 5, 6, 7]
    assert check(fs2.buf)["clean"]


def test_punched_blocks_are_reused_once_durable(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", os.urandom(4 * BLOCK))
    other = mkfile(fs, b"g")
    durable(fs)
    # Fill the pool so that only punched blocks can serve the next allocation.
    falloc(fs, other, 0, 0, free_blocks(fs) * BLOCK)
    assert fs.alloc.free == 0
    punched = {fs.node(ino).blocks[b] for b in (1, 2)}
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, BLOCK, 2 * BLOCK)
    # Not before the punch is durable: a crash would bring them back to f.
    with pytest.raises(NeedSync):
        fs.write(other, fs.node(other).size, b"x" * (2 * BLOCK))
    durable(fs)
    fs.write(other, fs.node(other).size, b"x" * (2 * BLOCK))
    assert set(fs.node(other).blocks.values()) >= punched
    assert check(remount(fs).buf)["clean"]


def test_punch_limits(fs: Filesystem) -> None:
    data = os.urandom(2 * BLOCK + 10)
    ino = mkfile(fs, b"f", data)
    ext(fs).fallocate(ino, KEEP_SIZE, 0, 6 * BLOCK)
    # Past the end of file nothing is punched, as ext4: preallocated blocks stay.
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, 4 * BLOCK, BLOCK)
    assert sorted(fs.node(ino).blocks) == list(range(6))
    # Inside one block: zeroes only.
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, 10, 20)
    assert sorted(fs.node(ino).blocks) == list(range(6))
    assert content(fs, ino) == data[:10] + bytes(20) + data[30:]
    # Through the end of file: the block holding it goes, the ones past it stay.
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, BLOCK, 100 * BLOCK)
    assert sorted(fs.node(ino).blocks) == [0, 3, 4, 5]
    assert fs.node(ino).size == len(data)
    assert content(fs, ino) == data[:10] + bytes(20) + data[30:BLOCK] + bytes(BLOCK + 10)


def test_punch_is_one_unmap_entry(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", os.urandom(64 * BLOCK))
    durable(fs)
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, BLOCK, 62 * BLOCK)
    staged = fs.node(ino).dirty
    assert staged == [R.unmap(ino, 1, 62)]


# ------------------------------------------------------------------ ZERO_RANGE


@pytest.mark.parametrize("keep", [0, KEEP_SIZE])
def test_zero_range(fs: Filesystem, keep: int) -> None:
    data = os.urandom(4 * BLOCK)
    ino = mkfile(fs, b"f", data)
    fs.write(ino, 8 * BLOCK, b"tail")  # blocks 4..7 are a hole
    size = fs.node(ino).size
    ext(fs).fallocate(ino, ZERO_RANGE | keep, 100, 10 * BLOCK)
    end = 100 + 10 * BLOCK
    new_size = size if keep else end
    expect = (data[:100] + bytes(new_size))[:new_size]
    assert fs.node(ino).size == new_size
    assert content(fs, ino) == expect
    assert sorted(fs.node(ino).blocks) == list(range(11))  # the hole got blocks, as ext4
    assert content(remount(fs), ino) == expect


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(("mode", "off", "length", "code"), [
    (0, -1, 10, errno.EINVAL),
    (0, 0, 0, errno.EINVAL),
    (0, 0, -5, errno.EINVAL),
    (PUNCH_HOLE, 0, BLOCK, errno.EOPNOTSUPP),  # without KEEP_SIZE: Linux requires it
    (PUNCH_HOLE | ZERO_RANGE | KEEP_SIZE, 0, BLOCK, errno.EOPNOTSUPP),
    (COLLAPSE_RANGE, 0, BLOCK, errno.EOPNOTSUPP),
    (INSERT_RANGE, 0, BLOCK, errno.EOPNOTSUPP),
    (COLLAPSE_RANGE | KEEP_SIZE, 0, BLOCK, errno.EINVAL),
    (INSERT_RANGE | KEEP_SIZE, 0, BLOCK, errno.EINVAL),
    (UNSHARE_RANGE, 0, BLOCK, errno.EOPNOTSUPP),
    (0x1000, 0, BLOCK, errno.EOPNOTSUPP),
    (0, MAX_FILE_SIZE, 1, errno.EFBIG),
])
def test_bad_fallocate_calls(fs: Filesystem, mode: int, off: int, length: int, code: int) -> None:
    data = os.urandom(3 * BLOCK)
    ino = mkfile(fs, b"f", data)
    before = dict(fs.node(ino).blocks)
    with pytest.raises(FsError) as e:
        ext(fs).fallocate(ino, mode, off, length)
    assert e.value.errno == code
    assert fs.node(ino).blocks == before and content(fs, ino) == data


def test_fallocate_on_a_directory(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).ino
    with pytest.raises(FsError) as e:
        ext(fs).fallocate(d, 0, 0, BLOCK)
    assert e.value.errno == errno.EISDIR


# ------------------------------------------------------------------ SEEK_DATA / SEEK_HOLE


def test_seek_maps_holes_at_block_granularity(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f")
    fs.write(ino, BLOCK + 5, b"a")  # block 1
    fs.write(ino, 4 * BLOCK, b"b" * BLOCK)  # block 4
    fs.write(ino, 6 * BLOCK, b"c" * 10)  # block 6, size 6*BLOCK+10
    size = 6 * BLOCK + 10
    assert seek_map(fs, ino) == [
        ("hole", 0, BLOCK), ("data", BLOCK, 2 * BLOCK), ("hole", 2 * BLOCK, 4 * BLOCK),
        ("data", 4 * BLOCK, 5 * BLOCK), ("hole", 5 * BLOCK, 6 * BLOCK), ("data", 6 * BLOCK, size)]
    # Offsets inside an extent answer with themselves; at or past EOF: ENXIO.
    assert ext(fs).seek(ino, BLOCK + 9, SEEK_DATA) == BLOCK + 9
    assert ext(fs).seek(ino, 2 * BLOCK + 9, SEEK_HOLE) == 2 * BLOCK + 9
    assert ext(fs).seek(ino, 6 * BLOCK + 3, SEEK_HOLE) == size  # the implicit hole at EOF
    for whence in (SEEK_DATA, SEEK_HOLE):
        for off in (size, size + 1, -1):
            with pytest.raises(FsError) as e:
                ext(fs).seek(ino, off, whence)
            assert e.value.errno == errno.ENXIO
    with pytest.raises(FsError) as e:
        ext(fs).seek(ino, 0, 2)
    assert e.value.errno == errno.EINVAL
    # Punching block 4 makes it a hole; it stays one after a remount.
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, 4 * BLOCK, BLOCK)
    want = [("hole", 0, BLOCK), ("data", BLOCK, 2 * BLOCK), ("hole", 2 * BLOCK, 6 * BLOCK),
            ("data", 6 * BLOCK, size)]
    assert seek_map(fs, ino) == want
    fs2 = remount(fs)
    assert seek_map(fs2, ino) == want


def test_seek_data_past_the_last_data_block(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", b"x")
    fs.setattr(ino, size=10 * BLOCK)
    assert seek_map(fs, ino) == [("data", 0, BLOCK), ("hole", BLOCK, 10 * BLOCK)]
    with pytest.raises(FsError) as e:
        ext(fs).seek(ino, BLOCK, SEEK_DATA)
    assert e.value.errno == errno.ENXIO


def test_preallocated_blocks_are_holes_until_written(fs: Filesystem) -> None:
    """As ext4's unwritten extents (and tmpfs' fallocated pages): allocated, counted in
    st_blocks, but holes to SEEK_DATA/SEEK_HOLE."""
    ino = mkfile(fs, b"f")
    ext(fs).fallocate(ino, 0, 0, 4 * BLOCK)
    assert len(fs.node(ino).blocks) == 4
    assert seek_map(fs, ino) == [("hole", 0, 4 * BLOCK)]
    fs.write(ino, 2 * BLOCK + 1, b"w")
    assert seek_map(fs, ino) == [("hole", 0, 2 * BLOCK), ("data", 2 * BLOCK, 3 * BLOCK),
                                 ("hole", 3 * BLOCK, 4 * BLOCK)]
    # ZERO_RANGE over written whole blocks makes them unwritten again.
    ext(fs).fallocate(ino, ZERO_RANGE, 2 * BLOCK, BLOCK)
    assert seek_map(fs, ino) == [("hole", 0, 4 * BLOCK)]


def test_preallocated_blocks_stay_holes_after_a_remount(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", os.urandom(4 * BLOCK))
    ext(fs).fallocate(ino, 0, 0, 8 * BLOCK)  # blocks 4..7 new
    ext(fs).fallocate(ino, ZERO_RANGE, BLOCK, BLOCK)  # block 1 zeroed whole
    fs.write(ino, 6 * BLOCK, b"w")  # block 6 written
    want = [("data", 0, BLOCK), ("hole", BLOCK, 2 * BLOCK), ("data", 2 * BLOCK, 4 * BLOCK),
            ("hole", 4 * BLOCK, 6 * BLOCK), ("data", 6 * BLOCK, 7 * BLOCK),
            ("hole", 7 * BLOCK, 8 * BLOCK)]
    assert seek_map(fs, ino) == want
    fs2 = remount(fs)
    assert seek_map(fs2, ino) == want
    # A checkpoint's snapshot carries them too.
    fs2.checkpoint()
    fs3 = remount(fs2)
    assert seek_map(fs3, ino) == want
    assert check(fs3.buf)["clean"]


def test_a_preallocated_block_written_before_a_crash_is_data() -> None:
    """Writes log nothing about preallocation: the mount reads the blocks logged as
    preallocated and takes as holes only those still zero, so a write that reached the
    media before its record did is never hidden behind a hole."""
    fs, p = new_fs()
    ino = mkfile(fs, b"f")
    ext(fs).fallocate(ino, 0, 0, 4 * BLOCK)
    durable(fs)
    synced = len(p.calls)
    fs.write(ino, 2 * BLOCK, b"late")  # overwrite in place: the pool has it at once
    # Crash with every cache line written back but no durability point since.
    crashed = reopen(p.media(synced, evict=1.0))[0]
    assert crashed.read(ino, 2 * BLOCK, 4) == b"late"
    assert seek_map(crashed, ino) == [("hole", 0, 2 * BLOCK), ("data", 2 * BLOCK, 3 * BLOCK),
                                      ("hole", 3 * BLOCK, 4 * BLOCK)]


def test_too_many_preallocated_blocks_to_read_at_mount_are_data(
        fs: Filesystem, monkeypatch: pytest.MonkeyPatch) -> None:
    import rpmemfs.fs.recovery as F
    ino = mkfile(fs, b"f")
    ext(fs).fallocate(ino, 0, 0, 4 * BLOCK)
    durable(fs)
    monkeypatch.setattr(F, "PREALLOC_CHECK", 3)
    fs2 = reopen(bytearray(fs.buf))[0]
    assert seek_map(fs2, ino) == [("data", 0, 4 * BLOCK)]
    assert content(fs2, ino) == bytes(4 * BLOCK)


def test_older_map_entries_have_no_flags() -> None:
    """A MAP entry as older code wrote it (flags byte 0) maps data, as it did."""
    fields = next(R.entries(memoryview(R.map_run(7, 1, 2, 3))))[1]
    assert fields == (R.T_MAP, 0, 3, 7, 1, 2)
    flagged = next(R.entries(memoryview(R.map_run(7, 1, 2, 3, R.MAP_PREALLOC))))[1]
    assert flagged[1] == R.MAP_PREALLOC


# ------------------------------------------------------------------ copy_file_range


def test_copy_file_range_copies_inside_the_pool(fs: Filesystem) -> None:
    src_data = os.urandom(3 * BLOCK + 77)
    src = mkfile(fs, b"src", src_data)
    dst = mkfile(fs, b"dst", b"d" * 50)
    durable(fs)
    n = ext(fs).copy(src, 10, dst, 20, 2 * BLOCK, 0)
    assert n == 2 * BLOCK
    assert content(fs, dst) == b"d" * 20 + src_data[10: 10 + 2 * BLOCK]
    # The destination's new bytes are dirty: the next durability point carries them.
    assert fs.has_changes()
    assert content(remount(fs), dst) == content(fs, dst)
    # Past the source's end: short; at or past it: 0.
    assert ext(fs).copy(src, len(src_data) - 7, dst, 0, 100, 0) == 7
    assert ext(fs).copy(src, len(src_data), dst, 0, 100, 0) == 0
    assert ext(fs).copies == 3 and ext(fs).copied == 2 * BLOCK + 7


def test_copy_file_range_keeps_holes(fs: Filesystem) -> None:
    src = mkfile(fs, b"src")
    fs.write(src, 0, b"a" * BLOCK)
    fs.write(src, 10 * BLOCK, b"b" * BLOCK)
    fs.setattr(src, size=20 * BLOCK)  # ends in a hole
    dst = mkfile(fs, b"dst")
    assert ext(fs).copy(src, 0, dst, 0, 20 * BLOCK, 0) == 20 * BLOCK
    assert fs.node(dst).size == 20 * BLOCK
    assert sorted(fs.node(dst).blocks) == [0, 10]
    assert content(fs, dst) == content(fs, src)
    # A hole copied over data writes zeros.
    other = mkfile(fs, b"other", b"o" * 3 * BLOCK)
    assert ext(fs).copy(src, BLOCK, other, 0, BLOCK, 0) == BLOCK
    assert content(fs, other) == bytes(BLOCK) + b"o" * 2 * BLOCK


@pytest.mark.parametrize(("args", "code"), [
    ((0, 0, BLOCK, 1), errno.EINVAL),  # flags must be 0
    ((-1, 0, BLOCK, 0), errno.EINVAL),
    ((0, 100, BLOCK, 0), errno.EINVAL),  # overlapping ranges of one file
])
def test_bad_copy_file_range_calls(fs: Filesystem, args: tuple[int, int, int, int], code: int) -> None:
    ino = mkfile(fs, b"f", os.urandom(3 * BLOCK))
    off_in, off_out, length, flags = args
    with pytest.raises(FsError) as e:
        ext(fs).copy(ino, off_in, ino, off_out, length, flags)
    assert e.value.errno == code


def test_copy_file_range_when_the_pool_fills(fs: Filesystem) -> None:
    src = mkfile(fs, b"src", os.urandom(4 * BLOCK))
    dst = mkfile(fs, b"dst")
    durable(fs)
    filler = mkfile(fs, b"filler")
    ext(fs).fallocate(filler, 0, 0, (free_blocks(fs) - 2) * BLOCK)
    n = ext(fs).copy(src, 0, dst, 0, 4 * BLOCK, 0)
    assert n == 2 * BLOCK  # short, as a write would be
    with pytest.raises(FsError) as e:
        ext(fs).copy(src, n, dst, n, 4 * BLOCK, 0)
    assert e.value.errno == errno.ENOSPC
    assert content(fs, dst) == content(fs, src)[:n]


# ------------------------------------------------------------------ the log entry


def test_older_code_refuses_the_unmap_entry_cleanly(fs: Filesystem, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool holding UNMAP, mounted by code that knows no tag 11, is refused with a
    PoolFormatError naming the tag (what the mount reports), not replayed wrongly."""
    ino = mkfile(fs, b"f", os.urandom(4 * BLOCK))
    ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, BLOCK, BLOCK)
    durable(fs)
    monkeypatch.delitem(R._FIXED, R.T_UNMAP)
    with pytest.raises(PoolFormatError, match="unknown entry tag 11"):
        reopen(bytearray(fs.buf))
    assert "unknown entry tag 11" in " ".join(check(fs.buf)["problems"])


# ------------------------------------------------------------------ crashes


class RangeWorkload(Workload):
    """Writes, truncates and the range operations on a few files, with durability points;
    the block maps after each operation are recorded beside the trees."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        for i in range(3):
            ino = self.fs.create(ROOT_INO, b"f%d" % i, REG, 0, 0).ino
            self.fs.write(ino, 0, os.urandom(16 * BLOCK))
        self.durable()
        # The media starts as the pool is now (all of it durable).
        self.p.formatted, self.p.calls = bytes(self.fs.buf), []
        self.maps: list[dict[int, frozenset[int]]] = []
        self.states, self.synced = [], []
        self.record(True)

    def record(self, synced: bool) -> None:
        from mempool import tree
        self.states.append(tree(self.fs))
        self.synced.append(synced)
        self.maps.append(maps(self.fs))

    def step(self) -> None:
        fs, rng = self.fs, self.rng
        self.p.tag = len(self.states)
        files = sorted(n.ino for n in fs.inodes.values() if n.is_reg)
        a, b = rng.choice(files), rng.choice(files)
        off = rng.randrange(0, 12 * BLOCK)
        n = rng.choice((1, 100, BLOCK, 3 * BLOCK + 17, 6 * BLOCK))
        ops: list[tuple[int, Callable[[], object]]] = [
            (5, lambda: fs.write(a, off, os.urandom(n))),
            (1, lambda: fs.setattr(a, size=rng.randrange(0, 14 * BLOCK))),
            (2, lambda: falloc(fs, a, rng.choice((0, KEEP_SIZE)), off, n)),
            (3, lambda: falloc(fs, a, PUNCH_HOLE | KEEP_SIZE, off, n)),
            (2, lambda: falloc(fs, a, ZERO_RANGE | rng.choice((0, KEEP_SIZE)), off, n)),
            (2, lambda: ext(fs).copy(a, rng.randrange(0, 8 * BLOCK), b, off, n, 0)),
            (3, self.durable),
        ]
        op = rng.choices([o for _, o in ops], [w for w, _ in ops])[0]
        try:
            op()
        except FsError:
            pass
        self.record(op == self.durable)
        if rng.random() < 0.05:
            self.buffers[len(self.states) - 1] = bytearray(fs.buf)

    def check_crash(self, media: bytearray, lo: int, hi: int, what: str) -> None:
        super().check_crash(media, lo, hi, what)
        crashed = reopen(media)[0]
        got = maps(crashed)
        assert any(self.maps[i] == got for i in range(lo, hi + 1)), f"{what}: block maps"
        # Never a hole where bytes other than zeros read back.
        for ino, node in crashed.inodes.items():
            if node.is_reg:
                for kind, a, z in seek_map(crashed, ino):
                    if kind == "hole":
                        assert crashed.read(ino, a, z - a) == bytes(z - a), f"{what}: hole at {a}"


def maps(fs: Filesystem) -> dict[int, frozenset[int]]:
    return {ino: frozenset(n.blocks) for ino, n in fs.inodes.items() if n.is_reg}


@pytest.mark.parametrize("seed", range(5))
def test_crash_at_any_persist_call_with_range_operations(seed: int) -> None:
    w = RangeWorkload(seed)
    w.run(120)
    assert sum(w.synced) > 5
    assert crash_everywhere(w, seed) > 5


@pytest.mark.parametrize("seed", range(2))
def test_crash_with_evicted_cache_lines_and_range_operations(seed: int) -> None:
    """Lines stored but not persisted (zeroed, punched edges, copies) may reach the media
    anyway: the state is still one the program went through."""
    w = RangeWorkload(200 + seed)
    w.run(120)
    crash_with_evictions(w, seed)


def test_crash_after_punch_and_reuse_never_shows_another_files_data() -> None:
    """Punched blocks given to another file: a crash at any point shows f's hole (or its
    old data, before the punch was durable), never g's bytes in f."""
    fs, p = new_fs()
    f = mkfile(fs, b"f", b"F" * (4 * BLOCK))
    g = mkfile(fs, b"g")
    durable(fs)
    falloc(fs, g, 0, 0, free_blocks(fs) * BLOCK)
    durable(fs)
    start = len(p.calls)
    ext(fs).fallocate(f, PUNCH_HOLE | KEEP_SIZE, 0, 4 * BLOCK)
    try:
        fs.write(g, fs.node(g).size, b"G" * (4 * BLOCK))
    except NeedSync:
        durable(fs)
        fs.write(g, fs.node(g).size, b"G" * (4 * BLOCK))
    durable(fs)
    for k in range(start, len(p.calls) + 1):
        crashed = reopen(p.media(k))[0]
        body = content(crashed, f)
        assert body in (b"F" * (4 * BLOCK), bytes(4 * BLOCK)), k
        assert check(memoryview(bytes(p.media(k))))["clean"]
    assert content(crashed, f) == bytes(4 * BLOCK) and not crashed.node(f).blocks


def test_random_ranges_match_a_model() -> None:
    """Every operation against a bytearray model of the file, then a remount."""
    fs = new_fs()[0]
    ino = mkfile(fs, b"f")
    model = bytearray()
    rng = random.Random(5)
    for _ in range(300):
        off = rng.randrange(0, 20 * BLOCK)
        n = rng.randrange(1, 5 * BLOCK)
        kind = rng.randrange(5)
        if kind == 0:
            data = os.urandom(n)
            fs.write(ino, off, data)
            model[len(model):] = bytes(max(0, off + n - len(model)))
            model[off: off + n] = data
        elif kind == 1:
            falloc(fs, ino, PUNCH_HOLE | KEEP_SIZE, off, n)
            stop = min(off + n, len(model))
            if off < stop:
                model[off: stop] = bytes(stop - off)
        elif kind == 2:
            mode = rng.choice((0, KEEP_SIZE, ZERO_RANGE, ZERO_RANGE | KEEP_SIZE))
            falloc(fs, ino, mode, off, n)
            if mode & ZERO_RANGE:
                stop = min(off + n, len(model))
                if off < stop:
                    model[off: stop] = bytes(stop - off)
            if not mode & KEEP_SIZE and off + n > len(model):
                model[len(model):] = bytes(off + n - len(model))
        elif kind == 3:
            size = rng.randrange(0, 20 * BLOCK)
            fs.setattr(ino, size=size)
            model[size:] = b""
            model[len(model):] = bytes(size - len(model))
        else:
            if rng.random() < 0.3:
                durable(fs)
        assert content(fs, ino) == bytes(model)
    fs2 = remount(fs)
    assert content(fs2, ino) == bytes(model)
    assert check(fs2.buf)["clean"]


def test_seek_data_across_a_hole_longer_than_the_file_has_blocks(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", b"a" * 2 * BLOCK)
    fs.write(ino, 1_000_000 * BLOCK, b"z")
    fs.write(ino, 3_000_000 * BLOCK, b"y")
    assert ext(fs).seek(ino, 2 * BLOCK, SEEK_DATA) == 1_000_000 * BLOCK
    assert ext(fs).seek(ino, 1_000_000 * BLOCK + 1, SEEK_HOLE) == 1_000_001 * BLOCK
    assert ext(fs).seek(ino, 1_000_001 * BLOCK, SEEK_DATA) == 3_000_000 * BLOCK
    assert ext(fs).seek(ino, 5, SEEK_HOLE) == 2 * BLOCK


def test_times_of_range_operations(fs: Filesystem) -> None:
    """As ext4: allocating changes ctime, and mtime only when the size grows; punching,
    zeroing and copying into a file change both. Never backwards, even with a clock set back."""
    ino = mkfile(fs, b"f", os.urandom(4 * BLOCK))
    node = fs.node(ino)
    node.mtime = node.ctime = 1 << 62  # a clock far ahead, set back since
    ext(fs).fallocate(ino, KEEP_SIZE, 0, 8 * BLOCK)
    assert node.mtime == 1 << 62 and node.ctime > 1 << 62
    for call in (lambda: ext(fs).fallocate(ino, 0, 0, 9 * BLOCK),
                 lambda: ext(fs).fallocate(ino, PUNCH_HOLE | KEEP_SIZE, 0, BLOCK),
                 lambda: ext(fs).fallocate(ino, ZERO_RANGE | KEEP_SIZE, 0, BLOCK),
                 lambda: ext(fs).copy(ino, 2 * BLOCK, ino, 0, 10, 0)):
        before = node.ctime
        call()
        assert node.ctime > before and node.mtime == node.ctime
