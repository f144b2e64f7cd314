"""Tests of PoolMapping: the three mapping kinds, persistence, bounds and lifetime."""

import errno
import logging
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpmemfs import pmem
from rpmemfs.native import ffi
from rpmemfs.pmem import MAP_SHARED_VALIDATE, MAP_SYNC, PMEM_MODES, PmemError, PoolMapping

PAGE = mmap.PAGESIZE
SIZE = 64 * PAGE


@pytest.fixture(params=["tmp", "shm"])
def pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A zero-filled pool file on a disk file system or on /dev/shm."""
    if request.param == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        d = tempfile.TemporaryDirectory(dir="/dev/shm")
        path = Path(d.name) / "pool"
    else:
        d = None
        path = tmp_path / "pool"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    yield path
    if d is not None:
        d.cleanup()


def pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def test_modes_constant() -> None:
    assert PMEM_MODES == ("auto", "force", "msync")


@pytest.mark.parametrize(
    ("mode", "kind", "is_pmem"),
    # Neither /tmp nor /dev/shm is DAX, so auto must fall back to msync.
    [("auto", "msync", False), ("force", "force", True), ("msync", "msync", False)],
)
def test_open_kinds_and_persist_visible_to_pread(pool: Path, mode: str, kind: str, is_pmem: bool) -> None:
    with PoolMapping.open(str(pool), mode) as pm:
        assert (pm.path, pm.size, pm.requested) == (str(pool), SIZE, mode)
        assert (pm.kind, pm.is_pmem) == (kind, is_pmem)
        assert len(pm.buf) == SIZE and not pm.buf.readonly
        pm.buf[100:105] = b"hello"
        pm.buf[SIZE - 3 :] = b"end"
        pm.persist([(100, 5), (SIZE - 3, 3)])
        assert pread(pool, 100, 5) == b"hello"
        assert pread(pool, SIZE - 3, 3) == b"end"
        # A second, independent mapping sees the same bytes.
        with PoolMapping.open(str(pool), "msync", readonly=True) as other:
            assert bytes(other.buf[100:105]) == b"hello"


def test_force_mode_warns_that_durability_is_emulated(pool: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rpmemfs.pmem"):
        PoolMapping.open(str(pool), "force").close()
    warnings = [r for r in caplog.records if r.name == "rpmemfs.pmem"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "emulated" in warnings[0].getMessage()


def test_msync_mode_does_not_warn(pool: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rpmemfs.pmem"):
        PoolMapping.open(str(pool), "msync").close()
    assert not [r for r in caplog.records if r.name == "rpmemfs.pmem"]


def _page_dirty(pm: PoolMapping, offset: int) -> bool | None:
    """The kernel's dirty flag of the page cache page behind ``offset``, None if hidden."""
    with ffi.from_buffer(pm.buf) as base:
        addr = int(ffi.cast("uintptr_t", base)) + offset
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // PAGE * 8)
            (entry,) = struct.unpack("<Q", f.read(8))
        pfn = entry & ((1 << 55) - 1)
        if not entry >> 63 or pfn == 0:  # not present, or PFNs hidden without privilege
            return None
        with open("/proc/kpageflags", "rb") as f:
            f.seek(pfn * 8)
            (flags,) = struct.unpack("<Q", f.read(8))
    except OSError:
        return None
    return bool(flags >> 4 & 1)  # KPF_DIRTY


def test_msync_mode_really_writes_back(tmp_path: Path) -> None:
    # A disk file system: there, a written page stays dirty until written back.
    path = tmp_path / "pool"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    with PoolMapping.open(str(path), "msync") as pm:
        for page in (1, 2, 5, 9):
            pm.buf[page * PAGE + 7] = 1
        if not all(_page_dirty(pm, p * PAGE) for p in (1, 2, 5, 9)):
            pytest.skip("page dirty flags are not observable here")
        pm.persist([])
        assert _page_dirty(pm, PAGE) is True
        pm.persist([(PAGE + 7, 1), (2 * PAGE, 0)])
        assert _page_dirty(pm, PAGE) is False
        assert _page_dirty(pm, 2 * PAGE) is True  # an empty range writes nothing back
        pm.persist_ordered([(5 * PAGE + 4000, 1)], [(9 * PAGE, PAGE)])
        assert _page_dirty(pm, 5 * PAGE) is False
        assert _page_dirty(pm, 9 * PAGE) is False
        assert _page_dirty(pm, 2 * PAGE) is True
    assert pread(path, 5 * PAGE + 7, 1) == b"\x01"


def test_msync_spans_are_page_aligned_and_coalesced() -> None:
    pairs = [3 * PAGE + 10, 1, 10, 5, 5000, 10, 20 * PAGE - 1, 2, 7 * PAGE, 0]
    spans = pmem._page_spans(pairs, 20 * PAGE + 100)
    # Pages 0 and 1 touch, so one msync covers both; the last span stops at the file end.
    assert spans == [(0, 2 * PAGE), (3 * PAGE, 4 * PAGE), (19 * PAGE, 20 * PAGE + 100)]
    assert pmem._page_spans([], SIZE) == []


@pytest.mark.parametrize("mode", PMEM_MODES)
@pytest.mark.parametrize("bad", [(SIZE - 1, 2), (-1, 1), (0, -1), (SIZE, 1), (0, SIZE + 1)])
def test_out_of_range_raises(pool: Path, mode: str, bad: tuple[int, int]) -> None:
    with PoolMapping.open(str(pool), mode) as pm:
        pm.persist([(0, SIZE), (SIZE, 0)])  # the whole pool and an empty tail are fine
        with pytest.raises(ValueError, match="outside the pool"):
            pm.persist([(0, 1), bad])
        with pytest.raises(ValueError, match="outside the pool"):
            pm.persist_ordered([(0, 1)], [bad])
        if bad[1] >= 0:
            with pytest.raises(ValueError, match="outside the pool"):
                pm.write_nt(bad[0], b"x" * bad[1])


@pytest.mark.parametrize("mode", PMEM_MODES)
def test_persist_then_store_stores_the_record_then_the_stamp(pool: Path, mode: str) -> None:
    """A durability point's commit (rpmemfs/durability/point.py): the data, then the log
    record, then the stamp that says the point ended; a range outside the pool stores none."""
    with PoolMapping.open(str(pool), mode) as pm:
        pm.buf[8192:8196] = b"data"
        pm.persist_then_store([(8192, 4)], 4096, b"record", then=(3584, b"stamp"))
        assert pread(pool, 4096, 6) == b"record" and pread(pool, 3584, 5) == b"stamp"
        pm.persist_then_store([], 5000, b"alone")  # no stamp: the record only
        assert pread(pool, 5000, 5) == b"alone"
        with pytest.raises(ValueError, match="outside the pool"):
            pm.persist_then_store([], 6000, b"never", then=(SIZE - 2, b"stamp"))
        assert pread(pool, 6000, 5) == bytes(5)


@pytest.mark.parametrize("mode", PMEM_MODES)
def test_write_nt(pool: Path, mode: str) -> None:
    with PoolMapping.open(str(pool), mode) as pm:
        data = bytes(range(256)) * 40
        for off in (0, 1, 15, 17, 4095, 9000):
            pm.write_nt(off + 3 * PAGE, data[: 100 + off])
        pm.write_nt(SIZE - 5, memoryview(b"tail!"))
        pm.write_nt(10, b"")
        # len() of this view is 4; it carries 16 bytes.
        pm.write_nt(20 * PAGE, memoryview(bytes(range(16))).cast("I"))
        if not pm.is_pmem:
            pm.persist([(3 * PAGE, 13000), (SIZE - 5, 5), (20 * PAGE, 16)])
        assert pread(pool, 9000 + 3 * PAGE, 9100) == data[:9100]
        assert pread(pool, SIZE - 5, 5) == b"tail!"
        assert pread(pool, 20 * PAGE, 17) == bytes(range(16)) + b"\0"
        assert pread(pool, 3 * PAGE - 1, 1) == b"\0"


def test_readonly_mapping_refuses_writes(pool: Path) -> None:
    with PoolMapping.open(str(pool), "msync") as pm:
        pm.buf[0:4] = b"data"
        pm.persist([(0, 4)])
    for mode in PMEM_MODES:
        with PoolMapping.open(str(pool), mode, readonly=True) as ro:
            assert ro.buf.readonly
            assert bytes(ro.buf[0:4]) == b"data"
            with pytest.raises(TypeError):
                ro.buf[0] = 1
            with pytest.raises(PmemError, match="read-only"):
                ro.write_nt(0, b"x")
            ro.persist([(0, 4)])
    assert pread(pool, 0, 4) == b"data"


@pytest.mark.parametrize("mode", PMEM_MODES)
def test_close_is_idempotent_and_final(pool: Path, mode: str) -> None:
    pm = PoolMapping.open(str(pool), mode)
    pm.close()
    pm.close()
    with pytest.raises(ValueError):
        pm.persist([(0, 1)])
    with pytest.raises(ValueError):
        pm.write_nt(0, b"x")
    with pytest.raises(ValueError):
        pm.buf[0]  # noqa: B018 - the access itself is what must fail
    with PoolMapping.open(str(pool), mode) as pm2:
        pass
    with pytest.raises(ValueError):
        pm2.persist([(0, 1)])


def test_close_with_live_view_keeps_mapping_usable(pool: Path) -> None:
    pm = PoolMapping.open(str(pool), "force")
    view = pm.buf[10:20]
    with pytest.raises(BufferError):
        pm.close()
    view[0] = 42
    pm.buf[11] = 43
    pm.persist([(10, 2)])
    assert pread(pool, 10, 2) == b"\x2a\x2b"
    view.release()
    pm.close()
    with pytest.raises(ValueError):
        pm.persist([(0, 1)])


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pmem mode"):
        PoolMapping.open(str(tmp_path / "x"), "dax")
    with pytest.raises(PmemError, match="cannot open"):
        PoolMapping.open(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.touch()
    with pytest.raises(PmemError, match="empty"):
        PoolMapping.open(str(empty))


class _MapRecorder:
    """Stands in for mmap.mmap: records the flags and maps without MAP_SYNC."""

    def __init__(self, real: type[mmap.mmap], fail_errno: int | None) -> None:
        self.real = real
        self.fail_errno = fail_errno
        self.flags: list[int] = []

    def __call__(self, fd: int, size: int, flags: int = mmap.MAP_SHARED, **kw: int) -> mmap.mmap:
        self.flags.append(flags)
        if flags & MAP_SYNC:
            if self.fail_errno is not None:
                raise OSError(self.fail_errno, os.strerror(self.fail_errno))
            flags = mmap.MAP_SHARED
        return self.real(fd, size, flags=flags, **kw)


def test_auto_uses_map_sync_when_the_kernel_accepts_it(pool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _MapRecorder(mmap.mmap, None)
    monkeypatch.setattr(mmap, "mmap", rec)
    with PoolMapping.open(str(pool), "auto") as pm:
        assert rec.flags == [MAP_SHARED_VALIDATE | MAP_SYNC] == [0x80003]
        assert (pm.kind, pm.is_pmem) == ("dax", True)
        pm.write_nt(5, b"dax")
        assert pread(pool, 5, 3) == b"dax"


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.EINVAL])
def test_auto_falls_back_when_map_sync_is_refused(
    pool: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    rec = _MapRecorder(mmap.mmap, err)
    monkeypatch.setattr(mmap, "mmap", rec)
    with PoolMapping.open(str(pool), "auto") as pm:
        assert pm.kind == "msync"
    assert rec.flags == [MAP_SHARED_VALIDATE | MAP_SYNC, mmap.MAP_SHARED]


def test_auto_reports_other_map_sync_failures(pool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mmap, "mmap", _MapRecorder(mmap.mmap, errno.ENOMEM))
    with pytest.raises(PmemError, match="MAP_SYNC"):
        PoolMapping.open(str(pool), "auto")
