"""The sync map: which chunks of the pool each replica may be missing, kept in the pool.

While a replica is out of sync (unreachable, failed a barrier, resyncing) every barrier's
ranges are marked in its bitmap before the fsync returns, so that when the replica comes
back, even after this node restarted, it is sent only those chunks. The map lives at the end
of the pool (``Header.map_off``), is written by this node only and never replicated:

    offset  size  field
    0       8     magic b"RPMSYNC\\0"
    8       4     flags: bit 0 = a mount is using the pool (set at mount, cleared at unmount)
    12      4     reserved
    16      8     the pool header's epoch when the map was last written
    24      8     per replica slot: bit 0 = FULL (what it misses is unknown: compare everything)
    32      4     crc32c of the above
    BLOCK   ...   MAP_SLOTS bitmaps of Header.map_slot_bytes, a bit per chunk

The chunk (``Header.map_chunk``) is a block in pools mkfs makes now, up to 64 GiB, so that a
resync sends the blocks that changed rather than the 64 KiB around each of them; pools made
before have chunks of 64 KiB or more, and keep them.

A map whose header is torn, blank, or from another epoch (a replica's pool mounted on its own
after a failover carries the untouched map of the pool it was copied from) says nothing
reliable: every slot is then FULL. So is every slot after a mount that did not end cleanly:
stores into the pool between two barriers reach neither the replicas nor the map, and a
crash leaves them behind locally only.

Slot i belongs to the i-th replica of the pool's replica table.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Sequence

from rpmemfs.native import crc32c
from rpmemfs.pool.layout import BLOCK, MAP_SLOTS, Header
from rpmemfs.ranges import Ranges

log = logging.getLogger(__name__)

MAGIC = b"RPMSYNC\x00"
F_OPEN = 1
S_FULL = 1
_HEAD = struct.Struct("<8sIIQ8s")
_CRC = struct.Struct("<I")
HEAD_BYTES = _HEAD.size + _CRC.size
LINE = 64
_PAGE = 4096
_ZERO_PAGE = bytes(_PAGE)

def encode_head(flags: int, epoch: int, slot_flags: Sequence[int]) -> bytes:
    body = _HEAD.pack(MAGIC, flags, 0, epoch, bytes(slot_flags))
    return body + _CRC.pack(crc32c(body))


def decode_head(raw: bytes) -> tuple[int, int, list[int]] | None:
    """(flags, epoch, slot flags), or None when the header is blank, torn or foreign."""
    if len(raw) < HEAD_BYTES:
        return None
    magic, flags, _, epoch, slots = _HEAD.unpack_from(raw)
    (crc,) = _CRC.unpack_from(raw, _HEAD.size)
    if magic != MAGIC or crc != crc32c(raw[: _HEAD.size]):
        return None
    return flags, epoch, list(slots)


def format_map(buf: memoryview, hdr: Header) -> Ranges:
    """Write the empty map of a new pool; the ranges to persist."""
    if not hdr.map_shift:
        return []
    raw = encode_head(0, hdr.epoch, [0] * MAP_SLOTS)
    buf[hdr.map_off : hdr.map_off + len(raw)] = raw
    return [(hdr.map_off, len(raw))]


class SyncMap:
    """The sync map of a mounted pool: durable bits in the pool, and what is still to send.

    ``pending`` is the DRAM copy a resync takes chunks from; the durable bits are cleared
    only when the replica is in sync again, so a resync cut short starts over from them.
    """

    def __init__(self, buf: memoryview, hdr: Header, persist: Callable[[Ranges], None]) -> None:
        self.buf = buf
        self.hdr = hdr
        self._persist = persist
        self.enabled = bool(hdr.map_shift)
        self.shift = hdr.map_shift
        self.chunk = hdr.map_chunk
        self.limit = hdr.map_off  # chunks cover the replicated content only
        self.slot_bytes = hdr.map_slot_bytes
        self.nchunks = -(-self.limit >> self.shift) if self.enabled else 0
        self.flags = 0
        self.slot_flags = [0] * MAP_SLOTS
        self.pending = [bytearray(self.slot_bytes) for _ in range(MAP_SLOTS)]
        self.reliable = False
        if self.enabled:
            head = decode_head(bytes(buf[hdr.map_off : hdr.map_off + HEAD_BYTES]))
            if head is not None and head[1] == hdr.epoch:
                self.flags, _, self.slot_flags = head[0], head[1], head[2]
                self.reliable = not self.flags & F_OPEN
            for i in range(MAP_SLOTS):
                off = self._slot_off(i)
                self.pending[i][:] = buf[off : off + self.slot_bytes]
        # Bytes of the ranges each replica missed since it was last in sync: what a resync
        # sends is measured against it. None when unknown (bits or FULL from before this mount).
        self.missed: list[int | None] = [
            None if self.slot_flags[i] & S_FULL or _any_bit(self.pending[i]) else 0 for i in range(MAP_SLOTS)]

    def _slot_off(self, slot: int) -> int:
        return self.hdr.map_off + BLOCK + slot * self.slot_bytes

    # ---------------------------------------------------------------- the header

    def _write_head(self) -> None:
        if not self.enabled:
            return
        raw = encode_head(self.flags, self.hdr.epoch, self.slot_flags)
        off = self.hdr.map_off
        self.buf[off : off + len(raw)] = raw
        self._persist([(off, len(raw))])

    def start(self, hdr: Header, slots: int) -> None:
        """A mount begins (its epoch is ``hdr.epoch``): what the map knows stays, the rest
        (a crash, a foreign map) makes every slot FULL."""
        self.hdr = hdr
        if not self.reliable:
            for i in range(slots):
                self.slot_flags[i] |= S_FULL
                self.missed[i] = None
        self.flags |= F_OPEN
        self._write_head()

    def finish(self) -> None:
        """The mount ended cleanly: every in-sync replica holds all of the pool."""
        self.flags &= ~F_OPEN
        self._write_head()

    def full(self, slot: int) -> bool:
        return bool(self.slot_flags[slot] & S_FULL) or not self.enabled

    def set_full(self, slot: int) -> None:
        self.missed[slot] = None
        if not self.slot_flags[slot] & S_FULL:
            self.slot_flags[slot] |= S_FULL
            self._write_head()

    # ---------------------------------------------------------------- the bitmaps

    def mark(self, slots: Iterable[int], ranges: Sequence[tuple[int, int]], *, again: bool = False) -> None:
        """These replicas miss ``ranges``: set their bits, durably, before anyone relies on it.
        ``again``: chunks taken and not sent after all, already counted in ``missed``."""
        if not self.enabled:
            for slot in slots:
                self.set_full(slot)
            return
        shift, limit = self.shift, self.limit
        spans = [(off >> shift, (min(off + length, limit) - 1) >> shift, min(off + length, limit) - off)
                 for off, length in ranges if length > 0 and off < limit]
        lines: set[int] = set()
        for slot in slots:
            base = self._slot_off(slot)
            pending = self.pending[slot]
            for first, last, _ in spans:
                _set_bits(pending, 0, first, last)
                changed = _set_bits(self.buf, base, first, last)
                if changed is not None:
                    lines.update(range((base + changed[0]) & ~(LINE - 1), base + changed[1] + 1, LINE))
            missed = self.missed[slot]
            if missed is not None and not again:
                self.missed[slot] = missed + sum(n for _, _, n in spans)
        if lines:
            self._persist([(line, LINE) for line in sorted(lines)])

    def count(self, slot: int) -> int:
        """Chunks still to send to this replica."""
        return int.from_bytes(self.pending[slot], "little").bit_count()

    def take(self, slot: int) -> Ranges:
        """The chunks still to send, as merged (offset, length) runs; they are no longer
        pending afterwards (a barrier that touches one again marks it again)."""
        pending = self.pending[slot]
        runs: Ranges = []
        chunk, limit = self.chunk, self.limit
        # A bitmap of a big pool is mostly zero: skip it a page at a time.
        for page in range(0, len(pending), _PAGE):
            part = pending[page : page + _PAGE]
            if part == _ZERO_PAGE[: len(part)]:
                continue
            for byte in range(page, min(page + _PAGE, len(pending))):
                value = pending[byte]
                if not value:
                    continue
                for bit in range(8):
                    if value & (1 << bit):
                        start = ((byte << 3) + bit) * chunk
                        end = min(start + chunk, limit)
                        if runs and runs[-1][0] + runs[-1][1] == start:
                            runs[-1] = (runs[-1][0], end - runs[-1][0])
                        else:
                            runs.append((start, end - start))
            pending[page : page + _PAGE] = _ZERO_PAGE[: len(part)]
        return runs

    def move(self, src: int, dst: int) -> None:
        """Slot ``src`` becomes slot ``dst`` (a replica before it left the table): its bits
        and flags, durably; ``src`` is left empty."""
        self.pending[dst][:] = self.pending[src]
        self.pending[src][:] = bytes(self.slot_bytes)
        if self.enabled:
            a, b = self._slot_off(src), self._slot_off(dst)
            self.buf[b : b + self.slot_bytes] = self.buf[a : a + self.slot_bytes]
            self.buf[a : a + self.slot_bytes] = bytes(self.slot_bytes)
            self._persist([(b, self.slot_bytes), (a, self.slot_bytes)])
        self.slot_flags[dst], self.slot_flags[src] = self.slot_flags[src], 0
        self.missed[dst], self.missed[src] = self.missed[src], 0
        self._write_head()

    def settle(self, slot: int) -> None:
        """The replica holds everything: clear its bits and its FULL flag, durably."""
        self.missed[slot] = 0
        self.pending[slot][:] = bytes(self.slot_bytes)
        if self.enabled:
            off = self._slot_off(slot)
            if _any_bit(self.buf[off : off + self.slot_bytes]):
                self.buf[off : off + self.slot_bytes] = bytes(self.slot_bytes)
                self._persist([(off, self.slot_bytes)])
        if self.slot_flags[slot]:
            self.slot_flags[slot] = 0
            self._write_head()


def _any_bit(bitmap: bytearray | memoryview) -> bool:
    # One pass in C: a bitmap is up to 2 MiB, too long to walk a byte at a time in Python.
    return bool(int.from_bytes(bitmap, "little"))


def _set_bits(bitmap: bytearray | memoryview, base: int, first: int, last: int) -> tuple[int, int] | None:
    """Set bits ``first``..``last`` of the bitmap at ``base`` in one read-modify-write of the
    bytes they span (a long run is one slice, not a bit at a time); the span of bytes that
    changed, relative to ``base``, or None when every bit was set already."""
    lo, hi = first >> 3, last >> 3
    old = int.from_bytes(bitmap[base + lo : base + hi + 1], "little")
    new = old | ((1 << (last - first + 1)) - 1) << (first & 7)
    if new == old:
        return None
    bitmap[base + lo : base + hi + 1] = new.to_bytes(hi - lo + 1, "little")
    return lo, hi
