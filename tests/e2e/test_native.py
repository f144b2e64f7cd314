"""Tests of the compiled helper: CRC-32C, cache-line flushes and non-temporal copies."""

import json
import mmap
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpmemfs.native import crc32c, crc32c_hw, ffi, flush_kind, lib


def _ref_table() -> list[int]:
    table = []
    for i in range(256):
        r = i
        for _ in range(8):
            r = (r >> 1) ^ (0x82F63B78 if r & 1 else 0)
        table.append(r)
    return table


_TABLE = _ref_table()


def ref_crc32c(data: bytes, crc: int = 0) -> int:
    """Straight from the definition: reflected Castagnoli polynomial, inverted in and out."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


# RFC 3720 appendix B.4 plus the usual check value.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


CPU_FLAGS = _cpu_flags()
POOL_SIZE = 1 << 19


def _run_child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(params=["tmp", "shm"])
def pool_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A file on a disk file system or on /dev/shm, filled with 0xAA."""
    if request.param == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        d = tempfile.TemporaryDirectory(dir="/dev/shm")
        path = Path(d.name) / "pool"
    else:
        d = None
        path = tmp_path / "pool"
    path.write_bytes(b"\xaa" * POOL_SIZE)
    yield path
    if d is not None:
        d.cleanup()


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_crc32c_known_vectors(data: bytes, expected: int) -> None:
    assert crc32c(data) == expected
    assert ref_crc32c(data) == expected


def test_crc32c_chaining() -> None:
    rng = random.Random(1)
    data = rng.randbytes(1000)
    whole = crc32c(data)
    for cut in (0, 1, 7, 8, 9, 500, 999, 1000):
        assert crc32c(data[cut:], crc32c(data[:cut])) == whole
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283


def test_crc32c_matches_reference_on_random_data() -> None:
    rng = random.Random(2)
    blob = rng.randbytes(70000)
    view = memoryview(blob)
    # Every start alignment and every tail length around the 8-byte word path.
    for start in range(9):
        for length in (*range(0, 40), 63, 64, 65, 255, 4096, 4099):
            chunk = view[start : start + length]
            assert crc32c(chunk) == ref_crc32c(bytes(chunk)), (start, length)
    assert crc32c(blob) == ref_crc32c(blob)
    seed = rng.getrandbits(32)
    assert crc32c(blob, seed) == ref_crc32c(blob, seed)


def test_crc32c_accepts_buffers_without_len_in_bytes() -> None:
    data = bytes(range(256)) * 4
    assert crc32c(bytearray(data)) == crc32c(data)
    # len() of this view counts 4-byte items; the checksum must still cover every byte.
    words = memoryview(data).cast("I")
    assert len(words) == len(data) // 4
    assert crc32c(words) == ref_crc32c(data)


def test_crc32c_hw_on_sse42_cpu() -> None:
    if "sse4_2" not in CPU_FLAGS:
        pytest.skip("CPU lacks SSE4.2")
    assert crc32c_hw() is True


def test_crc32c_table_fallback_matches_reference() -> None:
    rng = random.Random(3)
    cases = [(rng.randrange(0, 3000), rng.getrandbits(32)) for _ in range(40)]
    code = (
        "import json, random, sys\n"
        "from rpmemfs.native import crc32c, crc32c_hw\n"
        "rng = random.Random(4)\n"
        f"cases = {cases!r}\n"
        "out = [crc32c(rng.randbytes(n), seed) for n, seed in cases]\n"
        "out.append(crc32c(b'123456789'))\n"
        "print(json.dumps({'hw': crc32c_hw(), 'crcs': out}))\n"
    )
    proc = _run_child(code, RPMEMFS_NO_CRC32C_HW="1")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["hw"] is False
    rng4 = random.Random(4)
    expected = [ref_crc32c(rng4.randbytes(n), seed) for n, seed in cases] + [0xE3069283]
    assert got["crcs"] == expected


def test_flush_kind_is_clwb_on_this_cpu() -> None:
    if "clwb" not in CPU_FLAGS:
        pytest.skip("CPU lacks clwb")
    assert flush_kind() == "clwb"
    assert lib.rpm_flush_kind() == 2


def _check_copies(path: Path) -> None:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    base = ffi.from_buffer(mm)
    rng = random.Random(5)
    try:
        pos = 64
        for misalign in range(0, 18):
            for length in (0, 1, 15, 16, 17, 31, 63, 64, 65, 200, 4095, 4096, 4097):
                dst = pos + misalign
                src = rng.randbytes(length)
                lib.rpm_memcpy_nt(base + dst, ffi.from_buffer(src), length)
                assert mm[dst : dst + length] == src, (misalign, length)
                # The bytes either side must be untouched: a head/tail overrun shows here.
                assert mm[dst - 1] == 0xAA and mm[dst + length] == 0xAA, (misalign, length)
                pos += length + 64
                assert pos < size
        before = mm[:]
        lib.rpm_flush(base + 3, 5000)
        lib.rpm_flush(base, 0)
        lib.rpm_flush_ranges(base, [0, 64, 100, 1, 4000, 9000, 7, 0], 4)
        lib.rpm_flush_ranges(base, [], 0)
        lib.rpm_drain()
        assert mm[:] == before
    finally:
        ffi.release(base)
        mm.close()
    # What went through the mapping is what the file holds.
    with open(path, "rb") as f:
        assert f.read() == before


def test_memcpy_nt_and_flush_on_real_mapping(pool_file: Path) -> None:
    _check_copies(pool_file)


@pytest.mark.parametrize(
    "env",
    [{"RPMEMFS_NO_CLWB": "1"}, {"RPMEMFS_NO_CLWB": "1", "RPMEMFS_NO_CLFLUSHOPT": "1"}],
    ids=["clflushopt", "clflush"],
)
def test_older_flush_instructions(env: dict[str, str], tmp_path: Path) -> None:
    expected = "clflush" if "RPMEMFS_NO_CLFLUSHOPT" in env else "clflushopt"
    if expected not in CPU_FLAGS:
        pytest.skip(f"CPU lacks {expected}")
    path = tmp_path / "pool"
    path.write_bytes(b"\xaa" * POOL_SIZE)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from rpmemfs.native import flush_kind\n"
        "from test_native import _check_copies\n"
        f"_check_copies(Path({str(path)!r}))\n"
        "print(flush_kind())\n"
    )
    proc = _run_child(code, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected]


# Flushing or copying one cache line past the end would touch a PROT_NONE page and
# die of SIGSEGV, which a child process turns into a visible return code.
_GUARD_CHILD = """
import ctypes, mmap, sys
from rpmemfs.native import ffi, lib
page = mmap.PAGESIZE
mm = mmap.mmap(-1, 2 * page)
base = ffi.from_buffer(mm)
addr = int(ffi.cast("uintptr_t", base))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(addr + page, page, 0) == 0  # PROT_NONE
src = bytes(range(256)) * 64
for start in (0, 1, page - 64, page - 65, page - 17, page - 3):
    n = page - start
    lib.rpm_flush(base + start, n)
    lib.rpm_flush_ranges(base, [start, n], 1)
    lib.rpm_memcpy_nt(base + start, ffi.from_buffer(src), n)
    assert mm[start:page] == src[:n]
lib.rpm_drain()
if sys.argv[1] == "overrun":
    lib.rpm_flush(base + page - 1, 2)
print("ok")
"""


def test_flush_and_copy_stop_at_the_range_end() -> None:
    ok = subprocess.run(
        [sys.executable, "-c", _GUARD_CHILD, "exact"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "ok"
    # The control: one byte too far must fault, or the guard page proves nothing.
    bad = subprocess.run(
        [sys.executable, "-c", _GUARD_CHILD, "overrun"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == -11, (bad.returncode, bad.stderr)


def test_missing_helper_is_a_clear_error() -> None:
    code = (
        "import sys\n"
        "sys.modules['rpmemfs._native'] = None  # what an install without the build looks like\n"
        "try:\n"
        "    import rpmemfs.native\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    proc = _run_child(code)
    assert proc.returncode == 0, proc.stderr
    assert "native helper is not built" in proc.stdout
    assert "pip install ." in proc.stdout
