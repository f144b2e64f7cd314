"""The two log areas: choosing the active one, reading it back, appending, checkpointing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rpmemfs.fs import records as R
from rpmemfs.fs.record_format import ALIGN
from rpmemfs.native import log_scan
from rpmemfs.pool import position
from rpmemfs.pool.layout import AREA_HDR_BYTES, AREA_RECORDS_OFF, AreaHeader, Header, PoolFormatError
from rpmemfs.ranges import Ranges


class LogFull(Exception):
    """The record does not fit in what is left of the active area."""


@dataclass
class LogScan:
    """What reading a pool's log found: the records to replay and where the log ends."""

    active: int
    area_header: AreaHeader
    records: list[R.RecordView] = field(default_factory=list)
    tail: int = AREA_RECORDS_OFF
    next_seq: int = 1
    other_gen: int | None = None
    # Past the tail: intact records of a point that never ended (their store was torn), as a
    # pool range (offset, length) that a writable mount erases before it appends.
    stale: tuple[int, int] | None = None


def scan(buf: memoryview, hdr: Header) -> LogScan:
    """Find the active area and its intact records; PoolFormatError on damage, never a guess."""
    heads: list[tuple[int, AreaHeader]] = []
    for i in (0, 1):
        off = hdr.area_off(i)
        ah = AreaHeader.decode(buf[off: off + AREA_HDR_BYTES])
        if ah is not None and ah.uuid == hdr.uuid:
            heads.append((i, ah))
    if not heads:
        raise PoolFormatError("no valid log area: both log area headers are damaged")
    heads.sort(key=lambda x: x[1].gen, reverse=True)
    active, ah = heads[0]
    result = LogScan(active, ah, other_gen=heads[1][1].gen if len(heads) > 1 else None)
    area = buf[hdr.area_off(active): hdr.area_off(active) + hdr.area_size]
    off, seq = AREA_RECORDS_OFF, ah.start_seq
    pairs = log_scan(area, off, seq)
    view, head, m = R.RecordView, R.REC_BYTES, ALIGN - 1
    found = result.records = [
        view(o, head + ((n + m) & ~m), seq + i, area[o + head: o + head + n])
        for i, (o, n) in enumerate(zip(pairs[::2], pairs[1::2], strict=True))]
    if found:
        off = found[-1].offset + found[-1].length
        seq += len(found)
    if seq <= ah.snap_end_seq:
        raise PoolFormatError(
            f"checkpoint damaged: snapshot record seq {seq} at pool offset "
            f"{hdr.area_off(active) + off} of log area {active} fails its checksum")
    later = R.find_later_record(area, off, seq - 1)
    if later is not None:
        # Torn, with intact records after it: a crash inside the store of a point's records
        # (written back in any order until fenced), or damage to a point that ended. Every
        # point stamps its last record's seq once its records are persistent, so a stamp
        # below this record's seq says its point never ended and nothing from here on was
        # acknowledged. Without a stamp (an older pool, or the stamp damaged) there is no
        # telling: refuse.
        stamp = position.decode(bytes(buf[position.POSITION_OFF: position.POSITION_OFF + position.SIZE]))
        if stamp is None or stamp.seq >= seq:
            raise PoolFormatError(
                f"log damaged: record seq {seq} at pool offset {hdr.area_off(active) + off} of log "
                f"area {active} fails its checksum but intact later records follow it (at pool "
                f"offset {hdr.area_off(active) + later}); refusing to drop acknowledged changes")
        end = _stale_end(area, later)
        result.stale = (hdr.area_off(active) + off, end - off)
    result.tail, result.next_seq = off, seq
    return result


def _stale_end(area: memoryview, at: int) -> int:
    """The end of the last intact record from ``at`` on, over any torn ones between them: the
    records of the point whose store was torn (they are numbered on from each other)."""
    _crc, _length, seq = R.REC.unpack_from(area, at)
    end = at
    while True:
        rec = R.read_record(area, at, seq)
        if rec is not None:
            end, at, seq = at + rec.length, at + rec.length, seq + 1
            continue
        nxt = R.find_later_record(area, at, seq - 1)
        if nxt is None:
            return end
        at = nxt
        seq = R.REC.unpack_from(area, at)[2]


class Log:
    """Appends records to the active area of a mapped pool; tracks what is durable.

    Records are staged in DRAM and copied into the pool only at a durability point, after
    the data they describe is durable: a record stored earlier could reach the media by
    cache eviction ahead of that data, and its checksum would not reveal it.
    """

    def __init__(self, buf: memoryview, hdr: Header, found: LogScan) -> None:
        self.buf = buf
        self.hdr = hdr
        self.active = found.active
        self.gen = found.area_header.gen
        self.base = hdr.area_off(self.active)
        self.size = hdr.area_size
        self.snap_bytes = sum(r.length for r in found.records
                              if r.seq <= found.area_header.snap_end_seq)
        self.tail = found.tail
        self.next_seq = found.next_seq
        self.durable_tail = found.tail
        self.written = found.tail  # the pool holds records up to here; the rest is staged
        self.stage = bytearray()
        self.durable_seq = found.next_seq - 1
        self.records = 0
        self.checkpoints = 0

    @property
    def used(self) -> int:
        return self.tail - AREA_RECORDS_OFF

    @property
    def capacity(self) -> int:
        return self.size - AREA_RECORDS_OFF

    @property
    def tail_bytes(self) -> int:
        """Log bytes after the snapshot: what a mount replays beyond it, and what a
        checkpoint would save every later mount from replaying."""
        return self.used - self.snap_bytes

    def room(self) -> int:
        return self.size - self.tail

    def append(self, payload: bytes) -> int:
        seq = self.next_seq
        rec = R.frame(seq, payload)
        if self.tail + len(rec) > self.size:
            raise LogFull
        self.stage += rec
        self.tail += len(rec)
        self.next_seq = seq + 1
        self.records += 1
        return seq

    def take_staged(self) -> tuple[int, bytes] | None:
        """The staged records and the pool offset they go to; the caller stores them."""
        if not self.stage:
            return None
        out = (self.base + self.written, bytes(self.stage))
        self.stage = bytearray()
        self.written = self.tail
        return out

    def mark_durable(self, tail: int, seq: int) -> None:
        """Records below tail (up to seq) are durable; called after the ranges were persisted."""
        if seq > self.durable_seq:
            self.durable_tail, self.durable_seq = tail, seq

    def checkpoint(self, payloads: Iterable[bytes],
                   persist: Callable[[Ranges], None]) -> None:
        """Write a snapshot into the other area and switch to it.

        The snapshot is made durable before the area header that makes it active, so a crash
        at any point leaves either the old area (untouched) or the new one complete.
        """
        other = 1 - self.active
        base = self.hdr.area_off(other)
        start_seq = self.next_seq
        off, seq = AREA_RECORDS_OFF, start_seq
        for payload in payloads:
            rec = R.frame(seq, payload)
            if off + len(rec) > self.size:
                raise LogFull
            self.buf[base + off: base + off + len(rec)] = rec
            off += len(rec)
            seq += 1
        persist([(base + AREA_RECORDS_OFF, off - AREA_RECORDS_OFF)])
        ah = AreaHeader(self.gen + 1, start_seq, seq - 1, self.hdr.uuid)
        raw = ah.encode()
        self.buf[base: base + len(raw)] = raw
        persist([(base, len(raw))])
        self.active, self.gen, self.base = other, ah.gen, base
        self.snap_bytes = off - AREA_RECORDS_OFF
        self.tail = self.durable_tail = self.written = off
        self.stage = bytearray()  # its records are part of the snapshot
        self.next_seq = seq
        self.durable_seq = seq - 1
        self.checkpoints += 1
