"""fallocate(2), SEEK_DATA/SEEK_HOLE and copy_file_range(2) through a real rpmemfs mount,
compared with the same calls on tmpfs (the test's work directory is on /dev/shm), with real
crashes (kill -9) and real target daemons."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import random
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import MakePool, MountPool
from helpers import (
    BLOCK,
    MiB,
    Mount,
    assert_check_clean,
    cli,
    pool_content,
    replica_file,
    status_json,
    wait_until,
)

from rpmemfs.tools.processes import TargetProcess

KEEP_SIZE, PUNCH_HOLE, COLLAPSE_RANGE, ZERO_RANGE, INSERT_RANGE, UNSHARE_RANGE = 1, 2, 8, 16, 32, 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate(fd: int, mode: int, off: int, length: int) -> int:
    """fallocate(2) itself (os has only posix_fallocate); returns 0 or the errno."""
    if _libc.fallocate(fd, mode, off, length) == 0:
        return 0
    return ctypes.get_errno()


def fallocate_cmd(path: Path, *args: str | int) -> str:
    """fallocate(1) from util-linux; 'ok' or the reason it printed."""
    res = subprocess.run(["fallocate", *map(str, args), str(path)], capture_output=True, text=True)
    return "ok" if res.returncode == 0 else res.stderr.strip().rsplit(": ", 1)[-1]


def seek_map(fd: int) -> list[tuple[str, int, int]]:
    """The file as (data|hole, start, end) extents, found by SEEK_DATA/SEEK_HOLE alone."""
    size = os.fstat(fd).st_size
    out: list[tuple[str, int, int]] = []
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            assert e.errno == errno.ENXIO, e
            out.append(("hole", pos, size))
            break
        if data > pos:
            out.append(("hole", pos, data))
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        out.append(("data", data, hole))
        pos = hole
    return out


def state(fd: int) -> tuple[int, int, list[tuple[str, int, int]], str]:
    st = os.fstat(fd)
    body = os.pread(fd, st.st_size + 1, 0)
    assert len(body) == st.st_size
    return st.st_size, st.st_blocks, seek_map(fd), hashlib.sha256(body).hexdigest()


def run_steps(directory: Path) -> list[tuple[str, object, Any]]:
    """The same calls on a file in ``directory``: after each, its result and the file's
    size, st_blocks, SEEK map and content."""
    p = directory / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    os.pwrite(fd, random.Random(1).randbytes(10 * BLOCK), 0)

    def posix(off: int, n: int) -> Callable[[], object]:
        def call() -> object:
            try:
                os.posix_fallocate(fd, off, n)
            except OSError as e:
                return errno.errorcode[e.errno or 0]
            return "ok"
        return call

    def raw(mode: int, off: int, n: int) -> Callable[[], object]:
        return lambda: errno.errorcode.get(fallocate(fd, mode, off, n), "ok")

    steps: list[tuple[str, Callable[[], object]]] = [
        ("posix_fallocate grows", posix(0, 20 * BLOCK)),
        ("-n past the end", lambda: fallocate_cmd(p, "-n", "-o", 20 * BLOCK, "-l", 4 * BLOCK)),
        ("-p across blocks", lambda: fallocate_cmd(p, "-p", "-o", BLOCK + 100, "-l", 3 * BLOCK)),
        ("-p inside a block", lambda: fallocate_cmd(p, "-p", "-o", 5 * BLOCK + 10, "-l", 100)),
        ("write preallocated", lambda: os.pwrite(fd, b"w" * 10, 15 * BLOCK) and "ok"),
        ("-p through the end", lambda: fallocate_cmd(p, "-p", "-o", 18 * BLOCK, "-l", 2 * BLOCK)),
        ("-l over a hole", lambda: fallocate_cmd(p, "-o", 30 * BLOCK, "-l", 2 * BLOCK)),
        ("-l over data", lambda: fallocate_cmd(p, "-o", 0, "-l", 3 * BLOCK)),
        ("-d digs holes", lambda: (os.pwrite(fd, bytes(2 * BLOCK), 8 * BLOCK),
                                   fallocate_cmd(p, "-d"))[1]),
        ("punch without KEEP_SIZE", raw(PUNCH_HOLE, 0, BLOCK)),
        ("-c (collapse)", lambda: fallocate_cmd(p, "-c", "-o", 0, "-l", BLOCK)),
        ("-i (insert)", lambda: fallocate_cmd(p, "-i", "-o", 0, "-l", BLOCK)),
        ("unshare", raw(UNSHARE_RANGE, 0, BLOCK)),
        ("write-zeroes (Linux 6.17)", raw(0x80, 0, BLOCK)),
        ("length 0", raw(0, 0, 0)),
        ("offset < 0", raw(0, -1, BLOCK)),
    ]
    out: list[tuple[str, object, Any]] = []
    try:
        for name, call in steps:
            out.append((name, call(), state(fd)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return out


def test_fallocate_modes_match_tmpfs(mnt: Mount, work_dir: Path) -> None:
    """Sizes, st_blocks (punched blocks are freed), SEEK_DATA/SEEK_HOLE maps and contents
    after each call are what tmpfs gives, and so are the errors (COLLAPSE_RANGE and
    INSERT_RANGE: EOPNOTSUPP on both, documented)."""
    ref = work_dir / "tmpfs"
    ref.mkdir()
    want = run_steps(ref)
    got = run_steps(mnt.path)
    for w, g in zip(want, got, strict=True):
        assert g == w, f"after {w[0]!r}:\n tmpfs   {w}\n rpmemfs {g}"
    # Holes did happen, and blocks were freed: the comparison is not of two dense files.
    assert any(kind == "hole" for kind, _a, _b in got[-1][2][2])
    assert dict((n, r) for n, r, _s in got)["-c (collapse)"] == "Operation not supported"
    # All of it survives a remount, SEEK map included (preallocated blocks are logged so).
    fd = os.open(mnt.path / "f", os.O_RDONLY)
    try:
        before = state(fd)
    finally:
        os.close(fd)
    mnt.remount()
    fd = os.open(mnt.path / "f", os.O_RDONLY)
    try:
        after = state(fd)
    finally:
        os.close(fd)
    assert after == before


def test_zero_range(mnt: Mount) -> None:
    """tmpfs has no ZERO_RANGE; ext4's result: the range reads as zeros, blocks are
    allocated for all of it, and the size grows unless KEEP_SIZE."""
    p = mnt.path / "z"
    data = random.Random(2).randbytes(8 * BLOCK)
    p.write_bytes(data)
    assert fallocate_cmd(p, "-p", "-o", 4 * BLOCK, "-l", 2 * BLOCK) == "ok"  # a hole in it
    assert os.stat(p).st_blocks == 6 * BLOCK // 512
    assert fallocate_cmd(p, "-z", "-o", 100, "-l", 7 * BLOCK) == "ok"
    model = bytearray(data)
    model[4 * BLOCK: 6 * BLOCK] = bytes(2 * BLOCK)
    model[100: 100 + 7 * BLOCK] = bytes(7 * BLOCK)
    assert p.read_bytes() == model
    assert os.stat(p).st_blocks == 8 * BLOCK // 512  # the hole got blocks, as on ext4
    assert fallocate_cmd(p, "-z", "-n", "-o", 7 * BLOCK, "-l", 3 * BLOCK) == "ok"
    model[7 * BLOCK:] = bytes(BLOCK)
    assert os.stat(p).st_size == 8 * BLOCK and p.read_bytes() == model
    assert os.stat(p).st_blocks == 10 * BLOCK // 512
    assert fallocate_cmd(p, "-z", "-o", 9 * BLOCK + 1, "-l", 5) == "ok"
    model += bytes(BLOCK + 6)
    assert os.stat(p).st_size == 9 * BLOCK + 6 and p.read_bytes() == model
    mnt.remount()
    assert p.read_bytes() == model


def test_punched_blocks_show_in_df_and_are_reused(make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("8M"))
    big = m.path / "big"
    vfs = os.statvfs(m.path)
    free0 = vfs.f_bfree
    fd = os.open(big, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, free0 * vfs.f_frsize)  # all of it
        assert os.statvfs(m.path).f_bfree == 0
        assert fallocate(fd, 0, free0 * vfs.f_frsize, BLOCK) == errno.ENOSPC
        assert os.fstat(fd).st_size == free0 * vfs.f_frsize  # nothing half done
        with pytest.raises(OSError) as e:
            (m.path / "other").write_bytes(b"x" * BLOCK)
        assert e.value.errno == errno.ENOSPC
        assert fallocate(fd, PUNCH_HOLE | KEEP_SIZE, MiB, MiB) == 0
        assert os.statvfs(m.path).f_bfree == MiB // BLOCK  # df shows it at once
        assert os.fstat(fd).st_blocks == (free0 * BLOCK - MiB) // 512
        # The punched blocks serve another file (after the durability point the daemon
        # makes by itself: reused before the punch is durable, a crash could show them in big).
        (m.path / "other").write_bytes(b"o" * MiB)
        assert os.statvfs(m.path).f_bfree == 0
    finally:
        os.close(fd)
    assert (m.path / "other").read_bytes() == b"o" * MiB
    with open(big, "rb") as f:
        f.seek(MiB)
        assert f.read(MiB) == bytes(MiB)


def test_cp_sparse_keeps_holes(mnt: Mount, work_dir: Path) -> None:
    src = work_dir / "sparse"  # on tmpfs
    with open(src, "wb") as f:
        for blk in (0, 3, 100, 101, 700):
            f.seek(blk * BLOCK)
            f.write(random.Random(blk).randbytes(BLOCK))
        f.truncate(1000 * BLOCK)
    on_mount = mnt.path / "sparse"
    again = mnt.path / "sparse2"
    for a, b in ((src, on_mount), (on_mount, again)):  # into the mount, then inside it
        res = subprocess.run(["cp", "--sparse=always", str(a), str(b)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    want = _state_of(src)
    assert _state_of(on_mount) == want
    assert _state_of(again) == want
    assert os.stat(again).st_blocks == 5 * BLOCK // 512


def _state_of(path: Path) -> tuple[int, int, list[tuple[str, int, int]], str]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return state(fd)
    finally:
        os.close(fd)


def test_copy_file_range_is_served_by_the_daemon(mnt: Mount) -> None:
    src, dst = mnt.path / "src", mnt.path / "dst"
    data = random.Random(3).randbytes(3 * MiB + 123)
    with open(src, "wb") as f:
        f.write(data)
        f.seek(10 * MiB)
        f.write(b"end")  # 7 MiB of hole in the middle
    size = 10 * MiB + 3
    before = status_json(mnt.path)["copy_file_range"]
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        copied = 0
        while copied < size:
            n = os.copy_file_range(fi, fo, size - copied, copied, copied)
            assert n > 0
            copied += n
        with pytest.raises(OSError) as e:  # flags must be 0: the kernel says EINVAL first
            ctypes_copy_file_range(fi, fo, 1)
        assert e.value.errno == errno.EINVAL
        os.fsync(fo)
    finally:
        os.close(fi)
        os.close(fo)
    after = status_json(mnt.path)["copy_file_range"]
    # The daemon served the copy itself: not the kernel's fallback of reads and writes.
    assert after["bytes"] - before["bytes"] == size
    assert after["calls"] > before["calls"]
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(dst).st_blocks == os.stat(src).st_blocks  # the hole stayed a hole
    mnt.kill9()
    mnt.start()
    assert dst.read_bytes() == data + bytes(size - len(data) - 3) + b"end"


def ctypes_copy_file_range(fd_in: int, fd_out: int, flags: int) -> int:
    fn = _libc.copy_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_uint]
    n: int = fn(fd_in, None, fd_out, None, BLOCK, flags)
    if n < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return n


def _punched_file(path: Path) -> tuple[int, int, list[tuple[str, int, int]], str]:
    """A file with data, punched holes and zeroed ranges, fsynced; its state."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, random.Random(4).randbytes(64 * BLOCK), 0)
        os.fsync(fd)
        for off in range(2, 60, 7):
            assert fallocate(fd, PUNCH_HOLE | KEEP_SIZE, off * BLOCK - 10, 3 * BLOCK) == 0
        assert fallocate(fd, ZERO_RANGE, 61 * BLOCK + 5, 10) == 0
        os.fsync(fd)
        return state(fd)
    finally:
        os.close(fd)


def test_kill9_after_fsync_of_punched_file(mnt: Mount) -> None:
    p = mnt.path / "punched"
    want = _punched_file(p)
    assert want[1] < 64 * BLOCK // 512
    mnt.kill9()
    assert_check_clean(mnt.pool)
    mnt.start()
    assert _state_of(p) == want


def test_kill9_in_the_middle_of_range_operations(mnt: Mount) -> None:
    """The daemon killed while another file is punched, zeroed, copied into and fsynced: the
    pool is clean, the fsynced file exact, the busy one readable."""
    stable = mnt.path / "stable"
    want = _punched_file(stable)
    busy = mnt.path / "busy"
    done = [0]
    stop = threading.Event()

    def churn() -> None:
        rng = random.Random(9)
        fd = os.open(busy, os.O_CREAT | os.O_RDWR, 0o644)
        src = os.open(stable, os.O_RDONLY)
        try:
            while not stop.is_set():
                op = rng.randrange(5)
                off = rng.randrange(256) * BLOCK + rng.randrange(BLOCK)
                n = rng.randrange(1, 16 * BLOCK)
                if op == 0:
                    os.pwrite(fd, rng.randbytes(n), off)
                elif op == 1:
                    fallocate(fd, PUNCH_HOLE | KEEP_SIZE, off, n)
                elif op == 2:
                    fallocate(fd, ZERO_RANGE | rng.choice((0, KEEP_SIZE)), off, n)
                elif op == 3:
                    os.copy_file_range(src, fd, n, rng.randrange(64 * BLOCK), off)
                else:
                    os.fsync(fd)
                done[0] += 1
        except OSError:
            pass  # the daemon is gone
        finally:
            for f in (fd, src):
                try:
                    os.close(f)
                except OSError:
                    pass  # ENOTCONN from the dead mount's flush; the descriptor is closed

    t = threading.Thread(target=churn)
    t.start()
    try:
        assert wait_until(lambda: done[0] >= 300, timeout=120), f"only {done[0]} operations ran"
        mnt.kill9()
    finally:
        stop.set()
        t.join()
    assert_check_clean(mnt.pool)
    mnt.start()
    assert _state_of(stable) == want
    size = os.stat(busy).st_size
    assert len(busy.read_bytes()) == size <= 272 * BLOCK


def _mkfs_replicated(pool: Path, targets: list[TargetProcess], size: str = "64M") -> None:
    args: list[str | os.PathLike[str]] = ["mkfs", pool, "--size", size]
    for t in targets:
        args += ["--replica", f"{t.address}/app"]
    res = cli(*args)
    assert res.returncode == 0, res.stderr


def test_replicas_get_punches_and_copies(work_dir: Path, targets: list[TargetProcess],
                                         mount_pool: MountPool) -> None:
    """Everything acknowledged by fsync is on every replica: a replica's pool, copied and
    mounted alone, has the same files, holes and blocks."""
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets)
    m = mount_pool(pool)
    want = _punched_file(m.path / "punched")
    fi = os.open(m.path / "punched", os.O_RDONLY)
    fo = os.open(m.path / "copy", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert os.copy_file_range(fi, fo, 64 * BLOCK, 0, 0) == 64 * BLOCK
        os.fsync(fo)
    finally:
        os.close(fi)
        os.close(fo)
    assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync", "in-sync"]
    m.unmount()
    local = pool_content(pool)
    for t in targets:
        assert pool_content(replica_file(t)) == local, f"replica on {t.address} differs"
        t.stop()
    for i, t in enumerate(targets):
        copy = work_dir / f"copy{i}.pool"
        shutil.copy(replica_file(t), copy)
        assert_check_clean(copy)
        alone = mount_pool(copy, name=f"alone{i}", options="pmem=force,min_replicas=0,replica_timeout=2")
        assert _state_of(alone.path / "punched") == want
        assert _state_of(alone.path / "copy") == want
        alone.unmount()


def test_replicas_get_the_zeros_of_reused_blocks(work_dir: Path, targets: list[TargetProcess],
                                                 mount_pool: MountPool) -> None:
    """Blocks fallocate takes may hold a deleted file's bytes: the zeros it writes over them
    reach the replicas too (their pools equal the local one byte for byte)."""
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets, "8M")
    m = mount_pool(pool)
    free = os.statvfs(m.path).f_bfree
    old = m.path / "old"
    with open(old, "wb") as f:
        f.write(random.Random(5).randbytes((free - 8) * BLOCK))
        os.fsync(f.fileno())
    old.unlink()
    # Its blocks are freed when the kernel forgets the inode (FUSE_FORGET comes a little after).
    assert wait_until(lambda: os.statvfs(m.path).f_bfree == free), os.statvfs(m.path)
    new = m.path / "new"
    fd = os.open(new, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, (free - 4) * BLOCK)  # needs the deleted file's blocks
        assert fallocate(fd, ZERO_RANGE | KEEP_SIZE, (free - 4) * BLOCK, 4 * BLOCK) == 0
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.statvfs(m.path).f_bfree == 0
    assert new.read_bytes() == bytes((free - 4) * BLOCK)
    m.unmount()
    local = pool_content(pool)
    for t in targets:
        assert pool_content(replica_file(t)) == local, f"replica on {t.address} differs"
