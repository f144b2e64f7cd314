"""A replica's place in the pool's history: the log sequence number and the time of the last
durability point it holds, stamped in the primary header block.

With asynchronous replication a replica may be behind the primary, and once the primary is
dead nothing else says by how much. So every batch the primary sends ends with this stamp
(written to the local pool too, so a replica that caught up equals the primary byte for byte):
the batch's writes are placed in order, so a replica holding a stamp holds every point up to
it. `rpmemfs promote` reads it from each replica it reaches and reports how far behind the most
advanced one its source was.

Every point that stores log records stamps them too, in any mode, once they are persistent:
a mount that finds a torn record followed by intact ones reads it to tell a crash inside the
store of a point that never ended (the stamp is older: drop them) from damage to an
acknowledged one (refuse the pool): rpmemfs/fs/log.py, scan.

    offset  size  field  (at POSITION_OFF of the pool, in block 0 after the replica table)
    0       8     magic b"RPMPOS\\0\\0"
    8       8     seq: the last log record of the point
    16      8     time of the point, ns since the epoch (the primary's clock)
    24      4     crc32c of the above
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from rpmemfs.native import crc32c
from rpmemfs.pool.layout import BLOCK, HEADER_OFF

MAGIC = b"RPMPOS\x00\x00"
_BODY = struct.Struct("<8sQQ")
_CRC = struct.Struct("<I")
SIZE = _BODY.size + _CRC.size
# Block 0 holds the header (its first bytes) and the replica table (2048 to 3088).
POSITION_OFF = HEADER_OFF + 3584
assert POSITION_OFF + SIZE <= HEADER_OFF + BLOCK


@dataclass(frozen=True)
class Position:
    seq: int
    time_ns: int

    def as_dict(self) -> dict[str, float | int]:
        return {"seq": self.seq, "time": self.time_ns / 1e9}


def encode(pos: Position) -> bytes:
    body = _BODY.pack(MAGIC, pos.seq, pos.time_ns)
    return body + _CRC.pack(crc32c(body))


def stamp(seq: int, time_ns: int | None = None) -> tuple[int, bytes]:
    """Where a stamp of a point whose last log record is ``seq`` goes, and its bytes (the time
    is now unless given)."""
    return POSITION_OFF, encode(Position(seq, time.time_ns() if time_ns is None else time_ns))


def decode(raw: bytes) -> Position | None:
    """The stamp, or None when there is none (a pool only ever replicated synchronously) or it
    is torn."""
    if len(raw) < SIZE:
        return None
    magic, seq, time_ns = _BODY.unpack_from(raw)
    (crc,) = _CRC.unpack_from(raw, _BODY.size)
    if magic != MAGIC or crc != crc32c(raw[: _BODY.size]):
        return None
    return Position(seq, time_ns)
