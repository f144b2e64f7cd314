"""The replica table: which replicas a pool has, recorded in the pool itself.

``rpmemfs mount POOL`` must find a pool's replicas without being told, and the only thing it
is given is the pool. The header copies use about 100 bytes of their 4 KiB blocks, so the
table lives at offset 2048 of each header block (primary and backup), where neither the
header code nor mount's header repair ever writes:

    offset  size  field
    0       8     magic  b"RPMREPL\\0"
    8       4     length of the JSON body (u32, little endian)
    12      4     crc32c of the JSON body (u32)
    16      n     JSON: {"replicas": [{"address": ..., "name": ...}], "token_file": null}

The slot is written whole (zero-padded), so a shorter table leaves no trace of a longer one.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from rpmemfs.native import crc32c
from rpmemfs.pool.layout import BACKUP_OFF, BLOCK, HEADER_OFF
from rpmemfs.replica.errors import ReplicationError
from rpmemfs.replica.spec import ReplicaSpec

TABLE_MAGIC = b"RPMREPL\x00"
TABLE_IN_BLOCK = 2048
MAX_BODY = 1024
_HEAD = struct.Struct("<8sII")
SLOT_BYTES = _HEAD.size + MAX_BODY
PRIMARY_OFF = HEADER_OFF + TABLE_IN_BLOCK
BACKUP_TABLE_OFF = BACKUP_OFF + TABLE_IN_BLOCK
assert TABLE_IN_BLOCK + SLOT_BYTES <= BLOCK

Buffer = bytes | bytearray | memoryview


class TableError(ReplicationError, ValueError):
    """The table cannot be written as asked (too large)."""


@dataclass
class TableRead:
    """What was found: the replicas, where they came from, and what was wrong on the way."""

    replicas: list[ReplicaSpec] = field(default_factory=list)
    token_file: str | None = None
    source: str | None = None  # "primary", "backup", or None when neither copy held a table
    problem: str | None = None  # None when the primary copy was good, or both copies blank
    stale: list[str] = field(default_factory=list)  # "ADDR/NAME" of replicas that missed barriers


def encode_table(specs: list[ReplicaSpec], token_file: str | None = None,
                 stale: list[str] | None = None) -> bytes:
    """One slot's bytes (SLOT_BYTES, zero-padded); TableError when the JSON exceeds 1 KiB.

    `stale` names (as "ADDR/NAME") the replicas that missed barriers: they must not be
    trusted as in sync again until they are repaired.
    """
    doc: dict[str, Any] = {"replicas": [s.to_json() for s in specs], "token_file": token_file}
    if stale:
        doc["stale"] = sorted(stale)
    body = json.dumps(doc, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise TableError(
            f"replica table of {len(specs)} replicas is {len(body)} bytes of JSON; "
            f"the pool has room for {MAX_BODY} (use fewer replicas or shorter names)"
        )
    slot = _HEAD.pack(TABLE_MAGIC, len(body), crc32c(body)) + body
    return slot + bytes(SLOT_BYTES - len(slot))


def write_table(buf: memoryview | bytearray, specs: list[ReplicaSpec],
                token_file: str | None = None, stale: list[str] | None = None
                ) -> list[tuple[int, int]]:
    """Write both copies; returns the (offset, length) ranges written, for the caller to persist.

    The backup comes first in the list: persisted in that order, a crash between the two
    leaves either the old primary or the new backup intact, and each reads as a whole table.
    """
    slot = encode_table(specs, token_file, stale)
    ranges = [(BACKUP_TABLE_OFF, SLOT_BYTES), (PRIMARY_OFF, SLOT_BYTES)]
    for off, length in ranges:
        buf[off : off + length] = slot
    return ranges


def _decode_slot(raw: bytes) -> TableRead | None | str:
    """The table in one slot, None when the slot is blank, or a string saying what is wrong."""
    magic, length, crc = _HEAD.unpack_from(raw)
    if magic != TABLE_MAGIC:
        return None if not any(raw) else "bad magic"
    if length > MAX_BODY:
        return f"length {length} exceeds {MAX_BODY}"
    body = raw[_HEAD.size : _HEAD.size + length]
    if crc32c(body) != crc:
        return "checksum mismatch"
    try:
        doc: Any = json.loads(body)
        token_file = doc.get("token_file")
        if token_file is not None and not isinstance(token_file, str):
            return "token_file is not a string"
        specs = [ReplicaSpec.make(str(r["address"]), str(r["name"]),
                                  transport=str(r.get("transport", "auto")))
                 for r in doc["replicas"]]
        stale = [str(x) for x in doc.get("stale", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"bad contents: {exc}"
    return TableRead(specs, token_file, stale=stale)


def inspect_table(buf: Buffer) -> TableRead:
    """The primary copy if it is good, else the backup, else an empty table and the problem."""
    if len(buf) < BACKUP_TABLE_OFF + SLOT_BYTES:
        return TableRead(problem=f"pool of {len(buf)} bytes is too small to hold a replica table")
    problems: list[str] = []
    for source, off in (("primary", PRIMARY_OFF), ("backup", BACKUP_TABLE_OFF)):
        found = _decode_slot(bytes(buf[off : off + SLOT_BYTES]))
        if isinstance(found, TableRead):
            found.source = source
            found.problem = "; ".join(problems) or None
            if problems:
                found.problem = f"{found.problem}; used the backup copy"
            return found
        if isinstance(found, str):
            problems.append(f"{source} replica table at offset {off}: {found}")
        else:
            problems.append(f"{source} replica table at offset {off}: blank")
    # Two blank slots are a pool made without replicas, not damage.
    damaged = [p for p in problems if not p.endswith(": blank")]
    return TableRead(problem="; ".join(problems) if damaged else None)


def read_table(buf: Buffer) -> list[ReplicaSpec]:
    """The replicas recorded in the pool (see :func:`inspect_table` for what went wrong)."""
    return inspect_table(buf).replicas
