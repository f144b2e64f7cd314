"""The words for a frame a lane refuses.

native/rpmem_lane.c is the one place a lane's frames are checked: it answers a frame that
breaks a rule with the rule (``lib.RPM_REFUSED_*``), the ERROR code (wire.py's, generated
into C) and the rule's figures. This module only says it in words, for the ERROR frame and
the log, so a check is written once and its wording once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rpmemfs.native import lib
from rpmemfs.target.sessions import Region
from rpmemfs.transport.wire import ATOMIC_SIZE, HEADER, Op, WireError, unpack_header


def _op(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op 0x{op:02x}"


def _pool(regions: Mapping[int, Region], key: int) -> str:
    # Named as the session knew it; a pool closed since the refusal is still named by key.
    region = regions.get(key)
    return repr(region.pool.name) if region is not None else f"with key 0x{key:08x}"


class Refused:
    """A refused frame as the lane loop reported it."""

    def __init__(self, rule: int, header: bytes, args: tuple[int, int, int]) -> None:
        self.rule = rule
        self.header = header
        self.op, self.flags, self.reserved, self.key, self.offset, self.length, self.id, self.imm = (
            HEADER.unpack(header)
        )
        self.args = args

    def reason(self, regions: Mapping[int, Region]) -> str:
        return _WORDS[self.rule](self, regions)


def _header(f: Refused, regions: Mapping[int, Region]) -> str:
    # The header checks are unpack_header's too (a control connection's frames, replies to an
    # initiator): its words, so that each is written once.
    try:
        unpack_header(f.header)
    except WireError as exc:
        return exc.reason
    return f"header refused by the lane loop: {f.header.hex()}"


def _bounds(f: Refused, regions: Mapping[int, Region]) -> str:
    length, size, _ = f.args
    return (f"{_op(f.op)} of {length} bytes at offset {f.offset} is outside pool "
            f"{_pool(regions, f.key)} of {size} bytes")


def _flush_list(f: Refused, regions: Mapping[int, Region]) -> str:
    count, no_count, _ = f.args
    if no_count:
        return f"flush message of {f.length} bytes is shorter than its count"
    return f"flush message of {f.length} bytes does not hold the {count} ranges it claims"


_WORDS: dict[int, Callable[[Refused, Mapping[int, Region]], str]] = {
    lib.RPM_REFUSED_OP: _header,
    lib.RPM_REFUSED_RESERVED: _header,
    lib.RPM_REFUSED_FLAGS: _header,
    lib.RPM_REFUSED_NOT_INITIATORS: lambda f, r: f"{_op(f.op)} is not something an initiator sends",
    lib.RPM_REFUSED_TOO_LARGE: lambda f, r: (f"{_op(f.op)} of {f.length} bytes exceeds the limit of "
                                             f"{f.args[0]}"),
    lib.RPM_REFUSED_ATOMIC_PAYLOAD: lambda f, r: f"ATOMIC_WRITE with length {f.length} (it has no payload)",
    lib.RPM_REFUSED_MISALIGNED: lambda f, r: (f"ATOMIC_WRITE at offset {f.offset} is not "
                                              f"{ATOMIC_SIZE}-byte aligned"),
    lib.RPM_REFUSED_SEND_KIND: lambda f, r: f"SEND of unknown kind {f.imm}",
    lib.RPM_REFUSED_KEY: lambda f, r: f"{_op(f.op)} with unregistered key 0x{f.key:08x}",
    lib.RPM_REFUSED_BOUNDS: _bounds,
    lib.RPM_REFUSED_READ_ONLY: lambda f, r: (
        f"{_op(f.op)} to pool {_pool(r, f.key)}, which this session opened without claiming it while "
        "another initiator owns it"),
    lib.RPM_REFUSED_FLUSH_LIST: _flush_list,
    lib.RPM_REFUSED_FLUSH_RANGE: lambda f, r: (f"flush range ({f.args[0]}, {f.args[1]}) is outside pool "
                                               f"{_pool(r, f.key)} of {f.args[2]} bytes"),
}
