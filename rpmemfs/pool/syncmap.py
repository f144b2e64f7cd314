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

log = logging.getLogger(__name__)

MAGIC = b"RPMSYNC\x00"
F_OPEN = 1
S_FULL = 1
_HEAD = struct.Struct("<8sIIQ8s")
_CRC = struct.Struct("<I")
HEAD_BYTES = _HEAD.size + _CRC.size
LINE = 64

Ranges = list[tuple[int, int]]


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
        self.flags |= F_OPEN
        self._write_head()

    def finish(self) -> None:
        """The mount ended cleanly: every in-sync replica holds all of the pool."""
        self.flags &= ~F_OPEN
        self._write_head()

    def full(self, slot: int) -> bool:
        return bool(self.slot_flags[slot] & S_FULL) or not self.enabled

    def set_full(self, slot: int) -> None:
        if not self.slot_flags[slot] & S_FULL:
            self.slot_flags[slot] |= S_FULL
            self._write_head()

    # ---------------------------------------------------------------- the bitmaps

    def mark(self, slots: Iterable[int], ranges: Sequence[tuple[int, int]]) -> None:
        """These replicas miss ``ranges``: set their bits, durably, before anyone relies on it."""
        if not self.enabled:
            for slot in slots:
                self.set_full(slot)
            return
        shift, limit = self.shift, self.limit
        lines: set[int] = set()
        for slot in slots:
            base = self._slot_off(slot)
            pending = self.pending[slot]
            buf = self.buf
            for off, length in ranges:
                if length <= 0 or off >= limit:
                    continue
                first, last = off >> shift, (min(off + length, limit) - 1) >> shift
                for c in range(first, last + 1):
                    byte, bit = c >> 3, 1 << (c & 7)
                    pending[byte] |= bit
                    cur = buf[base + byte]
                    if not cur & bit:
                        buf[base + byte] = cur | bit
                        lines.add((base + byte) & ~(LINE - 1))
        if lines:
            self._persist([(line, LINE) for line in sorted(lines)])

    def count(self, slot: int) -> int:
        """Chunks still to send to this replica."""
        return sum(b.bit_count() for b in self.pending[slot])

    def take(self, slot: int) -> Ranges:
        """The chunks still to send, as merged (offset, length) runs; they are no longer
        pending afterwards (a barrier that touches one again marks it again)."""
        pending = self.pending[slot]
        runs: Ranges = []
        chunk, limit = self.chunk, self.limit
        for byte, value in enumerate(pending):
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
            pending[byte] = 0
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
        self._write_head()

    def settle(self, slot: int) -> None:
        """The replica holds everything: clear its bits and its FULL flag, durably."""
        self.pending[slot][:] = bytes(self.slot_bytes)
        if self.enabled:
            off = self._slot_off(slot)
            if any(self.buf[off : off + self.slot_bytes]):
                self.buf[off : off + self.slot_bytes] = bytes(self.slot_bytes)
                self._persist([(off, self.slot_bytes)])
        if self.slot_flags[slot]:
            self.slot_flags[slot] = 0
            self._write_head()
