"""The control operations (JSON in control SENDs, docs/wire.md "Control messages"), declared
once: each operation's name, the fields of its request and of its reply.

Three readers share this one declaration, so that no op name is spelled anywhere else: the
initiator's control client (control_client.py) builds its requests from it, field by field in
the order declared here (which is the order of the keys on the wire); the target
(target/control.py) dispatches on :class:`ControlOp` to a handler per op, and its handlers read
each request field by its :class:`Kind` (target/requests.py); tests/unit/test_control_ops.py
checks that every op has both a handler and a client method, and that the replies carry the
fields declared for them.

A request is ``{"op": NAME, FIELD: value, ...}``; every reply is a JSON object with ``"ok":
true`` and the reply fields below, or ``"ok": false, "error": "...", "code": "..."``. Like
wire.py, this module imports the standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@enum.unique
class ControlOp(enum.StrEnum):
    """The control operations; a member is its name on the wire (and its client method's)."""

    CREATE = "create"
    OPEN = "open"
    PROBE = "probe"
    POOLS = "pools"
    EVICT = "evict"
    GROW = "grow"
    RESYNC = "resync"
    CLOSE = "close"
    REMOVE = "remove"
    CHECKSUM = "checksum"
    STATS = "stats"
    INFO = "info"
    RDMA = "rdma"


_NAMES = frozenset(op.value for op in ControlOp)


def find_op(op: object) -> ControlOp | None:
    """The declared op a request names, or None for anything else (the target refuses it)."""
    return ControlOp(op) if isinstance(op, str) and op in _NAMES else None


@enum.unique
class Kind(enum.Enum):
    """What a request field holds. The target reads each kind one way (target/requests.py),
    refusing a value that is missing or of the wrong type with the code and words it has
    always used; the client sends each kind as its JSON type (:attr:`json_type`)."""

    NAME = "a pool name (rpmemfs/poolname.py's rules)"
    SIZE = "a pool size in bytes (the pool store checks it against its limits)"
    KEY = "the key of a pool this session registered"
    COUNT = "a non-negative integer"
    FLAG = "true or false"
    OPTION = "true to ask for it"
    EPOCH = "[previous, current]: two unsigned 64-bit integers"
    HOLDER = "who claims a pool: host, pid, pool, mountpoint, command"

    @property
    def json_type(self) -> type:
        return _JSON_TYPES[self]

    def accepts(self, value: object) -> bool:
        """Whether ``value`` is of this kind's JSON type (a bool is no integer here)."""
        if isinstance(value, bool) and self.json_type is not bool:
            return False
        return isinstance(value, self.json_type)


_JSON_TYPES: dict[Kind, type] = {
    Kind.NAME: str, Kind.SIZE: int, Kind.KEY: int, Kind.COUNT: int, Kind.FLAG: bool,
    Kind.OPTION: bool, Kind.EPOCH: list, Kind.HOLDER: dict,
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    required: bool = True


@dataclass(frozen=True)
class OpSpec:
    """One operation: its request fields in wire order, the fields of its reply besides
    ``ok``, and whether only an admin token may ask for it (docs/access.md)."""

    request: tuple[Field, ...]
    reply: tuple[str, ...]
    admin: bool = False


# A create or open reply describes the registered pool (the region); one asked with
# "rdma": true adds RDMA_REGION: the pool's rkey, its address on the target, and
# REGION_FLUSH_TYPES, the native RDMA FLUSH types its registration allows, strongest first (a
# subset of NATIVE_FLUSHES; [] for none). A reply without the last comes from a target older
# than the field: its registration allows the global-visibility type exactly when its "rdma"
# reply said "flush": true.
REGION = ("name", "key", "size", "uuid", "method", "pmem", "writable")
REGION_FLUSH_TYPES = "flush_types"
RDMA_REGION = ("rkey", "addr", REGION_FLUSH_TYPES)
NATIVE_FLUSHES = ("persistent", "visibility")

_NAME = Field("name", Kind.NAME)
_KEY = Field("key", Kind.KEY)
# An open is a claim with an epoch (and then names its holder, or takes over); a create opens
# the pool it made the same way.
_OPENING = (
    Field("epoch", Kind.EPOCH, required=False),
    Field("holder", Kind.HOLDER, required=False),
    Field("takeover", Kind.OPTION, required=False),
    Field("rdma", Kind.OPTION, required=False),
)

OPS: dict[ControlOp, OpSpec] = {
    ControlOp.CREATE: OpSpec((_NAME, Field("size", Kind.SIZE), *_OPENING), REGION),
    ControlOp.OPEN: OpSpec((_NAME, *_OPENING), REGION),
    ControlOp.PROBE: OpSpec((_NAME,), ("name", "size", "uuid", "owner", "writer")),
    ControlOp.POOLS: OpSpec((), ("pools", "quotas")),
    ControlOp.EVICT: OpSpec((_NAME,), ("evicted",), admin=True),
    ControlOp.GROW: OpSpec((_NAME, Field("size", Kind.SIZE)), ("grown",)),
    ControlOp.RESYNC: OpSpec((_KEY, Field("active", Kind.FLAG)), ()),
    ControlOp.CLOSE: OpSpec((_KEY,), ()),
    ControlOp.REMOVE: OpSpec((_NAME,), ()),
    ControlOp.CHECKSUM: OpSpec(
        (_KEY, Field("offset", Kind.COUNT), Field("length", Kind.COUNT), Field("chunk", Kind.COUNT)),
        ("crcs",),
    ),
    ControlOp.STATS: OpSpec((Field("name", Kind.NAME, required=False),), ("pools",)),
    # What the target says about itself: the OK payload's JSON (and "rdma" where it serves verbs).
    ControlOp.INFO: OpSpec((), ("target", "wire_version", "method", "pmem", "max_pool_size",
                                "wire_protection")),
    ControlOp.RDMA: OpSpec((), ("port", "device", "credits", "flush")),
}


def build_request(op: ControlOp, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The request for ``op``: its fields in declared order, those given as None left out.
    TypeError for a field ``op`` does not declare, a required one missing, or a value not of
    its kind's JSON type: mistakes of the caller, never sent."""
    spec = OPS[op]
    undeclared = set(fields) - {f.name for f in spec.request}
    if undeclared:
        raise TypeError(f"control op {op.value!r} has no field {sorted(undeclared)[0]!r}")
    request: dict[str, Any] = {"op": op.value}
    for f in spec.request:
        value = fields.get(f.name)
        if value is None:
            if f.required:
                raise TypeError(f"control op {op.value!r} needs {f.name!r}")
            continue
        if not f.kind.accepts(value):
            raise TypeError(f"control op {op.value!r}: {f.name!r} must be {f.kind.value}, not {value!r}")
        request[f.name] = value
    return request
