"""Running out of space: ENOSPC from write(2), recovery after deleting, statfs numbers."""

from __future__ import annotations

import errno
import hashlib
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

from helpers import MiB, Mount, assert_check_clean, file_sha256, fsync_path, wait_until

if TYPE_CHECKING:
    from conftest import MakePool, MountPool

CHUNK = 64 * 1024


def free_bytes(path: Path) -> int:
    sv = os.statvfs(path)
    return sv.f_bfree * (sv.f_frsize or sv.f_bsize)


def fill_digest(n: int) -> str:
    """sha256 of the first N bytes `fill` writes."""
    chunk = random.Random(1).randbytes(CHUNK)
    h = hashlib.sha256()
    for _ in range(n // CHUNK):
        h.update(chunk)
    h.update(chunk[: n % CHUNK])
    return h.hexdigest()


def fill(path: Path, limit: int = 256 * MiB) -> tuple[int, OSError | None]:
    """Write CHUNKs to PATH until an error; return (bytes written, the error)."""
    chunk = random.Random(1).randbytes(CHUNK)
    written = 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    err: OSError | None = None
    try:
        while written < limit:
            try:
                n = os.write(fd, chunk)
            except OSError as exc:
                err = exc
                break
            assert n > 0
            written += n
        if err is None:
            return written, None
        # the data that did fit is durable and readable
        os.fsync(fd)
    finally:
        os.close(fd)
    return written, err


def test_enospc_and_recovery(make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("8M"))
    keep = m.path / "keep"
    keep_data = random.Random(2).randbytes(300_000)
    keep.write_bytes(keep_data)
    fsync_path(keep)
    free0 = free_bytes(m.path)
    assert 0 < free0 < 8 * MiB

    written, err = fill(m.path / "fill")
    assert err is not None, f"wrote {written} bytes to an 8M pool without an error"
    assert err.errno == errno.ENOSPC, f"expected ENOSPC, got {err!r}"
    assert written <= free0, f"wrote {written} bytes with only {free0} free"
    assert written >= free0 - 1 * MiB, f"ENOSPC after {written} of {free0} free bytes"
    assert os.stat(m.path / "fill").st_size == written
    assert free_bytes(m.path) < 1 * MiB
    # other files are untouched, and reading works when full
    assert keep.read_bytes() == keep_data
    # a second writer also gets ENOSPC, not some other error
    fd = os.open(m.path / "another", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        err2: OSError | None = None
        try:
            for _ in range(64):
                os.write(fd, b"y" * CHUNK)
        except OSError as exc:
            err2 = exc
        assert err2 is not None and err2.errno == errno.ENOSPC, repr(err2)
    finally:
        os.close(fd)

    # reading works on a full pool, and the data that fit is intact
    assert file_sha256(m.path / "fill") == fill_digest(written)
    os.unlink(m.path / "fill")
    os.unlink(m.path / "another")
    assert wait_until(lambda: free_bytes(m.path) >= free0 - 64 * 1024), (
        f"space not returned after delete: {free_bytes(m.path)} free, had {free0}"
    )
    # writing works again, and as much as before fits
    written2, err = fill(m.path / "fill2")
    assert err is not None and err.errno == errno.ENOSPC, repr(err)
    assert written2 >= written - CHUNK, (written2, written)
    os.unlink(m.path / "fill2")
    assert wait_until(lambda: free_bytes(m.path) >= free0 - 64 * 1024)
    data = random.Random(3).randbytes(2 * MiB)
    (m.path / "after").write_bytes(data)
    fsync_path(m.path / "after")
    assert (m.path / "after").read_bytes() == data
    assert keep.read_bytes() == keep_data

    m.remount()
    assert (m.path / "after").read_bytes() == data
    assert keep.read_bytes() == keep_data
    m.unmount()
    assert_check_clean(m.pool)


def test_enospc_many_files_then_delete_some(make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("8M"))
    d = m.path / "d"
    d.mkdir()
    sums: dict[str, bytes] = {}
    err: OSError | None = None
    for i in range(10_000):
        data = random.Random(i).randbytes(100_000)
        p = d / f"f{i}"
        try:
            with open(p, "wb") as f:
                f.write(data)
        except OSError as exc:
            err = exc
            break
        sums[p.name] = data
    assert err is not None and err.errno == errno.ENOSPC, repr(err)
    assert len(sums) >= 20
    # the partial last file may exist; remove it, and every other second file
    partial = d / f"f{len(sums)}"
    if partial.exists():
        partial.unlink()
    for i, name in enumerate(sorted(sums)):
        if i % 2:
            os.unlink(d / name)
            del sums[name]
    assert wait_until(lambda: free_bytes(m.path) >= 1 * MiB)
    big = random.Random(99).randbytes(1 * MiB)
    (d / "big").write_bytes(big)
    fsync_path(d / "big")
    for name, data in sums.items():
        assert (d / name).read_bytes() == data, name
    assert (d / "big").read_bytes() == big
    m.remount()
    assert (d / "big").read_bytes() == big
    assert sorted(os.listdir(d)) == sorted([*sums, "big"])
    m.unmount()
    assert_check_clean(m.pool)


def test_statfs_numbers(make_pool: MakePool, mount_pool: MountPool) -> None:
    m: Mount = mount_pool(make_pool("16M"))
    sv = os.statvfs(m.path)
    assert sv.f_bsize == 4096
    frsize = sv.f_frsize or sv.f_bsize
    assert frsize == 4096
    assert sv.f_blocks * frsize <= 16 * MiB
    assert sv.f_blocks * frsize >= 8 * MiB, "most of a 16M pool should be data blocks"
    assert sv.f_bfree <= sv.f_blocks and sv.f_bavail <= sv.f_bfree
    assert sv.f_bfree >= sv.f_blocks - 64, "a fresh pool should be nearly empty"

    data = random.Random(4).randbytes(3 * MiB)
    (m.path / "three").write_bytes(data)
    fsync_path(m.path / "three")
    sv2 = os.statvfs(m.path)
    assert sv2.f_blocks == sv.f_blocks
    used = sv.f_bfree - sv2.f_bfree
    assert 3 * MiB // 4096 <= used <= 3 * MiB // 4096 + 64, used
    assert sv.f_bavail - sv2.f_bavail >= 3 * MiB // 4096

    (m.path / "one").write_bytes(data[: 1 * MiB])
    fsync_path(m.path / "one")
    sv3 = os.statvfs(m.path)
    assert sv2.f_bfree - sv3.f_bfree >= 1 * MiB // 4096

    os.unlink(m.path / "three")
    assert wait_until(lambda: os.statvfs(m.path).f_bfree >= sv3.f_bfree + 3 * MiB // 4096), (
        f"f_bfree {os.statvfs(m.path).f_bfree} after deleting 3 MiB, was {sv3.f_bfree}"
    )
    os.unlink(m.path / "one")
    assert wait_until(lambda: os.statvfs(m.path).f_bfree >= sv.f_bfree - 8)
    # holes do not use blocks
    with open(m.path / "sparse", "wb") as f:
        f.truncate(8 * MiB)
    assert os.statvfs(m.path).f_bfree >= sv.f_bfree - 8
    m.remount()
    sv4 = os.statvfs(m.path)
    assert sv4.f_blocks == sv.f_blocks
    assert abs(sv4.f_bfree - sv.f_bfree) <= 8


def test_kill9_while_full(make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("8M"))
    keep_data = random.Random(5).randbytes(200_000)
    (m.path / "keep").write_bytes(keep_data)
    fsync_path(m.path / "keep")
    fsync_path(m.path)
    written, err = fill(m.path / "fill")
    assert err is not None and err.errno == errno.ENOSPC, repr(err)
    fsync_path(m.path)
    fill_sum = file_sha256(m.path / "fill")
    assert fill_sum == fill_digest(written)
    m.kill9()
    assert_check_clean(m.pool)
    m.start()
    assert (m.path / "keep").read_bytes() == keep_data
    assert os.stat(m.path / "fill").st_size == written
    assert file_sha256(m.path / "fill") == fill_sum
    os.unlink(m.path / "fill")
    assert wait_until(lambda: free_bytes(m.path) >= written)
    (m.path / "again").write_bytes(b"a" * MiB)
    fsync_path(m.path / "again")
    m.unmount()
    assert_check_clean(m.pool)
