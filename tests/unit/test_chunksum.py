"""The checksum pools are compared by sees a difference confined to one of the pool's own
CRC-32C-protected structures, which a CRC-32C over the chunk cannot (rpmemfs/chunksum.py)."""

from __future__ import annotations

import os

from rpmemfs.chunksum import chunk_sums
from rpmemfs.native import crc32c
from rpmemfs.pool import position
from rpmemfs.pool.layout import AreaHeader

CHUNK = 64 << 10


def _chunk_with(at: int, record: bytes, base: bytes) -> memoryview:
    buf = bytearray(base)
    buf[at:at + len(record)] = record
    return memoryview(buf)


def test_two_log_area_headers_of_different_generations_are_told_apart() -> None:
    base = os.urandom(CHUNK)
    uuid = os.urandom(16)
    old = _chunk_with(8192, AreaHeader(1, 1, 1, uuid).encode(), base)
    new = _chunk_with(8192, AreaHeader(3, 4005, 4006, uuid).encode(), base)
    assert bytes(old) != bytes(new)
    # Why the compare is not CRC-32C: both structures are body + CRC-32C(body), so they
    # differ by a CRC-32C codeword, and the chunk's CRC-32C is the same.
    assert crc32c(old) == crc32c(new)
    assert chunk_sums(old, 0, CHUNK, CHUNK) != chunk_sums(new, 0, CHUNK, CHUNK)


def test_two_position_stamps_are_told_apart() -> None:
    base = os.urandom(CHUNK)
    a = _chunk_with(position.POSITION_OFF, position.encode(position.Position(10, 1)), base)
    b = _chunk_with(position.POSITION_OFF, position.encode(position.Position(99, 2)), base)
    assert crc32c(a) == crc32c(b)
    assert chunk_sums(a, 0, CHUNK, CHUNK) != chunk_sums(b, 0, CHUNK, CHUNK)


def test_chunks_are_cut_as_asked_and_the_last_may_be_short() -> None:
    data = memoryview(os.urandom(3 * 4096 + 100))
    sums = chunk_sums(data, 4096, 2 * 4096 + 100, 4096)
    assert len(sums) == 3
    assert sums[2] == chunk_sums(memoryview(bytes(data[3 * 4096:])), 0, 100, 4096)[0]
