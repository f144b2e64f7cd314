"""The rpmemfs wire format, version 2 (described byte by byte in docs/wire.md).

Everything after the 64-byte HELLO travels in frames: a fixed 32-byte little-endian header,
then ``length`` payload bytes for the ops that carry one. The header never changes size
within a version, so a receiver always knows how much to read before it knows anything else;
that is what lets the target's receive loop move into a C thread later without touching the
initiators.

This module is the one definition of the format. The C side (native/rpmem_lane.c: the
target's lane loop and the initiator's barrier builder) includes native/rpmem_wire.h, which
native/wire_header.py generates from this module whenever the native helper is built, and
tests/unit/test_wire_header.py fails when the compiled helper and this module disagree. The
build loads this file on its own, before the package can be imported, so it imports the
standard library only. What control SENDs carry (JSON requests and replies) is declared
beside it, in control_ops.py.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

VERSION = 2
HELLO_MAGIC = b"RPMWIRE\x00"

# The frame header, field by field (name, struct code); C gets it as struct rpm_wire_hdr.
HEADER_FIELDS = (
    ("op", "B"), ("flags", "B"), ("reserved", "H"), ("key", "I"),
    ("offset", "Q"), ("length", "I"), ("id", "I"), ("imm", "Q"),
)
HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32

# magic 8s, version u16, role u8, flags u8, reserved u32, client X25519 public key 32s,
# session id 16s
HELLO = struct.Struct("<8sHBBI32s16s")
HELLO_SIZE = HELLO.size
assert HELLO_SIZE == 64

PROOF_SIZE = 32
SESSION_ID_SIZE = 16
NO_SESSION = bytes(SESSION_ID_SIZE)

# Limits a receiver enforces before it reads a payload. WRITE payloads go straight into the
# mapping, so they can be large; READ replies and SEND payloads are held in memory whole.
MAX_WRITE = 64 << 20
MAX_READ = 16 << 20
MAX_SEND = 4 << 20
MAX_CONTROL = 64 << 10
MAX_ERROR_TEXT = 4096
ATOMIC_SIZE = 8
# An appliance flush is a READ of this many bytes at offset 0 of the pool.
FLUSH_READ_SIZE = 8

# Protected traffic (docs/wire.md): after the handshake each direction of the stream is cut
# into AEAD records, u32 length L (1..RECORD_MAX), L bytes of ciphertext, a 16-byte tag.
RECORD_LEN_SIZE = 4
RECORD_TAG_SIZE = 16
RECORD_MAX = 32 << 10
RECORD_OVERHEAD = RECORD_LEN_SIZE + RECORD_TAG_SIZE
KEY_SIZE = 32  # X25519 public keys, and each direction's AEAD key

# A GPSPM flush message: u32 count, then count x (u64 offset, u64 length).
FLUSH_COUNT = struct.Struct("<I")
FLUSH_RANGE_FIELDS = (("offset", "Q"), ("length", "Q"))
FLUSH_RANGE = struct.Struct("<" + "".join(code for _, code in FLUSH_RANGE_FIELDS))
FLUSH_COUNT_SIZE = FLUSH_COUNT.size
FLUSH_RANGE_SIZE = FLUSH_RANGE.size
MAX_FLUSH_RANGES = (MAX_SEND - FLUSH_COUNT_SIZE) // FLUSH_RANGE_SIZE


@enum.unique
class Op(enum.IntEnum):
    WRITE = 0x01
    READ = 0x02
    READ_RESP = 0x03
    ATOMIC_WRITE = 0x04
    SEND = 0x05
    SEND_REPLY = 0x06
    ERROR = 0x07
    CHALLENGE = 0x10
    AUTH = 0x11
    OK = 0x12


@enum.unique
class Cipher(enum.IntEnum):
    """How a connection's records are sealed; the target's choice travels in CHALLENGE's imm."""

    NONE = 0  # both ends run with wire protection none (a trusted link)
    AES_256_GCM = 1
    CHACHA20_POLY1305 = 2  # where either end's CPU has no AES instructions


@enum.unique
class Role(enum.IntEnum):
    CONTROL = 1
    LANE = 2


@enum.unique
class SendKind(enum.IntEnum):
    """What a SEND carries; it travels in the frame's imm field."""

    CONTROL = 1
    FLUSH = 2


# Frame flags.
F_FLUSH = 0x01  # on READ: this read is a barrier's flush (counted by the target)
F_CLOSE = 0x01  # on ERROR: the sender closes the connection after this frame
KNOWN_FLAGS = {Op.READ: F_FLUSH, Op.ERROR: F_CLOSE}

# HELLO flags: what the initiator asks for its connection.
HELLO_F_PLAIN = 0x01  # no wire protection (the target must run with --wire-protection none)
HELLO_F_NO_AES = 0x02  # the initiator's CPU lacks AES instructions: prefer ChaCha20-Poly1305
HELLO_KNOWN_FLAGS = HELLO_F_PLAIN | HELLO_F_NO_AES


@enum.unique
class Code(enum.IntEnum):
    """Error codes carried in an ERROR frame's imm field. Each value once (``enum.unique``:
    two names of one value would make the second an alias, missing from C and from
    ``Code(value).name``). VERSION is 1 in every version of the wire: it answers a HELLO
    from another version, so it must read the same to all of them."""

    VERSION = 1
    BAD_HELLO = 2
    PEER_REFUSED = 3
    AUTH_FAILED = 4
    BAD_FRAME = 5
    BAD_KEY = 6
    OUT_OF_BOUNDS = 7
    TOO_LARGE = 8
    BAD_SESSION = 9
    IO = 10
    MISALIGNED = 11
    NOT_ALLOWED = 12
    SHUTDOWN = 13
    PROTECTION = 14


class WireError(Exception):
    """Bytes that are not a valid frame; the message says what is wrong with them."""

    def __init__(self, code: Code, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Frame:
    op: int
    flags: int = 0
    key: int = 0
    offset: int = 0
    length: int = 0
    id: int = 0
    imm: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(self.op, self.flags, 0, self.key, self.offset, self.length, self.id, self.imm)


def pack_header(op: int, flags: int, key: int, offset: int, length: int, id_: int, imm: int) -> bytes:
    """One header without building a Frame: the initiator's hot path calls this per write."""
    return HEADER.pack(op, flags, 0, key, offset, length, id_, imm)


def unpack_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> Frame:
    """Parse and sanity-check a header; anything a well-behaved peer never sends is refused."""
    op, flags, reserved, key, offset, length, id_, imm = HEADER.unpack_from(buf, pos)
    try:
        known = Op(op)
    except ValueError:
        raise WireError(Code.BAD_FRAME, f"unknown op 0x{op:02x}") from None
    if reserved:
        raise WireError(Code.BAD_FRAME, f"reserved header field is {reserved}, not 0")
    if flags & ~KNOWN_FLAGS.get(known, 0):
        raise WireError(Code.BAD_FRAME, f"unknown flags 0x{flags:02x} on {known.name}")
    return Frame(op, flags, key, offset, length, id_, imm)


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    role: int
    public: bytes  # the initiator's ephemeral X25519 public key
    session_id: bytes
    flags: int = 0

    def pack(self) -> bytes:
        return HELLO.pack(HELLO_MAGIC, self.version, self.role, self.flags, 0, self.public, self.session_id)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> Hello:
        magic, version, role, flags, reserved, public, session_id = HELLO.unpack_from(raw)
        if magic != HELLO_MAGIC:
            raise WireError(Code.BAD_HELLO, f"bad magic {bytes(magic)!r}: not an rpmemfs initiator")
        if version != VERSION:
            raise WireError(
                Code.VERSION, f"initiator speaks wire version {version}; this target speaks {VERSION}"
            )
        if role not in (Role.CONTROL, Role.LANE):
            raise WireError(Code.BAD_HELLO, f"unknown role {role}")
        if flags & ~HELLO_KNOWN_FLAGS or reserved:
            raise WireError(Code.BAD_HELLO, "reserved HELLO fields are not zero")
        if role == Role.LANE and session_id == NO_SESSION:
            raise WireError(Code.BAD_HELLO, "a lane HELLO must name its session")
        return cls(version, role, bytes(public), bytes(session_id), flags)


def encode_flush(ranges: list[tuple[int, int]]) -> bytes:
    if len(ranges) > MAX_FLUSH_RANGES:
        raise ValueError(f"{len(ranges)} ranges do not fit one flush message (max {MAX_FLUSH_RANGES})")
    out = bytearray(FLUSH_COUNT.size + FLUSH_RANGE.size * len(ranges))
    FLUSH_COUNT.pack_into(out, 0, len(ranges))
    pos = FLUSH_COUNT.size
    for off, length in ranges:
        FLUSH_RANGE.pack_into(out, pos, off, length)
        pos += FLUSH_RANGE.size
    return bytes(out)


def decode_flush(payload: bytes | bytearray | memoryview) -> list[tuple[int, int]]:
    if len(payload) < FLUSH_COUNT.size:
        raise WireError(Code.BAD_FRAME, "flush message shorter than its count")
    (count,) = FLUSH_COUNT.unpack_from(payload)
    if len(payload) != FLUSH_COUNT.size + count * FLUSH_RANGE.size:
        raise WireError(
            Code.BAD_FRAME,
            f"flush message of {len(payload)} bytes does not hold the {count} ranges it claims",
        )
    return list(FLUSH_RANGE.iter_unpack(memoryview(payload)[FLUSH_COUNT.size :]))


def error_text(reason: str) -> bytes:
    """An ERROR payload: UTF-8, cut to the limit a receiver accepts."""
    return reason.encode("utf-8", "replace")[:MAX_ERROR_TEXT]
