"""The filesystem's operations over a pool in memory: what they do, the errors they give, and
that what they did is still there after a remount.

No FUSE here: these call rpmemfs.fs.filesystem.Filesystem the way the FUSE edge does.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
from mempool import durable, new_fs, reopen, tree

from rpmemfs.fs.filesystem import NAME_MAX, Filesystem, FsError, NeedSync
from rpmemfs.fs.replay import ROOT_INO
from rpmemfs.pool.layout import BLOCK

ROOT = ROOT_INO
REG = stat.S_IFREG | 0o644
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


@pytest.fixture
def fs() -> Filesystem:
    return new_fs()[0]


def mkfile(fs: Filesystem, name: bytes, data: bytes = b"", parent: int = ROOT) -> int:
    ino = fs.create(parent, name, REG, 1000, 1000).ino
    if data:
        assert fs.write(ino, 0, data) == len(data)
    return ino


def content(fs: Filesystem, ino: int) -> bytes:
    return fs.read(ino, 0, fs.node(ino).size)


def err(exc: pytest.ExceptionInfo[FsError]) -> int | None:
    return exc.value.errno


def remount(fs: Filesystem) -> Filesystem:
    """The pool as the next mount sees it after a clean durability point."""
    durable(fs)
    return reopen(bytearray(fs.buf))[0]


# ------------------------------------------------------------------ data


def test_write_read_across_blocks_and_offsets(fs: Filesystem) -> None:
    data = os.urandom(3 * BLOCK + 123)
    ino = mkfile(fs, b"f", data)
    assert content(fs, ino) == data
    assert fs.read(ino, BLOCK - 10, 20) == data[BLOCK - 10: BLOCK + 10]
    assert fs.read(ino, len(data) - 5, 100) == data[-5:]  # short read at the end
    assert fs.read(ino, len(data), 10) == b""
    fs.write(ino, 100, b"patch")  # in place, inside one block
    data = data[:100] + b"patch" + data[105:]
    assert content(fs, ino) == data
    assert remount(fs).read(ino, 0, len(data)) == data


def test_sparse_file_reads_zeros_in_holes(fs: Filesystem) -> None:
    ino = mkfile(fs, b"sparse")
    fs.write(ino, 10 * BLOCK + 7, b"end")
    fs.write(ino, 3, b"start")
    node = fs.node(ino)
    assert node.size == 10 * BLOCK + 10
    assert sorted(node.blocks) == [0, 10]  # the hole allocates nothing
    want = bytes(3) + b"start" + bytes(10 * BLOCK + 7 - 8) + b"end"
    assert content(fs, ino) == want
    assert content(remount(fs), ino) == want


def test_truncate_shrinks_frees_and_zeroes_what_comes_back(fs: Filesystem) -> None:
    ino = mkfile(fs, b"t", b"\xff" * (4 * BLOCK))
    free0 = fs.statfs()["bfree"]
    fs.setattr(ino, size=BLOCK + 10)
    assert fs.node(ino).size == BLOCK + 10
    assert sorted(fs.node(ino).blocks) == [0, 1]
    durable(fs)
    assert fs.statfs()["bfree"] == free0 + 2  # reusable once the truncation is durable
    # Growing again shows zeros, not the bytes that were cut off.
    fs.setattr(ino, size=3 * BLOCK)
    assert content(fs, ino) == b"\xff" * (BLOCK + 10) + bytes(2 * BLOCK - 10)
    # A write past the end zeroes the gap in the old last block too.
    fs.setattr(ino, size=5)
    fs.write(ino, 20, b"x")
    assert content(fs, ino) == b"\xff" * 5 + bytes(15) + b"x"
    again = remount(fs)
    assert content(again, ino) == b"\xff" * 5 + bytes(15) + b"x"


def test_truncate_errors(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    with pytest.raises(FsError) as e:
        fs.setattr(d, size=10)
    assert err(e) == errno.EISDIR
    ino = mkfile(fs, b"f")
    with pytest.raises(FsError) as e:
        fs.setattr(ino, size=1 << 51)
    assert err(e) == errno.EFBIG


# ------------------------------------------------------------------ namespace


def test_create_lookup_and_eexist(fs: Filesystem) -> None:
    ino = mkfile(fs, b"a")
    assert fs.lookup(ROOT, b"a").ino == ino
    for make in (lambda: fs.create(ROOT, b"a", REG, 0, 0), lambda: fs.mkdir(ROOT, b"a", 0o755, 0, 0),
                 lambda: fs.symlink(ROOT, b"a", b"x", 0, 0), lambda: fs.link(ino, ROOT, b"a")):
        with pytest.raises(FsError) as e:
            make()
        assert err(e) == errno.EEXIST
    with pytest.raises(FsError) as e:
        fs.lookup(ROOT, b"missing")
    assert err(e) == errno.ENOENT


def test_names_too_long_or_invalid(fs: Filesystem) -> None:
    ok = b"n" * NAME_MAX
    mkfile(fs, ok)
    long = b"n" * (NAME_MAX + 1)
    for call in (lambda: fs.create(ROOT, long, REG, 0, 0), lambda: fs.mkdir(ROOT, long, 0o755, 0, 0),
                 lambda: fs.lookup(ROOT, long), lambda: fs.rename(ROOT, ok, ROOT, long),
                 lambda: fs.symlink(ROOT, b"s", b"t" * 4096, 0, 0)):
        with pytest.raises(FsError) as e:
            call()
        assert err(e) == errno.ENAMETOOLONG
    for bad in (b"", b"a/b", b".", b".."):
        with pytest.raises(FsError) as e:
            fs.create(ROOT, bad, REG, 0, 0)
        assert err(e) == errno.EINVAL
    assert list(remount(fs).node(ROOT).children or {}) == [ok]


def test_unlink_rmdir_and_their_errors(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    f = mkfile(fs, b"f", b"data", parent=d)
    assert fs.node(ROOT).nlink == 3
    with pytest.raises(FsError) as e:
        fs.rmdir(ROOT, b"d")
    assert err(e) == errno.ENOTEMPTY
    with pytest.raises(FsError) as e:
        fs.unlink(ROOT, b"d")
    assert err(e) == errno.EISDIR
    with pytest.raises(FsError) as e:
        fs.rmdir(d, b"f")
    assert err(e) == errno.ENOTDIR
    fs.unlink(d, b"f")
    assert f not in fs.inodes  # no name, not open: gone
    fs.rmdir(ROOT, b"d")
    assert fs.node(ROOT).nlink == 2
    with pytest.raises(FsError) as e:
        fs.unlink(ROOT, b"d")
    assert err(e) == errno.ENOENT
    assert tree(remount(fs)).keys() == {""}


def test_hard_links_count_and_outlive_names(fs: Filesystem) -> None:
    ino = mkfile(fs, b"a", b"shared")
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    fs.link(ino, d, b"b")
    assert fs.node(ino).nlink == 2
    with pytest.raises(FsError) as e:
        fs.link(d, ROOT, b"dirlink")
    assert err(e) == errno.EPERM
    fs.unlink(ROOT, b"a")
    assert fs.node(ino).nlink == 1
    again = remount(fs)
    assert again.lookup(d, b"b").ino == ino
    assert content(again, ino) == b"shared"
    assert again.node(ino).nlink == 1


def test_rename_moves_replaces_and_exchanges(fs: Filesystem) -> None:
    a = fs.mkdir(ROOT, b"a", 0o755, 0, 0).ino
    b = fs.mkdir(ROOT, b"b", 0o755, 0, 0).ino
    f = mkfile(fs, b"f", b"one", parent=a)
    g = mkfile(fs, b"g", b"two", parent=b)
    fs.rename(a, b"f", b, b"f2")
    assert fs.lookup(b, b"f2").ino == f
    with pytest.raises(FsError) as e:
        fs.lookup(a, b"f")
    assert err(e) == errno.ENOENT
    # Replacing a file drops the old one.
    fs.rename(b, b"f2", b, b"g")
    assert fs.lookup(b, b"g").ino == f and g not in fs.inodes
    # A directory moves with its '..'.
    fs.rename(ROOT, b"a", b, b"a")
    assert fs.node(a).parent == b and fs.lookup(a, b"..").ino == b
    assert fs.node(b).nlink == 3 and fs.node(ROOT).nlink == 3
    # Exchange swaps two names atomically.
    h = mkfile(fs, b"h", b"three")
    fs.rename(ROOT, b"h", b, b"g", RENAME_EXCHANGE)
    assert fs.lookup(ROOT, b"h").ino == f and fs.lookup(b, b"g").ino == h
    again = remount(fs)
    assert tree(again) == tree(fs)
    assert content(again, f) == b"one" and content(again, h) == b"three"


def test_rename_errors(fs: Filesystem) -> None:
    a = fs.mkdir(ROOT, b"a", 0o755, 0, 0).ino
    sub = fs.mkdir(a, b"sub", 0o755, 0, 0).ino
    mkfile(fs, b"x", parent=sub)
    mkfile(fs, b"f")
    mkfile(fs, b"g")
    fs.mkdir(ROOT, b"empty", 0o755, 0, 0)
    cases = [
        ((ROOT, b"a", sub, b"in"), 0, errno.EINVAL),  # into its own subtree
        ((ROOT, b"f", ROOT, b"g"), RENAME_NOREPLACE, errno.EEXIST),
        ((ROOT, b"f", ROOT, b"nothing"), RENAME_EXCHANGE, errno.ENOENT),
        ((ROOT, b"f", ROOT, b"g"), RENAME_EXCHANGE | RENAME_NOREPLACE, errno.EINVAL),
        ((ROOT, b"empty", a, b"sub"), 0, errno.ENOTEMPTY),
        ((ROOT, b"empty", ROOT, b"f"), 0, errno.ENOTDIR),
        ((ROOT, b"f", ROOT, b"empty"), 0, errno.EISDIR),
        ((ROOT, b"missing", ROOT, b"z"), 0, errno.ENOENT),
    ]
    before = tree(fs)
    for args, flags, want in cases:
        with pytest.raises(FsError) as e:
            fs.rename(*args, flags)
        assert err(e) == want, (args, flags)
    assert tree(fs) == before  # a refused rename changes nothing


def test_symlink_and_readdir(fs: Filesystem) -> None:
    s = fs.symlink(ROOT, b"link", b"/some/target", 0, 0)
    assert stat.S_ISLNK(s.mode) and s.target == b"/some/target" and s.size == len(b"/some/target")
    mkfile(fs, b"f")
    assert sorted(n for n, _ in fs.readdir(ROOT)) == [b"f", b"link"]
    with pytest.raises(FsError) as e:
        fs.readdir(s.ino)
    assert err(e) == errno.ENOTDIR
    assert remount(fs).node(s.ino).target == b"/some/target"


def test_setattr_mode_owner_times(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f")
    fs.setattr(ino, mode=0o4711, uid=5, gid=6, atime=111, mtime=222)
    node = fs.node(ino)
    assert (node.mode, node.uid, node.gid, node.atime, node.mtime) == (stat.S_IFREG | 0o4711, 5, 6, 111, 222)
    n2 = remount(fs).node(ino)
    assert (n2.mode, n2.uid, n2.gid, n2.atime, n2.mtime) == (stat.S_IFREG | 0o4711, 5, 6, 111, 222)


# ------------------------------------------------------------------ xattrs


def test_xattrs_set_get_remove(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f")
    fs.setxattr(ino, b"user.a", b"1")
    fs.setxattr(ino, b"user.b", b"\x00" * 1000)
    fs.setxattr(ino, b"user.a", b"replaced")
    assert fs.getxattr(ino, b"user.a") == b"replaced"
    assert fs.getxattr(ino, b"user.none") is None
    fs.removexattr(ino, b"user.b")
    with pytest.raises(FsError) as e:
        fs.removexattr(ino, b"user.b")
    assert err(e) == errno.ENODATA
    with pytest.raises(FsError) as e:
        fs.setxattr(ino, b"u" * 256, b"")
    assert err(e) == errno.ERANGE
    with pytest.raises(FsError) as e:
        fs.setxattr(ino, b"user.big", bytes(65537))
    assert err(e) == errno.E2BIG
    assert remount(fs).node(ino).xattrs == {b"user.a": b"replaced"}


# ------------------------------------------------------------------ running out of space


def test_enospc_when_data_blocks_run_out_and_space_after_unlink(fs: Filesystem) -> None:
    blocks = fs.statfs()["bfree"]
    big = mkfile(fs, b"big")
    fs.write(big, 0, b"\x01" * ((blocks - 1) * BLOCK))
    other = mkfile(fs, b"other", b"\x02" * BLOCK)  # the last block
    assert fs.statfs()["bfree"] == 0
    with pytest.raises(FsError) as e:
        fs.write(other, BLOCK, b"more")
    assert err(e) == errno.ENOSPC
    assert fs.node(other).size == BLOCK  # the failed write changed nothing
    fs.unlink(ROOT, b"big")
    # The blocks come free only when the unlink is durable: until then the write asks for
    # a durability point (the FUSE edge makes one and retries).
    with pytest.raises(NeedSync):
        fs.write(other, BLOCK, b"more")
    durable(fs)
    assert fs.write(other, BLOCK, b"more") == 4
    assert fs.statfs()["bfree"] == blocks - 2
    again = remount(fs)
    assert content(again, other) == b"\x02" * BLOCK + b"more"
    assert again.statfs()["bfree"] == blocks - 2


def test_enospc_when_the_metadata_area_fills(fs: Filesystem) -> None:
    """Metadata that fits no log area (even after a checkpoint) is refused, not lost."""
    ino = mkfile(fs, b"f")
    value = bytes(60_000)
    stored = 0
    with pytest.raises(FsError) as e:
        for i in range(100):
            fs.setxattr(ino, b"user.%d" % i, value)
            stored += 1
    assert err(e) == errno.ENOSPC
    assert stored >= 2
    assert remount(fs).node(ino).xattrs == {b"user.%d" % i: value for i in range(stored)}
    with pytest.raises(FsError) as e:
        fs.create(ROOT, b"new", REG, 0, 0)
    assert err(e) == errno.ENOSPC
    # Removing the attributes makes room again, for the next mount at least (this one
    # keeps refusing new inodes until a checkpoint measures the smaller snapshot).
    for i in range(stored):
        fs.removexattr(ino, b"user.%d" % i)
    again = remount(fs)
    assert again.node(ino).xattrs == {}
    mkfile(again, b"new", b"ok")
    assert content(remount(again), again.lookup(ROOT, b"new").ino) == b"ok"


# ------------------------------------------------------------------ open files and orphans


def test_unlinked_open_file_lives_until_released(fs: Filesystem) -> None:
    ino = mkfile(fs, b"f", b"still here" * 1000)
    free = fs.statfs()["bfree"]
    fs.opened(ino)
    fs.unlink(ROOT, b"f")
    assert content(fs, ino) == b"still here" * 1000  # readable through the open handle
    fs.released(ino)
    assert ino not in fs.inodes
    durable(fs)
    assert fs.statfs()["bfree"] == free + 3


def test_open_files_counts_every_open_until_released(fs: Filesystem) -> None:
    """What a detached mount waits on (fuse.handles_open): kept as files open and close,
    unlinked ones included, so it is never a walk over every inode."""
    a, b = mkfile(fs, b"a", b"1"), mkfile(fs, b"b", b"2")
    for ino in (a, a, b):
        fs.opened(ino)
    assert fs.open_files == 3
    fs.unlink(ROOT, b"b")
    fs.released(a)
    assert fs.open_files == 2 == sum(node.opens for node in fs.inodes.values())
    fs.released(b)  # the last handle of an unlinked file: the inode goes
    fs.released(a)
    assert b not in fs.inodes
    assert fs.open_files == 0


def test_orphans_are_reclaimed_on_reopen(fs: Filesystem) -> None:
    """A file unlinked while open when the node crashed is freed by the next mount."""
    ino = mkfile(fs, b"f", b"x" * (5 * BLOCK))
    mkfile(fs, b"keep", b"kept")
    fs.opened(ino)
    fs.unlink(ROOT, b"f")
    durable(fs)  # the unlink is durable, the inode still held
    free_before = fs.statfs()["bfree"]
    again, persister = reopen(bytearray(fs.buf))
    assert ino not in again.inodes
    assert again.statfs()["bfree"] == free_before + 5
    # The reclaim is a log record like any other: the first durability point makes it
    # durable (and carries it to replicas, when there are any)...
    assert not persister.calls
    durable(again)
    assert persister.calls
    # ...so the mount after that finds nothing to reclaim and the same free space.
    third = reopen(bytearray(again.buf))[0]
    assert third.statfs()["bfree"] == free_before + 5
    assert tree(third) == tree(again)
