"""POSIX semantics through a real rpmemfs FUSE mount: ordinary syscalls only."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import stat
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import MakePool, MountPool
from helpers import (
    BLOCK,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    MiB,
    Mount,
    assert_check_clean,
    check_json,
    diff_snapshots,
    file_sha256,
    fsync_path,
    renameat2,
    snapshot,
    status_json,
    wait_until,
)


def expect_errno(code: int, func: Callable[..., object], *args: object, **kwargs: object) -> OSError:
    with pytest.raises(OSError) as info:
        func(*args, **kwargs)
    assert info.value.errno == code, (
        f"{func.__name__}{args}: expected {errno.errorcode[code]}, "
        f"got {errno.errorcode.get(info.value.errno or 0)} ({info.value})"
    )
    return info.value


def read_all(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pattern(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------ regular files


def test_create_write_read(mnt: Mount) -> None:
    p = mnt.path / "hello.txt"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    assert os.write(fd, b"hello, world\n") == 13
    os.close(fd)
    assert read_all(p) == b"hello, world\n"
    st = os.stat(p)
    assert stat.S_ISREG(st.st_mode)
    assert st.st_size == 13
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert os.listdir(mnt.path) == ["hello.txt"]


def test_empty_file(mnt: Mount) -> None:
    p = mnt.path / "empty"
    p.touch()
    assert os.stat(p).st_size == 0
    assert read_all(p) == b""


def test_write_at_offsets_and_overwrite(mnt: Mount) -> None:
    p = mnt.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        expected = bytearray()

        def pwrite(data: bytes, off: int) -> None:
            assert os.pwrite(fd, data, off) == len(data)
            if off > len(expected):
                expected.extend(b"\0" * (off - len(expected)))
            expected[off : off + len(data)] = data

        pwrite(pattern(10000, 1), 0)
        pwrite(b"X" * 100, 4090)  # crosses a block boundary
        pwrite(pattern(3 * BLOCK, 2), BLOCK)  # whole aligned blocks
        pwrite(b"tail", 20000)  # extends with a hole
        pwrite(b"Y", 0)
        pwrite(pattern(777, 3), 12345)
        assert os.fstat(fd).st_size == len(expected) == 20004
        assert os.pread(fd, len(expected) + 100, 0) == bytes(expected)
        # unaligned reads
        for off, n in [(1, 5), (4095, 2), (4096, 4096), (10000, 7000), (19999, 100)]:
            assert os.pread(fd, n, off) == bytes(expected[off : off + n]), (off, n)
    finally:
        os.close(fd)
    assert read_all(p) == bytes(expected)


def test_sparse_holes_read_as_zeros(mnt: Mount) -> None:
    p = mnt.path / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, b"start", 0)
        os.pwrite(fd, b"middle", 3 * MiB + 17)
        os.pwrite(fd, b"end", 8 * MiB)
        os.fsync(fd)
        assert os.fstat(fd).st_size == 8 * MiB + 3
        data = os.pread(fd, 9 * MiB, 0)
    finally:
        os.close(fd)
    assert len(data) == 8 * MiB + 3
    assert data[:5] == b"start"
    assert data[3 * MiB + 17 : 3 * MiB + 23] == b"middle"
    assert data[-3:] == b"end"
    assert data.count(0) == len(data) - 14
    # seeking past EOF and writing leaves a hole too
    with open(p, "r+b") as f:
        f.seek(10 * MiB)
        f.write(b"!")
    assert os.stat(p).st_size == 10 * MiB + 1
    with open(p, "rb") as f:
        f.seek(8 * MiB)
        rest = f.read()
    assert rest == b"end" + b"\0" * (2 * MiB - 3) + b"!"


def test_o_append(mnt: Mount) -> None:
    p = mnt.path / "log"
    p.write_bytes(b"first\n")
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"second\n")
        os.lseek(fd, 2, os.SEEK_SET)
        os.write(fd, b"third\n")
    finally:
        os.close(fd)
    with open(p, "ab") as f:
        f.write(b"fourth\n")
    assert read_all(p) == b"first\nsecond\nthird\nfourth\n"


def test_o_trunc(mnt: Mount) -> None:
    p = mnt.path / "t"
    p.write_bytes(pattern(50000, 4))
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"short")
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 5
    assert read_all(p) == b"short"
    # after truncation, extending again must not resurrect the old bytes
    with open(p, "r+b") as f:
        f.truncate(50000)
    assert read_all(p) == b"short" + b"\0" * 49995


def test_large_write_read_back(mnt: Mount) -> None:
    p = mnt.path / "big"
    data = pattern(5 * MiB + 123, 5)
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        assert os.write(fd, data) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == len(data)
    assert read_all(p) == data
    # read in odd-sized chunks
    got = bytearray()
    with open(p, "rb", buffering=0) as f:
        while chunk := f.read(131071):
            got += chunk
    assert bytes(got) == data


def test_ftruncate_down_and_up(mnt: Mount) -> None:
    p = mnt.path / "tr"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"\xab" * 20000)
        os.ftruncate(fd, 5000)
        assert os.fstat(fd).st_size == 5000
        assert os.pread(fd, 30000, 0) == b"\xab" * 5000
        os.ftruncate(fd, 12000)
        assert os.fstat(fd).st_size == 12000
        assert os.pread(fd, 30000, 0) == b"\xab" * 5000 + b"\0" * 7000
        # shrink to a block boundary and below a block, then grow by writing past EOF
        os.ftruncate(fd, 4096)
        os.ftruncate(fd, 100)
        os.pwrite(fd, b"Z", 9000)
        assert os.pread(fd, 30000, 0) == b"\xab" * 100 + b"\0" * 8900 + b"Z"
        os.ftruncate(fd, 0)
        assert os.pread(fd, 10, 0) == b""
        os.fsync(fd)
    finally:
        os.close(fd)
    os.truncate(p, 3)
    assert read_all(p) == b"\0\0\0"


def test_truncate_persists_zeros_after_remount(mnt: Mount) -> None:
    p = mnt.path / "tz"
    with open(p, "wb") as f:
        f.write(b"\xcd" * 3 * BLOCK)
        f.flush()
        os.fsync(f.fileno())
        f.truncate(BLOCK + 10)
        f.truncate(3 * BLOCK)
        os.fsync(f.fileno())
    mnt.remount()
    assert read_all(p) == b"\xcd" * (BLOCK + 10) + b"\0" * (2 * BLOCK - 10)


# -------------------------------------------------------------------- directories


def test_mkdir_readdir_nested_rmdir(mnt: Mount) -> None:
    root = mnt.path
    os.mkdir(root / "a")
    os.makedirs(root / "a" / "b" / "c" / "d")
    (root / "a" / "f1").write_bytes(b"1")
    (root / "a" / "b" / "f2").write_bytes(b"22")
    assert sorted(os.listdir(root / "a")) == ["b", "f1"]
    assert os.listdir(root / "a" / "b" / "c") == ["d"]
    assert (root / "a" / "b" / "f2").read_bytes() == b"22"
    with os.scandir(root / "a") as it:
        kinds = {e.name: (e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False))
                 for e in it}
    assert kinds == {"b": (True, False), "f1": (False, True)}
    assert stat.S_ISDIR(os.stat(root / "a" / "b" / "c" / "d").st_mode)
    os.rmdir(root / "a" / "b" / "c" / "d")
    assert os.listdir(root / "a" / "b" / "c") == []
    os.removedirs(root / "a" / "b" / "c")  # removes c, stops at b (not empty)
    assert sorted(os.listdir(root / "a" / "b")) == ["f2"]


def test_large_directory_listing(mnt: Mount) -> None:
    d = mnt.path / "many"
    d.mkdir()
    names = sorted(f"entry-{i:05d}-{'x' * (i % 40)}" for i in range(1500))
    for n in names:
        (d / n).touch()
    listed = os.listdir(d)
    assert len(listed) == len(names)
    assert sorted(listed) == names
    for n in names[:700]:
        os.unlink(d / n)
    assert sorted(os.listdir(d)) == names[700:]
    mnt.remount()
    assert sorted(os.listdir(d)) == names[700:]


def test_dir_link_counts(mnt: Mount) -> None:
    root = mnt.path
    base = os.stat(root).st_nlink
    assert base == 2
    os.mkdir(root / "d")
    assert os.stat(root / "d").st_nlink == 2
    assert os.stat(root).st_nlink == base + 1
    os.mkdir(root / "d" / "s1")
    os.mkdir(root / "d" / "s2")
    (root / "d" / "file").touch()
    assert os.stat(root / "d").st_nlink == 4  # '.', entry in root, two '..'
    assert os.stat(root / "d" / ".").st_ino == os.stat(root / "d").st_ino
    assert os.stat(root / "d" / "s1" / "..").st_ino == os.stat(root / "d").st_ino
    os.rename(root / "d" / "s2", root / "s2")  # moving a dir moves its '..'
    assert os.stat(root / "s2" / "..").st_ino == os.stat(root).st_ino
    assert os.stat(root / "d").st_nlink == 3
    assert os.stat(root).st_nlink == base + 2
    os.rmdir(root / "d" / "s1")
    assert os.stat(root / "d").st_nlink == 2
    os.rmdir(root / "s2")
    assert os.stat(root).st_nlink == base + 1
    mnt.remount()
    assert os.stat(root).st_nlink == base + 1
    assert os.stat(root / "d").st_nlink == 2


# ------------------------------------------------------------------------ symlinks


def test_symlinks(mnt: Mount) -> None:
    root = mnt.path
    (root / "target").write_bytes(b"pointed-to")
    os.symlink("target", root / "rel")
    os.symlink(str(root / "target"), root / "abs")
    long_target = "x/" * 500 + "end"
    os.symlink(long_target, root / "long")
    assert os.readlink(root / "rel") == "target"
    assert os.readlink(root / "abs") == str(root / "target")
    assert os.readlink(root / "long") == long_target
    lst = os.lstat(root / "rel")
    assert stat.S_ISLNK(lst.st_mode)
    assert lst.st_size == len("target")
    assert os.lstat(root / "long").st_size == len(long_target)
    assert (root / "rel").read_bytes() == b"pointed-to"
    assert (root / "abs").read_bytes() == b"pointed-to"
    assert stat.S_ISREG(os.stat(root / "rel").st_mode)
    # writing through a symlink writes the target
    with open(root / "rel", "ab") as f:
        f.write(b"!")
    assert (root / "target").read_bytes() == b"pointed-to!"
    # symlink to a directory
    os.mkdir(root / "dir")
    (root / "dir" / "inner").write_bytes(b"in")
    os.symlink("dir", root / "dirlink")
    assert (root / "dirlink" / "inner").read_bytes() == b"in"
    assert sorted(os.listdir(root / "dirlink")) == ["inner"]
    expect_errno(errno.EEXIST, os.symlink, "whatever", root / "rel")
    mnt.remount()
    assert os.readlink(root / "long") == long_target
    assert (root / "rel").read_bytes() == b"pointed-to!"


def test_dangling_symlink(mnt: Mount) -> None:
    link = mnt.path / "dangling"
    os.symlink("no/such/file", link)
    assert os.path.lexists(link)
    assert not os.path.exists(link)
    assert os.readlink(link) == "no/such/file"
    expect_errno(errno.ENOENT, os.stat, link)
    expect_errno(errno.ENOENT, os.open, link, os.O_RDONLY)
    os.unlink(link)
    assert not os.path.lexists(link)


# ---------------------------------------------------------------------- hard links


def test_hard_links(mnt: Mount) -> None:
    a, b, c = mnt.path / "a", mnt.path / "b", mnt.path / "sub" / "c"
    (mnt.path / "sub").mkdir()
    a.write_bytes(b"shared content")
    os.link(a, b)
    os.link(b, c)
    sa, sb, sc = os.stat(a), os.stat(b), os.stat(c)
    assert sa.st_ino == sb.st_ino == sc.st_ino
    assert sa.st_nlink == sb.st_nlink == sc.st_nlink == 3
    with open(b, "r+b") as f:
        f.seek(7)
        f.write(b"CONTENT")
    assert a.read_bytes() == c.read_bytes() == b"shared CONTENT"
    os.chmod(c, 0o600)
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o600
    os.unlink(a)
    assert not a.exists()
    assert os.stat(b).st_nlink == 2
    assert b.read_bytes() == b"shared CONTENT"
    mnt.remount()
    assert os.stat(b).st_nlink == 2
    assert os.stat(b).st_ino == os.stat(c).st_ino
    os.unlink(b)
    assert os.stat(c).st_nlink == 1
    assert c.read_bytes() == b"shared CONTENT"
    expect_errno(errno.EEXIST, os.link, c, c)
    expect_errno(errno.EPERM, os.link, mnt.path / "sub", mnt.path / "sublink")
    expect_errno(errno.ENOENT, os.link, mnt.path / "missing", mnt.path / "x")


# -------------------------------------------------------------------------- rename


def test_rename_file_and_dir(mnt: Mount) -> None:
    r = mnt.path
    (r / "f").write_bytes(b"file")
    os.rename(r / "f", r / "g")
    assert not (r / "f").exists()
    assert (r / "g").read_bytes() == b"file"
    os.makedirs(r / "d1" / "inner")
    (r / "d1" / "inner" / "x").write_bytes(b"x")
    os.rename(r / "d1", r / "d2")
    assert (r / "d2" / "inner" / "x").read_bytes() == b"x"
    assert not (r / "d1").exists()
    os.mkdir(r / "other")
    os.rename(r / "g", r / "other" / "g2")  # across directories
    os.rename(r / "d2" / "inner", r / "other" / "inner")
    assert sorted(os.listdir(r / "other")) == ["g2", "inner"]
    assert os.listdir(r / "d2") == []
    ino = os.stat(r / "other" / "g2").st_ino
    os.rename(r / "other" / "g2", r / "other" / "g2")  # same name: no-op
    assert os.stat(r / "other" / "g2").st_ino == ino
    mnt.remount()
    assert sorted(os.listdir(r)) == ["d2", "other"]
    assert (r / "other" / "inner" / "x").read_bytes() == b"x"


def test_rename_over_existing(mnt: Mount) -> None:
    r = mnt.path
    (r / "src").write_bytes(b"new")
    (r / "dst").write_bytes(b"old old old")
    os.rename(r / "src", r / "dst")
    assert (r / "dst").read_bytes() == b"new"
    assert not (r / "src").exists()
    # over an empty directory
    os.mkdir(r / "d_src")
    (r / "d_src" / "k").write_bytes(b"k")
    os.mkdir(r / "d_empty")
    os.rename(r / "d_src", r / "d_empty")
    assert os.listdir(r / "d_empty") == ["k"]
    # over a non-empty directory, file over dir, dir over file
    os.mkdir(r / "d_full")
    (r / "d_full" / "z").touch()
    os.mkdir(r / "d_new")
    expect_errno(errno.ENOTEMPTY, os.rename, r / "d_new", r / "d_full")
    expect_errno(errno.EISDIR, os.rename, r / "dst", r / "d_full")
    expect_errno(errno.ENOTDIR, os.rename, r / "d_new", r / "dst")
    expect_errno(errno.ENOENT, os.rename, r / "missing", r / "x")
    assert sorted(os.listdir(r)) == ["d_empty", "d_full", "d_new", "dst"]


def test_rename_over_open_file_keeps_old_data_readable(mnt: Mount) -> None:
    r = mnt.path
    (r / "victim").write_bytes(b"victim data" * 1000)
    (r / "newer").write_bytes(b"newer")
    fd = os.open(r / "victim", os.O_RDONLY)
    try:
        os.rename(r / "newer", r / "victim")
        assert (r / "victim").read_bytes() == b"newer"
        assert os.pread(fd, 20000, 0) == b"victim data" * 1000
    finally:
        os.close(fd)


def test_rename_noreplace(mnt: Mount) -> None:
    r = mnt.path
    (r / "a").write_bytes(b"A")
    (r / "b").write_bytes(b"B")
    expect_errno(errno.EEXIST, renameat2, r / "a", r / "b", RENAME_NOREPLACE)
    assert (r / "a").read_bytes() == b"A" and (r / "b").read_bytes() == b"B"
    renameat2(r / "a", r / "c", RENAME_NOREPLACE)
    assert not (r / "a").exists()
    assert (r / "c").read_bytes() == b"A"


def test_rename_exchange(mnt: Mount) -> None:
    r = mnt.path
    (r / "a").write_bytes(b"A")
    os.makedirs(r / "d" / "sub")
    (r / "d" / "sub" / "x").write_bytes(b"X")
    ino_a, ino_d = os.stat(r / "a").st_ino, os.stat(r / "d").st_ino
    renameat2(r / "a", r / "d", RENAME_EXCHANGE)
    assert (r / "d").is_file() and (r / "d").read_bytes() == b"A"
    assert (r / "a").is_dir() and (r / "a" / "sub" / "x").read_bytes() == b"X"
    assert os.stat(r / "d").st_ino == ino_a and os.stat(r / "a").st_ino == ino_d
    # exchange across directories
    (r / "a" / "sub" / "y").write_bytes(b"Y")
    renameat2(r / "d", r / "a" / "sub" / "y", RENAME_EXCHANGE)
    assert (r / "d").read_bytes() == b"Y"
    assert (r / "a" / "sub" / "y").read_bytes() == b"A"
    expect_errno(errno.ENOENT, renameat2, r / "d", r / "nothing", RENAME_EXCHANGE)
    mnt.remount()
    assert (r / "d").read_bytes() == b"Y"
    assert (r / "a" / "sub" / "y").read_bytes() == b"A"
    assert (r / "a" / "sub" / "x").read_bytes() == b"X"


def test_rename_dir_into_own_subdir_einval(mnt: Mount) -> None:
    r = mnt.path
    os.makedirs(r / "p" / "c" / "g")
    expect_errno(errno.EINVAL, os.rename, r / "p", r / "p" / "c" / "g" / "p")
    expect_errno(errno.EINVAL, os.rename, r / "p", r / "p" / "inside")
    assert (r / "p" / "c" / "g").is_dir()


def test_exdev(mnt: Mount, work_dir: Path) -> None:
    (mnt.path / "f").write_bytes(b"data")
    outside = work_dir / "outside"
    expect_errno(errno.EXDEV, os.rename, mnt.path / "f", outside)
    expect_errno(errno.EXDEV, os.link, mnt.path / "f", outside)
    (work_dir / "in").write_bytes(b"x")
    expect_errno(errno.EXDEV, os.rename, work_dir / "in", mnt.path / "in")
    assert (mnt.path / "f").read_bytes() == b"data"
    assert not outside.exists()


# --------------------------------------------------------------- attributes, stat


def test_chmod(mnt: Mount) -> None:
    p = mnt.path / "f"
    p.write_bytes(b"")
    for mode in (0o600, 0o755, 0o4711, 0o2750, 0o1777, 0o000):
        os.chmod(p, mode)
        st = os.stat(p)
        assert stat.S_IMODE(st.st_mode) == mode, oct(st.st_mode)
        assert stat.S_ISREG(st.st_mode)
    os.mkdir(mnt.path / "d", 0o700)
    os.chmod(mnt.path / "d", 0o751)
    assert stat.S_IMODE(os.stat(mnt.path / "d").st_mode) == 0o751
    assert stat.S_ISDIR(os.stat(mnt.path / "d").st_mode)
    fd = os.open(mnt.path / "d" / "g", os.O_CREAT | os.O_WRONLY, 0o640)
    os.fchmod(fd, 0o604)
    os.close(fd)
    assert stat.S_IMODE(os.stat(mnt.path / "d" / "g").st_mode) == 0o604
    mnt.remount()
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o000
    assert stat.S_IMODE(os.stat(mnt.path / "d").st_mode) == 0o751


def test_chown(mnt: Mount) -> None:
    p = mnt.path / "f"
    p.write_bytes(b"x")
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(p, -1, 42)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 42)
    os.symlink("f", mnt.path / "l")
    os.lchown(mnt.path / "l", 77, 88)
    assert (os.lstat(mnt.path / "l").st_uid, os.lstat(mnt.path / "l").st_gid) == (77, 88)
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 42)
    mnt.remount()
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 42)


def test_utime_ns(mnt: Mount) -> None:
    p = mnt.path / "f"
    p.write_bytes(b"x")
    atime, mtime = 1_234_567_890_123_456_789, 1_300_000_000_987_654_321
    os.utime(p, ns=(atime, mtime))
    st = os.stat(p)
    assert st.st_atime_ns == atime
    assert st.st_mtime_ns == mtime
    os.mkdir(mnt.path / "d")
    os.utime(mnt.path / "d", ns=(5_000_000_001, 6_000_000_002))
    assert os.stat(mnt.path / "d").st_mtime_ns == 6_000_000_002
    mnt.remount()
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime)
    # a write moves mtime forward from the old value
    with open(p, "ab") as f:
        f.write(b"more")
        f.flush()
        os.fsync(f.fileno())
    assert os.stat(p).st_mtime_ns > mtime
    # utime(None) sets "now", which is later than the 2011 timestamp above
    os.utime(mnt.path / "d")
    assert os.stat(mnt.path / "d").st_mtime_ns > 6_000_000_002


def test_stat_fields_and_blocks(mnt: Mount) -> None:
    p = mnt.path / "f"
    p.touch()
    st0 = os.stat(p)
    assert st0.st_size == 0
    assert st0.st_nlink == 1
    assert st0.st_blksize > 0
    fd = os.open(p, os.O_WRONLY)
    try:
        os.write(fd, pattern(MiB, 7))
        os.fsync(fd)
    finally:
        os.close(fd)
    st1 = os.stat(p)
    assert st1.st_size == MiB
    assert st1.st_blocks >= MiB // 512, st1.st_blocks
    assert st1.st_blocks > st0.st_blocks
    assert st1.st_ino == st0.st_ino
    with open(p, "ab") as f:
        f.write(pattern(MiB, 8))
    st2 = os.stat(p)
    assert st2.st_size == 2 * MiB
    assert st2.st_blocks >= 2 * MiB // 512
    # distinct files have distinct inode numbers
    (mnt.path / "g").touch()
    assert os.stat(mnt.path / "g").st_ino != st0.st_ino
    assert os.stat(mnt.path).st_ino != st0.st_ino


def test_statfs(mnt: Mount) -> None:
    sv = os.statvfs(mnt.path)
    assert sv.f_bsize == 4096
    assert sv.f_frsize in (0, 4096)
    frsize = sv.f_frsize or sv.f_bsize
    assert 0 < sv.f_blocks * frsize <= 64 * MiB
    assert 0 < sv.f_bfree <= sv.f_blocks
    assert sv.f_bavail <= sv.f_bfree
    assert sv.f_namemax == 255
    p = mnt.path / "filler"
    with open(p, "wb") as f:
        f.write(pattern(2 * MiB, 9))
        f.flush()
        os.fsync(f.fileno())
    sv2 = os.statvfs(mnt.path)
    assert sv2.f_blocks == sv.f_blocks
    assert sv.f_bfree - sv2.f_bfree >= 2 * MiB // frsize
    os.unlink(p)
    assert wait_until(lambda: os.statvfs(mnt.path).f_bfree >= sv.f_bfree - 8), (
        f"blocks not freed after unlink: {os.statvfs(mnt.path).f_bfree} vs {sv.f_bfree}"
    )


# -------------------------------------------------------------------------- xattrs


def test_xattrs(mnt: Mount) -> None:
    p = mnt.path / "f"
    p.write_bytes(b"x")
    os.setxattr(p, "user.alpha", b"one")
    os.setxattr(p, "user.beta", b"\x00\x01binary\xff")
    os.setxattr(p, "user.empty", b"")
    big = pattern(3000, 10)
    os.setxattr(p, "user.big", big)
    assert os.getxattr(p, "user.alpha") == b"one"
    assert os.getxattr(p, "user.beta") == b"\x00\x01binary\xff"
    assert os.getxattr(p, "user.empty") == b""
    assert os.getxattr(p, "user.big") == big
    names = {n for n in os.listxattr(p) if n.startswith("user.")}
    assert names == {"user.alpha", "user.beta", "user.empty", "user.big"}
    # replace
    os.setxattr(p, "user.alpha", b"uno")
    assert os.getxattr(p, "user.alpha") == b"uno"
    os.setxattr(p, "user.alpha", b"eins", os.XATTR_REPLACE)
    assert os.getxattr(p, "user.alpha") == b"eins"
    expect_errno(errno.EEXIST, os.setxattr, p, "user.alpha", b"x", os.XATTR_CREATE)
    expect_errno(errno.ENODATA, os.setxattr, p, "user.nope", b"x", os.XATTR_REPLACE)
    expect_errno(errno.ENODATA, os.getxattr, p, "user.nope")
    expect_errno(errno.ENODATA, os.removexattr, p, "user.nope")
    os.removexattr(p, "user.beta")
    expect_errno(errno.ENODATA, os.getxattr, p, "user.beta")
    assert "user.beta" not in os.listxattr(p)
    # on a directory, and via fd
    os.mkdir(mnt.path / "d")
    os.setxattr(mnt.path / "d", "user.dir", b"yes", os.XATTR_CREATE)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.getxattr(fd, "user.alpha") == b"eins"
    finally:
        os.close(fd)
    mnt.remount()
    assert os.getxattr(p, "user.alpha") == b"eins"
    assert os.getxattr(p, "user.big") == big
    assert os.getxattr(mnt.path / "d", "user.dir") == b"yes"
    assert {n for n in os.listxattr(p) if n.startswith("user.")} == {
        "user.alpha", "user.empty", "user.big"}


def test_writes_cost_no_getxattr_in_the_daemon_and_file_capabilities_are_refused(mnt: Mount) -> None:
    """The kernel asks for security.capability before every write (no HANDLE_KILLPRIV_V2 in
    libfuse 3.14); the binding answers it without running the daemon's Python code."""
    p = mnt.path / "capless"
    before = status_json(mnt.path)["getxattr_calls"]
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for i in range(50):
            os.pwrite(fd, b"x" * 4096, i * 4096)
    finally:
        os.close(fd)
    assert status_json(mnt.path)["getxattr_calls"] == before
    expect_errno(errno.ENODATA, os.getxattr, p, "security.capability")
    # A capability could never be seen again, so none is stored.
    expect_errno(errno.EOPNOTSUPP, os.setxattr, p, "security.capability", b"\x01\x00\x00\x02" + bytes(16))
    assert "security.capability" not in os.listxattr(p)


# ------------------------------------------------------------ open-unlinked files


def test_unlink_open_file_keeps_data(mnt: Mount) -> None:
    p = mnt.path / "tmpfile"
    data = pattern(300_000, 11)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert not os.path.lexists(p)
        assert "tmpfile" not in os.listdir(mnt.path)
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, len(data) + 10, 0) == data
        os.pwrite(fd, b"still writable", 100)
        assert os.pread(fd, 14, 100) == b"still writable"
        # a new file with the same name is a different file
        p.write_bytes(b"replacement")
        assert os.pread(fd, 3, 0) == data[:3]
    finally:
        os.close(fd)
    assert p.read_bytes() == b"replacement"


def test_unlinked_open_file_space_freed_on_close(mnt: Mount) -> None:
    sv0 = os.statvfs(mnt.path)
    p = mnt.path / "big"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, pattern(4 * MiB, 12))
        os.fsync(fd)
        os.unlink(p)
        used_while_open = sv0.f_bfree - os.statvfs(mnt.path).f_bfree
        assert used_while_open >= 4 * MiB // 4096
        assert os.pread(fd, 10, 4 * MiB - 10) == pattern(4 * MiB, 12)[-10:]
    finally:
        os.close(fd)
    assert wait_until(lambda: os.statvfs(mnt.path).f_bfree >= sv0.f_bfree - 8), (
        "space of an unlinked file was not released after close"
    )


# ---------------------------------------------------------------------------- mmap


def test_mmap_read_write_msync(mnt: Mount) -> None:
    p = mnt.path / "mapped"
    size = 3 * BLOCK + 100
    p.write_bytes(b"\x11" * size)
    fd = os.open(p, os.O_RDWR)
    try:
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            assert mm[:4] == b"\x11" * 4
            assert mm[size - 1] == 0x11
            mm[0:5] = b"HELLO"
            mm[BLOCK - 2 : BLOCK + 3] = b"ACROS"
            mm[size - 4 : size] = b"TAIL"
            mm.flush()  # msync(MS_SYNC)
    finally:
        os.close(fd)
    expected = bytearray(b"\x11" * size)
    expected[0:5] = b"HELLO"
    expected[BLOCK - 2 : BLOCK + 3] = b"ACROS"
    expected[size - 4 :] = b"TAIL"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, size + 10, 0) == bytes(expected)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            assert mm[:] == bytes(expected)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == size
    mnt.remount()
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, size + 10, 0) == bytes(expected)
    finally:
        os.close(fd)


def test_mmap_sees_write(mnt: Mount) -> None:
    p = mnt.path / "m2"
    p.write_bytes(b"\0" * 2 * BLOCK)
    fd = os.open(p, os.O_RDWR)
    try:
        with mmap.mmap(fd, 2 * BLOCK) as mm:
            os.pwrite(fd, b"written", BLOCK + 1)
            assert mm[BLOCK + 1 : BLOCK + 8] == b"written"
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- sync


def test_fsync_fdatasync_fsyncdir(mnt: Mount) -> None:
    d = mnt.path / "d"
    d.mkdir()
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"synced")
        assert os.fsync(fd) is None
        os.write(fd, b" again")
        assert os.fdatasync(fd) is None
    finally:
        os.close(fd)
    for target in (d, mnt.path):
        dfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert os.fsync(dfd) is None
        finally:
            os.close(dfd)
    os.sync()
    assert p.read_bytes() == b"synced again"


# -------------------------------------------------------------------------- errnos


def test_enametoolong(mnt: Mount) -> None:
    r = mnt.path
    ok = "n" * 255
    (r / ok).write_bytes(b"ok")
    assert (r / ok).read_bytes() == b"ok"
    assert ok in os.listdir(r)
    long = "n" * 256
    expect_errno(errno.ENAMETOOLONG, os.open, r / long, os.O_CREAT | os.O_WRONLY, 0o644)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, r / long)
    expect_errno(errno.ENAMETOOLONG, os.symlink, "t", r / long)
    expect_errno(errno.ENAMETOOLONG, os.link, r / ok, r / long)
    expect_errno(errno.ENAMETOOLONG, os.rename, r / ok, r / long)
    expect_errno(errno.ENAMETOOLONG, os.stat, r / long)
    # the limit is in bytes, not characters: 127 two-byte chars + 1 = 255 bytes
    utf_ok = "\u00e9" * 127 + "a"
    (r / utf_ok).touch()
    assert utf_ok in os.listdir(r)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, r / ("\u00e9" * 128))
    assert sorted(os.listdir(r)) == sorted([ok, utf_ok])


def test_enotempty_rmdir(mnt: Mount) -> None:
    d = mnt.path / "d"
    d.mkdir()
    (d / "f").touch()
    expect_errno(errno.ENOTEMPTY, os.rmdir, d)
    os.unlink(d / "f")
    os.mkdir(d / "sub")
    expect_errno(errno.ENOTEMPTY, os.rmdir, d)
    os.rmdir(d / "sub")
    os.rmdir(d)
    assert not d.exists()


def test_eexist(mnt: Mount) -> None:
    r = mnt.path
    os.mkdir(r / "d")
    (r / "f").write_bytes(b"f")
    expect_errno(errno.EEXIST, os.mkdir, r / "d")
    expect_errno(errno.EEXIST, os.mkdir, r / "f")
    expect_errno(errno.EEXIST, os.link, r / "f", r / "d")
    (r / "g").touch()
    expect_errno(errno.EEXIST, os.link, r / "f", r / "g")
    expect_errno(errno.EEXIST, os.open, r / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    expect_errno(errno.EEXIST, os.open, r / "d", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    assert (r / "f").read_bytes() == b"f"


def test_eisdir(mnt: Mount) -> None:
    d = mnt.path / "d"
    d.mkdir()
    expect_errno(errno.EISDIR, os.open, d, os.O_WRONLY)
    expect_errno(errno.EISDIR, os.open, d, os.O_RDWR)
    expect_errno(errno.EISDIR, os.unlink, d)
    fd = os.open(d, os.O_RDONLY)
    try:
        expect_errno(errno.EISDIR, os.read, fd, 10)
    finally:
        os.close(fd)
    assert d.is_dir()


def test_enotdir(mnt: Mount) -> None:
    f = mnt.path / "f"
    f.write_bytes(b"x")
    expect_errno(errno.ENOTDIR, os.open, f / "x", os.O_RDONLY)
    expect_errno(errno.ENOTDIR, os.open, f / "x", os.O_CREAT | os.O_WRONLY)
    expect_errno(errno.ENOTDIR, os.mkdir, f / "x")
    expect_errno(errno.ENOTDIR, os.stat, f / "x")
    expect_errno(errno.ENOTDIR, os.rmdir, f)
    expect_errno(errno.ENOTDIR, os.listdir, f)
    expect_errno(errno.ENOTDIR, os.open, f, os.O_RDONLY | os.O_DIRECTORY)


def test_enoent(mnt: Mount) -> None:
    r = mnt.path
    expect_errno(errno.ENOENT, os.open, r / "missing", os.O_RDONLY)
    expect_errno(errno.ENOENT, os.stat, r / "missing")
    expect_errno(errno.ENOENT, os.unlink, r / "missing")
    expect_errno(errno.ENOENT, os.rmdir, r / "missing")
    expect_errno(errno.ENOENT, os.open, r / "nodir" / "f", os.O_CREAT | os.O_WRONLY)
    expect_errno(errno.ENOENT, os.mkdir, r / "nodir" / "sub")
    expect_errno(errno.ENOENT, os.readlink, r / "missing")
    expect_errno(errno.ENOENT, os.listdir, r / "missing")
    (r / "gone").touch()
    os.unlink(r / "gone")
    expect_errno(errno.ENOENT, os.stat, r / "gone")
    assert os.listdir(r) == []


# --------------------------------------------------------------------- persistence


def build_rich_tree(root: Path, seed: int) -> None:
    rng = random.Random(seed)
    for d in ("a", "a/b", "a/b/c", "empty", "x"):
        (root / d).mkdir()
    for i in range(40):
        d = root / rng.choice(["", "a", "a/b", "a/b/c", "x"])
        size = rng.choice([0, 1, 100, BLOCK - 1, BLOCK, BLOCK + 1, 70_000, 300_000])
        p = d / f"f{i}"
        p.write_bytes(rng.randbytes(size))
        os.chmod(p, rng.choice([0o644, 0o600, 0o755, 0o4755, 0o640]))
    # sparse file: holes around data
    with open(root / "x" / "sparse", "wb") as f:
        f.seek(MiB)
        f.write(b"island")
        f.seek(3 * MiB)
        f.write(b"end")
    os.symlink("a/b/f1", root / "sym")
    os.symlink("nowhere", root / "x" / "dangling")
    (root / "a" / "hl").write_bytes(b"hard linked")
    os.link(root / "a" / "hl", root / "x" / "hl2")
    os.setxattr(root / "a" / "hl", "user.tag", b"value")
    os.setxattr(root / "a", "user.dirtag", b"d")
    os.chown(root / "x" / "hl2", 1000, 1000)
    os.utime(root / "a" / "b" / "c", ns=(10**18, 10**18 + 5))
    fsync_path(root)


def test_tree_persists_across_remount(mnt: Mount) -> None:
    build_rich_tree(mnt.path, 1234)
    before = snapshot(mnt.path)
    assert len(before) > 45
    mnt.remount()
    after = snapshot(mnt.path)
    assert before == after, diff_snapshots(before, after)
    assert file_sha256(mnt.path / "x" / "sparse") == file_sha256_of(
        b"\0" * MiB + b"island" + b"\0" * (2 * MiB - 6) + b"end")
    # remount twice more with changes in between
    os.unlink(mnt.path / "a" / "hl")
    os.rename(mnt.path / "a" / "b", mnt.path / "moved")
    with open(mnt.path / "moved" / "f_new", "wb") as f:
        f.write(b"new after remount")
    changed = snapshot(mnt.path)
    mnt.remount()
    assert snapshot(mnt.path) == changed, diff_snapshots(changed, snapshot(mnt.path))
    mnt.remount()
    assert snapshot(mnt.path) == changed


def file_sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_second_pool_is_independent(make_pool: MakePool, mount_pool: MountPool) -> None:
    m1 = mount_pool(make_pool("16M"))
    m2 = mount_pool(make_pool("16M"))
    (m1.path / "only-in-1").write_bytes(b"1")
    (m2.path / "only-in-2").write_bytes(b"2")
    assert os.listdir(m1.path) == ["only-in-1"]
    assert os.listdir(m2.path) == ["only-in-2"]
    m1.remount()
    assert os.listdir(m1.path) == ["only-in-1"]


def test_rename_over_hard_linked_file(mnt: Mount) -> None:
    r = mnt.path
    (r / "target").write_bytes(b"target data")
    os.link(r / "target", r / "other-name")
    (r / "src").write_bytes(b"src data")
    os.rename(r / "src", r / "target")
    assert (r / "target").read_bytes() == b"src data"
    assert os.stat(r / "target").st_nlink == 1
    assert (r / "other-name").read_bytes() == b"target data"
    assert os.stat(r / "other-name").st_nlink == 1
    # renaming one hard link onto another name of the same inode is a no-op
    os.link(r / "target", r / "alias")
    os.rename(r / "alias", r / "target")
    assert (r / "alias").exists() and os.stat(r / "target").st_nlink == 2
    mnt.remount()
    assert os.stat(r / "other-name").st_nlink == 1
    assert os.stat(r / "target").st_nlink == 2
    assert (r / "alias").read_bytes() == b"src data"


def test_concurrent_writers(mnt: Mount) -> None:
    """Threads issue real concurrent syscalls (the GIL is released around them)."""
    shared = mnt.path / "shared"
    nthreads, nchunks, chunk = 8, 40, 8192
    with open(shared, "wb") as f:
        f.truncate(nthreads * nchunks * chunk)

    def work(t: int) -> None:
        own = mnt.path / f"own{t}"
        sfd = os.open(shared, os.O_WRONLY)
        ofd = os.open(own, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            for i in range(nchunks):
                data = pattern(chunk, t * 1000 + i)
                # interleaved regions of the shared file: chunk i of thread t
                assert os.pwrite(sfd, data, (i * nthreads + t) * chunk) == chunk
                assert os.write(ofd, data) == chunk
                if i % 10 == 0:
                    os.fsync(ofd)
        finally:
            os.close(sfd)
            os.close(ofd)

    with ThreadPoolExecutor(nthreads) as ex:
        list(ex.map(work, range(nthreads)))
    data = read_all(shared)
    assert len(data) == nthreads * nchunks * chunk
    for t in range(nthreads):
        own = read_all(mnt.path / f"own{t}")
        for i in range(nchunks):
            want = pattern(chunk, t * 1000 + i)
            off = (i * nthreads + t) * chunk
            assert data[off : off + chunk] == want, (t, i)
            assert own[i * chunk : (i + 1) * chunk] == want, (t, i)
    sums = {p: file_sha256(mnt.path / p) for p in os.listdir(mnt.path)}
    mnt.remount()
    assert {p: file_sha256(mnt.path / p) for p in os.listdir(mnt.path)} == sums


def test_many_metadata_operations_and_checkpoints(
    make_pool: MakePool, mount_pool: MountPool
) -> None:
    """Enough fsynced metadata changes to fill the log several times over, so checkpoints
    must happen; everything fsynced survives kill -9 and the pool checks clean."""
    m = mount_pool(make_pool("8M"))
    gen0 = status_json(m.path)["log"]["generation"]  # check refuses a mounted pool
    d = m.path / "churn"
    d.mkdir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    expected: dict[str, bytes] = {}
    try:
        for i in range(5000):
            name = f"f{i % 97}"
            data = f"{i}:{name}\n".encode() * (i % 7)
            fd = os.open(d / name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            os.write(fd, data)
            os.fsync(fd)
            os.close(fd)
            expected[name] = data
            if i % 5 == 0:
                victim = f"f{(i * 7) % 97}"
                if victim in expected:
                    os.unlink(d / victim)
                    del expected[victim]
            if i % 11 == 0:
                os.setxattr(d, "user.counter", str(i).encode())
            os.fsync(dfd)
    finally:
        os.close(dfd)
    mnt_path = m.path
    m.kill9()
    rc, rep = check_json(m.pool)
    assert rc == 0 and rep["clean"], rep["problems"]
    gen1 = max(a["gen"] or 0 for a in rep["layout"]["log_areas"])
    assert gen1 > gen0, f"no checkpoint after 5000 fsynced operations (gen {gen0} -> {gen1})"
    m.start()
    assert sorted(os.listdir(mnt_path / "churn")) == sorted(expected)
    for name, data in expected.items():
        assert (mnt_path / "churn" / name).read_bytes() == data, name
    assert os.getxattr(mnt_path / "churn", "user.counter") == b"4994"
    m.unmount()
    assert_check_clean(m.pool)


def test_posix_fallocate(mnt: Mount) -> None:
    """posix_fallocate (served by the daemon's fallocate, test_fallocate.py has the modes)
    gives the right size, zeros, and keeps existing data."""
    p = mnt.path / "falloc"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, MiB)
        assert os.fstat(fd).st_size == MiB
        assert os.pread(fd, 2 * MiB, 0) == b"\0" * MiB
        assert os.fstat(fd).st_blocks >= MiB // 512
        os.pwrite(fd, b"data in the middle", 500_000)
        os.posix_fallocate(fd, 400_000, 2 * MiB)  # overlaps the data, extends the file
        assert os.fstat(fd).st_size == 400_000 + 2 * MiB
        got = os.pread(fd, 3 * MiB, 0)
        assert got[500_000:500_018] == b"data in the middle"
        assert got.count(0) == len(got) - len(b"data in the middle".replace(b"\0", b""))
        os.posix_fallocate(fd, 0, 10)  # inside the file: no change
        assert os.fstat(fd).st_size == 400_000 + 2 * MiB
        os.fsync(fd)
    finally:
        os.close(fd)
    mnt.remount()
    assert os.stat(p).st_size == 400_000 + 2 * MiB
    assert read_all(p)[500_000:500_018] == b"data in the middle"


def test_dir_mtime_changes_with_entries(mnt: Mount) -> None:
    d = mnt.path / "d"
    d.mkdir()
    old = 1_000_000_000 * 10**9

    def reset() -> None:
        os.utime(d, ns=(old, old))
        assert os.stat(d).st_mtime_ns == old

    reset()
    (d / "f").touch()
    assert os.stat(d).st_mtime_ns > old, "create did not update the directory mtime"
    reset()
    os.rename(d / "f", d / "g")
    assert os.stat(d).st_mtime_ns > old, "rename did not update the directory mtime"
    reset()
    os.mkdir(d / "sub")
    assert os.stat(d).st_mtime_ns > old, "mkdir did not update the directory mtime"
    reset()
    os.rmdir(d / "sub")
    assert os.stat(d).st_mtime_ns > old, "rmdir did not update the directory mtime"
    reset()
    os.unlink(d / "g")
    assert os.stat(d).st_mtime_ns > old, "unlink did not update the directory mtime"


def run_as(uid: int, gid: int, code: str) -> subprocess.CompletedProcess[str]:
    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return subprocess.run(
        ["/usr/bin/python3", "-c", code], preexec_fn=drop, capture_output=True, text=True,
        timeout=60, cwd="/",
    )


def test_other_users_ownership_and_permissions(mnt: Mount, work_dir: Path) -> None:
    r = mnt.path
    os.chmod(work_dir, 0o755)  # mkdtemp made it 0700: let the other user reach the mount
    os.chmod(r, 0o755)
    (r / "secret").write_bytes(b"root only")
    os.chmod(r / "secret", 0o600)
    (r / "readable").write_bytes(b"everyone may read")
    os.chmod(r / "readable", 0o644)
    os.mkdir(r / "pub")
    os.chmod(r / "pub", 0o777)
    code = f"""
import errno, os
def err(f, *a):
    try:
        f(*a)
    except OSError as e:
        return e.errno
    return 0
r = {str(r)!r}
print(err(os.open, r + "/secret", os.O_RDONLY) == errno.EACCES)
print(open(r + "/readable", "rb").read() == b"everyone may read")
print(err(os.open, r + "/readable", os.O_WRONLY) == errno.EACCES)
print(err(os.open, r + "/new", os.O_CREAT | os.O_WRONLY) == errno.EACCES)
print(err(os.chmod, r + "/readable", 0o777) == errno.EPERM)
fd = os.open(r + "/pub/mine", os.O_CREAT | os.O_WRONLY, 0o640)
os.write(fd, b"by user")
os.close(fd)
os.mkdir(r + "/pub/mydir")
print("ok")
"""
    res = run_as(4321, 8765, code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True"] * 5 + ["ok"], res.stdout
    st = os.stat(r / "pub" / "mine")
    assert (st.st_uid, st.st_gid) == (4321, 8765), "new file not owned by its creator"
    assert stat.S_IMODE(st.st_mode) == 0o640
    st = os.stat(r / "pub" / "mydir")
    assert (st.st_uid, st.st_gid) == (4321, 8765)
    assert not (r / "new").exists()


def test_writeback_cache_mount_basics(make_pool: MakePool, mount_pool: MountPool) -> None:
    """With -o writeback_cache the kernel caches writes; the results must be the same."""
    m = mount_pool(make_pool("32M"), options="pmem=force,writeback_cache")
    r = m.path
    expected: dict[str, bytes] = {}
    fd = os.open(r / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, pattern(10_000, 1), 0)
        os.pwrite(fd, b"X" * 100, 4090)
        os.pwrite(fd, b"far", 100_000)
        os.ftruncate(fd, 50_000)
        os.ftruncate(fd, 60_000)
        os.fsync(fd)
    finally:
        os.close(fd)
    want = bytearray(pattern(10_000, 1))
    want[4090:4190] = b"X" * 100
    want += bytes(60_000 - len(want))
    expected["f"] = bytes(want)
    with open(r / "log", "ab") as f:
        f.write(b"one\n")
    with open(r / "log", "ab") as f:
        f.write(b"two\n")
    expected["log"] = b"one\ntwo\n"
    (r / "mapped").write_bytes(b"\0" * 2 * BLOCK)
    fd = os.open(r / "mapped", os.O_RDWR)
    try:
        with mmap.mmap(fd, 2 * BLOCK) as mm:
            mm[10:15] = b"MMAP!"
            mm.flush()
    finally:
        os.close(fd)
    expected["mapped"] = b"\0" * 10 + b"MMAP!" + b"\0" * (2 * BLOCK - 15)
    big = pattern(3 * MiB, 2)
    (r / "big").write_bytes(big)
    expected["big"] = big
    for name, data in expected.items():
        assert read_all(r / name) == data, name
        assert os.stat(r / name).st_size == len(data), name
    m.remount()
    for name, data in expected.items():
        assert read_all(r / name) == data, name


def test_huge_sparse_offset(mnt: Mount) -> None:
    """A write far beyond the pool size makes a sparse file (or fails cleanly with EFBIG);
    it must not allocate the hole."""
    p = mnt.path / "huge"
    free0 = os.statvfs(mnt.path).f_bfree
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        off = 1 << 36  # 64 GiB into a 64 MiB pool
        try:
            os.pwrite(fd, b"far away", off)
        except OSError as exc:
            assert exc.errno == errno.EFBIG, f"unexpected {exc!r}"
            return
        assert os.fstat(fd).st_size == off + 8
        assert os.pread(fd, 100, off - 92) == b"\0" * 92 + b"far away"
        assert os.pread(fd, 4096, off // 2) == b"\0" * 4096
        os.fsync(fd)
        assert os.statvfs(mnt.path).f_bfree >= free0 - 16
        os.ftruncate(fd, 10)
        assert os.fstat(fd).st_size == 10
        assert os.pread(fd, 100, 0) == b"\0" * 10
    finally:
        os.close(fd)
    mnt.remount()
    assert os.stat(p).st_size == 10
