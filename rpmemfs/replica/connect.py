"""Connecting one replica: open a session with its pool, check that the pool is this pool's
replica, and bring it in sync (resync.py) so that it joins the barriers.

ReplicaSet.open connects every replica this way in parallel, and ReplicaSet.keep again, with
backoff, whenever one falls behind.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK, PoolFormatError, show_epoch
from rpmemfs.replica.barriers import Barriers
from rpmemfs.replica.fencing import Probe, read_probe
from rpmemfs.replica.replica import Replica
from rpmemfs.replica.resync import resync
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import RemoteRegion, Session, Transport, TransportError

# Opens a checked session with a replica's pool; ReplicaUnusable says why not.
Connect = Callable[[Replica], Awaitable[tuple[Session, RemoteRegion]]]


class ReplicaUnusable(Exception):
    """A replica could not be connected or is not this pool's replica; the message says why."""


def show_uuid(raw: bytes | None) -> str:
    return "none" if raw is None else str(uuidlib.UUID(bytes=raw))


def _remote_uuid(head: bytes) -> bytes:
    """The uuid from the primary header copy, else the backup; PoolFormatError if neither."""
    return read_header(head)[0].uuid


async def open_session(replica: Replica, tp: Transport, size: int, uuid: bytes, token: bytes | None,
                       lanes: int, epoch: tuple[int, int] | None, timeout: float,
                       holder: Mapping[str, Any] | None = None,
                       takeover: bool = False) -> tuple[Session, RemoteRegion]:
    """A checked session with the replica's pool (``size`` bytes, ``uuid``); ReplicaUnusable
    says why not. With ``epoch``, the pool is claimed (fencing.py), but only after the target
    said it holds this pool's replica and no newer owner."""
    spec = replica.spec
    session: Session | None = None
    problem: str | None = None
    try:
        with trio.fail_after(timeout):
            session = await tp.connect(spec.address, token, lanes=lanes, timeout=timeout)
            if epoch is not None:
                probe = read_probe(spec, await session.probe_pool(spec.name))
                problem = check_probe(probe, size, uuid, epoch, takeover)
                replica.resync_marked = probe.resync is not None
                replica.taken_over = probe.owned_by() if taken_over(probe, epoch, takeover) else None
            replica.claimed = epoch is not None
            if problem is None:
                region = await session.open_pool(spec.name, epoch, holder=holder, takeover=takeover)
                problem = await _check(spec, session, region, size, uuid)
    except TransportError as exc:
        problem = f"cannot open: {exc}"
    except trio.TooSlowError:
        problem = f"not opened within {timeout:g}s"
    if problem is None:
        assert session is not None
        return session, region
    if session is not None:
        with trio.move_on_after(timeout) as scope:
            scope.shield = True
            try:
                await session.aclose()
            except (TransportError, OSError):
                pass
    raise ReplicaUnusable(problem)


def taken_over(p: Probe, epoch: tuple[int, int], takeover: bool = False) -> bool:
    """Whether another primary claimed the replica since this lineage's epoch ``epoch[0]``
    (the pool's before this mount) and holds it now: this mount (at ``epoch[1]``) is fenced."""
    return not takeover and p.epoch != epoch[1] and p.newer_than(epoch[0])


def check_probe(p: Probe, size: int, uuid: bytes, epoch: tuple[int, int],
                 takeover: bool = False) -> str | None:
    """Why claiming this replica would be wrong, from what its target said, or None."""
    if p.size is not None and p.size != size:
        return f"replica {p.spec}: remote pool is {p.size} bytes but the local pool is {size} bytes"
    if p.uuid is not None and p.uuid != uuid:
        return (f"replica {p.spec}: remote pool uuid {show_uuid(p.uuid)} does not match the local "
                f"pool uuid {show_uuid(uuid)}; it is not a replica of this pool")
    if taken_over(p, epoch, takeover):
        # The epoch this mount claimed (what its status shows), not the pool's before it.
        return (f"replica {p.spec} was taken over: it is held by {p.owned_by()}, and this mount is "
                f"at epoch {show_epoch(epoch[1])}; it is fenced from writing it (see docs/failover.md)")
    return None


async def _check(spec: ReplicaSpec, session: Session, region: RemoteRegion, size: int,
                 uuid: bytes) -> str | None:
    """Why this remote pool cannot serve as the local pool's replica, or None."""
    if region.size != size:
        return (f"replica {spec}: remote pool is {region.size} bytes but the local pool is "
                f"{size} bytes")
    # Both header blocks in one read: the backup speaks for a pool whose primary is torn.
    head = await session.lanes[0].read(region, 0, 2 * BLOCK)
    try:
        remote = _remote_uuid(head)
    except PoolFormatError as exc:
        return f"replica {spec}: remote pool is not an rpmemfs pool: {exc}"
    if remote != uuid:
        return (f"replica {spec}: remote pool uuid {show_uuid(remote)} does not match the local "
                f"pool uuid {show_uuid(uuid)}; it is not a replica of this pool")
    return None


async def bring_up(rs: Barriers, replica: Replica, connect: Connect,
                   progress: Callable[[int], None]) -> bool:
    """Connect, resync, rejoin; False (the replica stale, the reason noted) on failure."""
    try:
        session, region = await connect(replica)
    except ReplicaUnusable as exc:
        replica.fail(str(exc))
        replica.note(str(exc))
        return False
    replica.attach(session, region)
    if not replica.lanes:
        await replica.aclose(rs.timeout)
        return False
    try:
        joined = await resync(rs, replica, progress)
    except (TransportError, trio.TooSlowError) as exc:
        why = str(exc) if isinstance(exc, TransportError) else f"no answer within {rs.timeout:g}s"
        replica.fail(f"resync failed: {why}")
        replica.note(f"resync failed: {why}")
        await replica.aclose(rs.timeout)
        return False
    if not joined:
        await replica.aclose(rs.timeout)
    return joined
