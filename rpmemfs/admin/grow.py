"""`rpmemfs grow POOL --size SIZE`: a pool and its replicas, grown while unmounted.

The replicas grow first, all of them (a replica left smaller would be refused by every mount
as not this pool's size): if one cannot, nothing local changes, and a rerun grows what is
left (a replica already at the size is no change). Then the local pool (poolfile/grow.py), whose
new sync map has every replica compared in full at the next mount, which sends them the new
header and whatever differs.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from rpmemfs.admin.errors import GrowError
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import Header, PoolFormatError
from rpmemfs.poolfile.grow import check_room, grow_file, grown
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table
from rpmemfs.transport.base import DEFAULT_TIMEOUT, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION


async def _grow_replicas(specs: list[ReplicaSpec], size: int, token: bytes | None,
                         timeout: float, wire_protection: str) -> list[str]:
    errors: list[str] = []

    async def one(spec: ReplicaSpec) -> None:
        try:
            with trio.fail_after(timeout):
                async with await transport_for(spec.transport, wire_protection=wire_protection).connect(
                        spec.address, token, lanes=0, timeout=timeout) as session:
                    await session.grow_pool(spec.name, size)
        except TransportError as exc:
            errors.append(f"replica {spec}: {exc}")
        except trio.TooSlowError:
            errors.append(f"replica {spec}: no answer within {timeout:g}s")

    async with trio.open_nursery() as nursery:
        for spec in specs:
            nursery.start_soon(one, spec)
    return errors


def grow_pool(path: str, size: int, token: bytes | None | Callable[[str | None], bytes | None],
              timeout: float = DEFAULT_TIMEOUT, *, wire_protection: str = DEFAULT_PROTECTION) -> Header:
    """Grow the unmounted pool at ``path`` and its replicas to ``size`` bytes; the new header.
    ``token`` may be a function of the token file the pool records."""
    try:
        with PoolMapping.open(path, "msync", readonly=True) as pm:
            old, _ = read_header(pm.buf)
            table = inspect_table(pm.buf)
        grown(old, size)  # refused here, before any replica grows, if the pool cannot
        check_room(path, size)
    except PoolFormatError as exc:
        raise GrowError(f"cannot grow {path}: {exc}") from None
    specs = table.replicas
    if callable(token):
        token = token(table.token_file)
    errors = trio.run(_grow_replicas, specs, size, token, timeout, wire_protection)
    if errors:
        raise GrowError("; ".join(errors) + f". {path} itself is unchanged; replicas that grew stay "
                        "grown (harmless): fix the cause and run grow again")
    try:
        return grow_file(path, size)
    except OSError as exc:
        raise GrowError(f"the replicas grew, but {path} could not: {exc.strerror or exc}; "
                        "fix that and run grow again") from None
