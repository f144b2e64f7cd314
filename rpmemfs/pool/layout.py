"""Where things live in a pool, and the pool header.

A pool is one file:

    [0, 4K)          primary header
    [4K, 8K)         backup header (mkfs writes both; mount repairs one from the other)
    [8K, 8K+A)       log area 0
    [8K+A, 8K+2A)    log area 1
    [data_off, map_off)  data blocks of BLOCK bytes
    [map_off, end)   sync map (format version 2): per replica, the chunks it may be missing
                     (chunks of a block for new pools up to 64 GiB; 64 KiB or more in
                     pools made before)

Only ``[0, map_off)`` is the pool's content, the same on every replica. The sync map is this
node's own record of which replicas lag behind where (rpmemfs.pool.syncmap.py); it is
never sent to a replica, and a version 1 pool has none (its map_off is its size).

Only one log area is active: the one whose area header is valid and has the highest
generation. A checkpoint writes a snapshot of the whole metadata into the other area and
switches by writing that area's header last, so a crash at any point leaves one intact area.
"""

from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import dataclass

from rpmemfs.errors import RpmemfsError
from rpmemfs.native import crc32c

MAGIC = b"RPMEMFS\x00"
VERSION = 2
VERSIONS = (1, 2)  # version 1: no sync map
BLOCK = 4096
BLOCK_SHIFT = 12
HEADER_OFF = 0
BACKUP_OFF = 4096
AREAS_OFF = 8192
MIN_POOL = 4 << 20
MIN_AREA = 256 << 10
MAX_AREA = 1 << 30
DATA_ALIGN = 64 << 10
MAP_SLOTS = 8  # replicas a sync map has room for
# A new pool's sync map chunk is a block, so that a resync sends what changed, not the 64 KiB
# around each 4 KiB write (pools made before had 64 KiB chunks at least, and keep them), up
# to 2**24 bits (2 MiB) per replica's bitmap: chunks of a block for pools up to 64 GiB,
# larger above (64 KiB at 1 TiB), a map of at most 16 MiB.
MAP_MIN_SHIFT = BLOCK_SHIFT
MAP_MAX_BITS = 1 << 24

# magic, version, flags, uuid, pool_size, block_size, map_shift (0: no sync map), area_size,
# data_off, data_blocks, created_ns, epoch; crc follows over all of these.
_HDR = struct.Struct("<8sII16sQIIQQQQQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HDR.size + _CRC.size

AREA_MAGIC = b"RPMLOG\x00\x01"
# magic, gen, start_seq (first record), snap_end_seq (last snapshot record), uuid; crc follows.
_AREA = struct.Struct("<8sQQQ16s")
AREA_HDR_BYTES = _AREA.size + _CRC.size
AREA_RECORDS_OFF = 4096  # records start one block into the area so the header has its own lines


class PoolFormatError(RpmemfsError):
    """The pool is not usable as it stands; the message says why."""


@dataclass(frozen=True)
class Header:
    uuid: bytes
    pool_size: int
    area_size: int
    data_off: int
    data_blocks: int
    created_ns: int
    epoch: int = 0
    version: int = VERSION
    flags: int = 0
    block_size: int = BLOCK
    map_shift: int = 0  # log2 of the sync map's chunk; 0 when the pool has no sync map

    def area_off(self, index: int) -> int:
        return AREAS_OFF + index * self.area_size

    def encode(self) -> bytes:
        body = _HDR.pack(
            MAGIC, self.version, self.flags, self.uuid, self.pool_size, self.block_size,
            self.map_shift, self.area_size, self.data_off, self.data_blocks, self.created_ns, self.epoch,
        )
        return body + _CRC.pack(crc32c(body))

    @classmethod
    def decode(cls, raw: bytes | bytearray | memoryview) -> Header:
        """Parse one header copy; PoolFormatError says what is wrong with it."""
        raw = bytes(raw[:HEADER_BYTES])
        if len(raw) < HEADER_BYTES:
            raise PoolFormatError("header is cut short")
        fields = _HDR.unpack_from(raw)
        if fields[0] != MAGIC:
            raise PoolFormatError("bad magic (not an rpmemfs pool)")
        (crc,) = _CRC.unpack_from(raw, _HDR.size)
        if crc != crc32c(raw[: _HDR.size]):
            raise PoolFormatError("header checksum mismatch")
        (_, version, flags, uid, pool_size, block_size, map_shift, area_size, data_off,
         data_blocks, created_ns, epoch) = fields
        if version not in VERSIONS:
            raise PoolFormatError(f"unsupported pool version {version} (this rpmemfs reads "
                                  f"{', '.join(map(str, VERSIONS))})")
        if (version == 1) != (map_shift == 0):
            raise PoolFormatError(f"pool version {version} with sync map chunk shift {map_shift}")
        if block_size != BLOCK:
            raise PoolFormatError(f"unsupported block size {block_size}")
        hdr = cls(uid, pool_size, area_size, data_off, data_blocks, created_ns, epoch,
                  version, flags, block_size, map_shift)
        hdr.validate()
        return hdr

    def validate(self) -> None:
        if self.area_size < MIN_AREA or self.area_size % BLOCK:
            raise PoolFormatError(f"bad log area size {self.area_size}")
        if self.data_off < AREAS_OFF + 2 * self.area_size or self.data_off % BLOCK:
            raise PoolFormatError(f"bad data offset {self.data_off}")
        if self.map_shift and not MAP_MIN_SHIFT <= self.map_shift <= 40:
            raise PoolFormatError(f"bad sync map chunk shift {self.map_shift}")
        if self.data_off + self.data_blocks * BLOCK > self.map_off or self.data_blocks < 1:
            raise PoolFormatError("data region does not fit in the pool")

    @property
    def map_chunk(self) -> int:
        return 1 << self.map_shift if self.map_shift else 0

    @property
    def map_slot_bytes(self) -> int:
        """Bytes of one replica's bitmap: a bit per chunk of the whole pool, in cache lines."""
        return map_slot_bytes(self.pool_size, self.map_shift) if self.map_shift else 0

    @property
    def map_off(self) -> int:
        """Where the sync map starts, and so where the replicated content ends."""
        if not self.map_shift:
            return self.pool_size
        return (self.pool_size - map_bytes(self.pool_size, self.map_shift)) // BLOCK * BLOCK

    @property
    def uuid_str(self) -> str:
        return str(uuidlib.UUID(bytes=self.uuid))


def map_slot_bytes(pool_size: int, shift: int) -> int:
    bits = -(-pool_size >> shift)  # one per chunk, the last maybe partial
    return -(-bits // 512) * 64


def map_bytes(pool_size: int, shift: int) -> int:
    """The sync map's size: a block for its header, then MAP_SLOTS bitmaps."""
    return BLOCK + -(-(MAP_SLOTS * map_slot_bytes(pool_size, shift)) // BLOCK) * BLOCK


def map_shift_for(pool_size: int) -> int:
    """The sync map's chunk shift mkfs picks: the smallest whose bitmap has at most
    MAP_MAX_BITS bits."""
    shift = MAP_MIN_SHIFT
    while -(-pool_size >> shift) > MAP_MAX_BITS:
        shift += 1
    return shift


def plan(pool_size: int, uid: bytes, created_ns: int, map_shift: int | None = None) -> Header:
    """Choose the layout for a new pool of pool_size bytes (``map_shift``: another sync map
    chunk than mkfs picks, as pools made before it picked blocks had)."""
    if pool_size < MIN_POOL:
        raise PoolFormatError(f"pool size {pool_size} is below the minimum of {MIN_POOL >> 20}M")
    # Each area must hold a full metadata snapshot plus room to log; 1/32 of the pool per area
    # leaves about 3% for metadata, which a checkpoint of ~150 bytes per small file fits.
    area = min(MAX_AREA, max(MIN_AREA, (pool_size // 32) // BLOCK * BLOCK))
    data_off = -(-(AREAS_OFF + 2 * area) // DATA_ALIGN) * DATA_ALIGN
    shift = map_shift_for(pool_size) if map_shift is None else map_shift
    map_off = (pool_size - map_bytes(pool_size, shift)) // BLOCK * BLOCK
    blocks = (map_off - data_off) // BLOCK
    hdr = Header(uid, pool_size, area, data_off, blocks, created_ns, map_shift=shift)
    hdr.validate()
    return hdr


@dataclass(frozen=True)
class AreaHeader:
    gen: int
    start_seq: int
    snap_end_seq: int
    uuid: bytes

    def encode(self) -> bytes:
        body = _AREA.pack(AREA_MAGIC, self.gen, self.start_seq, self.snap_end_seq, self.uuid)
        return body + _CRC.pack(crc32c(body))

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> AreaHeader | None:
        """The area header, or None when it is blank, torn or foreign."""
        raw = bytes(raw[:AREA_HDR_BYTES])
        magic, gen, start, snap_end, uid = _AREA.unpack_from(raw)
        if magic != AREA_MAGIC:
            return None
        (crc,) = _CRC.unpack_from(raw, _AREA.size)
        if crc != crc32c(raw[: _AREA.size]):
            return None
        return cls(gen, start, snap_end, uid)


# The epoch: a generation in the high 32 bits, bumped by every mount, and a random nonce in the
# low 32, so that two nodes that each mounted a copy of the same generation (a failover) are
# told apart.
def epoch_gen(epoch: int) -> int:
    return epoch >> 32


def next_epoch(epoch: int, nonce: int) -> int:
    return ((epoch_gen(epoch) + 1) << 32) | (nonce & 0xFFFFFFFF)


def show_epoch(epoch: int) -> str:
    return f"{epoch_gen(epoch)}:{epoch & 0xFFFFFFFF:08x}"
