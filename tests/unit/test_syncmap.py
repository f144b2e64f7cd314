"""The sync map (pool/syncmap.py) at a block per bit, as mkfs makes it now, and at 64 KiB per
bit, as pools made before have it: what is marked is durable before mark() returns, taken
as exactly the chunks it touched, and cleared by settle; and what it costs."""

from __future__ import annotations

import uuid

import pytest
from mempool import MemPersister

from rpmemfs.fs.mkfs import format_pool
from rpmemfs.pool.layout import BLOCK, Header, map_bytes, map_shift_for, plan
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.poolfile.grow import grown

SIZE = 16 << 20


def _pool(map_shift: int | None = None) -> tuple[bytearray, Header, MemPersister]:
    hdr = plan(SIZE, uuid.uuid4().bytes, 1, map_shift=map_shift)
    buf = bytearray(SIZE)
    format_pool(memoryview(buf), hdr, 0, 0)
    return buf, hdr, MemPersister(buf)


def _started(buf: bytearray, hdr: Header, persister: MemPersister) -> SyncMap:
    sm = SyncMap(memoryview(buf), hdr, persister.persist)
    sm.start(hdr, 2)
    sm.finish()  # a clean unmount: the map is reliable for the next mount
    return SyncMap(memoryview(buf), hdr, persister.persist)


def _after_crash(persister: MemPersister, hdr: Header) -> SyncMap:
    """The map as the media holds it when only what was persisted survived."""
    media = persister.media()
    return SyncMap(memoryview(media), hdr, lambda ranges: None)


def test_a_new_pool_has_a_bit_per_block_and_sends_exactly_the_blocks_written() -> None:
    buf, hdr, persister = _pool()
    assert hdr.map_chunk == BLOCK
    sm = _started(buf, hdr, persister)
    sm.start(hdr, 2)
    d = hdr.data_off
    writes = [(d + 5 * BLOCK, BLOCK), (d + 9 * BLOCK, BLOCK), (d + 10 * BLOCK, BLOCK),
              (d + 100 * BLOCK + 100, 200)]  # a small overwrite inside one block
    sm.mark([1], writes)
    assert sm.count(1) == 4 and sm.count(0) == 0
    assert sm.missed[1] == 3 * BLOCK + 200 and sm.missed[0] == 0
    # Durable before mark() returned: a crash now leaves the same bits.
    assert _after_crash(persister, hdr).count(1) == 4
    assert sm.take(1) == [(d + 5 * BLOCK, BLOCK), (d + 9 * BLOCK, 2 * BLOCK), (d + 100 * BLOCK, BLOCK)]
    assert sm.count(1) == 0 and sm.take(1) == []
    # Taken and not sent after all: pending again, and not missed twice.
    sm.mark([1], [(d + 5 * BLOCK, BLOCK)], again=True)
    assert sm.take(1) == [(d + 5 * BLOCK, BLOCK)] and sm.missed[1] == 3 * BLOCK + 200
    # Taken is not cleared: the durable bits stay until the replica is in sync.
    assert _after_crash(persister, hdr).count(1) == 4
    sm.settle(1)
    assert sm.missed[1] == 0
    assert _after_crash(persister, hdr).count(1) == 0


def test_a_long_range_is_marked_a_span_of_bytes_at_once_and_taken_as_one_run() -> None:
    buf, hdr, persister = _pool()
    sm = _started(buf, hdr, persister)
    sm.start(hdr, 2)
    start = hdr.data_off + 3 * BLOCK + 17  # unaligned at both ends: its first and last blocks count
    sm.mark([0, 1], [(start, 5 << 20)])
    first, last = start // BLOCK, (start + (5 << 20) - 1) // BLOCK
    assert sm.count(0) == sm.count(1) == last - first + 1
    crashed = _after_crash(persister, hdr)
    assert crashed.count(0) == crashed.count(1) == last - first + 1
    assert sm.take(1) == [(first * BLOCK, (last - first + 1) * BLOCK)]
    # Marked again where bits are set already: nothing new to persist.
    calls = len(persister.calls)
    sm.mark([0], [(start + BLOCK, BLOCK)])
    assert len(persister.calls) == calls


def test_the_end_of_the_content_bounds_the_last_chunk_and_the_map_itself_is_never_marked() -> None:
    buf, hdr, persister = _pool()
    sm = _started(buf, hdr, persister)
    sm.start(hdr, 1)
    sm.mark([0], [(hdr.map_off - 100, 50_000)])
    assert sm.take(0) == [(hdr.map_off - BLOCK, BLOCK)]
    assert sm.missed[0] == 100


def test_a_pool_made_with_64k_chunks_keeps_them() -> None:
    old_shift = 16  # what mkfs picked before for pools up to 4 GiB
    buf, hdr, persister = _pool(old_shift)
    assert hdr.map_chunk == 64 << 10
    assert Header.decode(bytes(buf[:4096])) == hdr  # it mounts as it is
    sm = _started(buf, hdr, persister)
    sm.start(hdr, 2)
    d = hdr.data_off  # 64 KiB aligned
    sm.mark([1], [(d + BLOCK, BLOCK), (d + 2 * BLOCK, 10), (d + (64 << 10), 1)])
    assert sm.count(1) == 2
    assert _after_crash(persister, hdr).count(1) == 2
    assert sm.take(1) == [(d, 128 << 10)]
    sm.settle(1)
    assert _after_crash(persister, hdr).count(1) == 0
    # Growing it keeps its chunk (and the map stays where the grown header says).
    bigger = grown(hdr, 4 * SIZE)
    assert bigger.map_shift == old_shift and bigger.data_blocks > hdr.data_blocks


def test_bits_from_an_earlier_mount_are_sent_but_what_they_cost_is_unknown() -> None:
    buf, hdr, persister = _pool()
    sm = _started(buf, hdr, persister)
    sm.start(hdr, 2)
    sm.mark([1], [(hdr.data_off, BLOCK)])
    sm.finish()
    again = SyncMap(memoryview(buf), hdr, persister.persist)
    again.start(hdr, 2)
    assert again.count(1) == 1 and again.missed[1] is None and again.missed[0] == 0
    again.mark([1], [(hdr.data_off + BLOCK, BLOCK)])
    assert again.missed[1] is None
    again.set_full(0)
    assert again.missed[0] is None
    again.settle(0)
    again.settle(1)
    assert again.missed == [0] * len(again.missed)


@pytest.mark.parametrize(("size", "chunk", "map_size"), [
    (4 << 20, BLOCK, 8 << 10),  # the smallest pool: a line per bitmap, in two blocks
    (1 << 30, BLOCK, (256 << 10) + BLOCK),  # 32 KiB per replica
    (64 << 30, BLOCK, (16 << 20) + BLOCK),  # the biggest with a bit per block: 2 MiB per replica
    (1 << 40, 64 << 10, (16 << 20) + BLOCK),  # 1 TiB: 64 KiB chunks, the map no bigger
])
def test_what_the_map_costs(size: int, chunk: int, map_size: int) -> None:
    shift = map_shift_for(size)
    assert 1 << shift == chunk
    assert map_bytes(size, shift) == map_size
