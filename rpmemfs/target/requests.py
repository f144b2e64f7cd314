"""A control request as its handler reads it: each field by the kind that
rpmemfs/transport/control_ops.py declares for it, read when the handler first asks for it.

Reading on demand keeps the order in which a request's faults are found the order its handler
works in (a create checks its name, has the pool store check its size, then opens the pool,
which reads the epoch), so a request with several faults is refused for the one it always
was. Each kind is read one way, and refused with the code and words the target has always
used:

- NAME: the pool-name rules (code ``bad-name``); an optional name left out reads as None.
- SIZE: as sent; the pool store checks sizes against its limits (code ``size``).
- KEY: the session's registered region under that key (code ``bad-key``).
- COUNT: a non-negative integer (code ``request``).
- FLAG: true or false (code ``request``).
- OPTION: as sent, for the handler to test as it always has (a takeover only at true itself).
- EPOCH: [previous, current], two unsigned 64-bit integers, or None (code ``request``).
- HOLDER: the holder fields that are of the right type, escaped and bounded (never refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rpmemfs.poolname import check_name
from rpmemfs.target.owners import clean_holder
from rpmemfs.target.pools import PoolError
from rpmemfs.target.sessions import Region, TargetSession
from rpmemfs.transport.control_ops import OPS, ControlOp, Field, Kind

Reader = Callable[[TargetSession, ControlOp, Field, object], Any]


def _name(session: TargetSession, op: ControlOp, field: Field, value: object) -> str | None:
    if value is None and not field.required:
        return None
    return check_name(value)


def _as_sent(session: TargetSession, op: ControlOp, field: Field, value: object) -> object:
    return value


def _key(session: TargetSession, op: ControlOp, field: Field, value: object) -> Region:
    region = session.regions.get(value) if isinstance(value, int) else None
    if region is None:
        raise PoolError(f"no pool is registered with key {value!r} in this session", "bad-key")
    return region


def _count(session: TargetSession, op: ControlOp, field: Field, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PoolError(f"{op.value} {field.name} must be a non-negative integer", "request")
    return value


def _flag(session: TargetSession, op: ControlOp, field: Field, value: object) -> bool:
    if not isinstance(value, bool):
        raise PoolError(f"{op.value} needs \"{field.name}\": true or false", "request")
    return value


def _epoch(session: TargetSession, op: ControlOp, field: Field, value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and 0 <= v < 1 << 64 for v in value)):
        raise PoolError("epoch must be [previous, current], two unsigned 64-bit integers", "request")
    return value[0], value[1]


def _holder(session: TargetSession, op: ControlOp, field: Field, value: object) -> dict[str, Any]:
    return clean_holder(value)


READERS: dict[Kind, Reader] = {
    Kind.NAME: _name, Kind.SIZE: _as_sent, Kind.KEY: _key, Kind.COUNT: _count, Kind.FLAG: _flag,
    Kind.OPTION: _as_sent, Kind.EPOCH: _epoch, Kind.HOLDER: _holder,
}


class Request:
    """The fields of one request for ``op``, read by their declared kinds on demand."""

    def __init__(self, session: TargetSession, op: ControlOp, raw: Mapping[str, Any]) -> None:
        self.op = op
        self._session = session
        self._raw = raw
        self._fields = {f.name: f for f in OPS[op].request}

    def __getitem__(self, name: str) -> Any:
        field = self._fields[name]  # KeyError: a handler asked for a field its op does not declare
        return READERS[field.kind](self._session, self.op, field, self._raw.get(name))
