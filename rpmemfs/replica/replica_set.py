"""The replica set: open every replica in parallel, then serve barriers to all of them at once.

A barrier is the replication half of a durability point. The caller hands over the pool
ranges to make durable, in the order they must land (data before the log records that point
at it); every in-sync replica gets one batch of writes of exactly those bytes, taken from the
local mapping without copies, and exactly one flush, all replicas in parallel.
"""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

import trio

from rpmemfs.fs.layout import BACKUP_OFF, BLOCK, HEADER_OFF, Header, PoolFormatError
from rpmemfs.replica.remote import create_remote
from rpmemfs.replica.replica import Posted, Replica
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import DEFAULT_TIMEOUT, RemoteRegion, Session, Transport, TransportError
from rpmemfs.transport.spin import spin
from rpmemfs.transport.tcp import TcpTransport

# The polling budget of a barrier before it sleeps on its replies (see spin_budget).
DEFAULT_SPIN_US = 200
SPIN_BYTES_PER_US = 1000  # a loopback replica takes about 1 us per KB on top
MAX_SPIN_US = 2000


class ReplicaError(Exception):
    """Fewer replicas than the policy requires acknowledged a barrier."""

    def __init__(self, message: str, failed: list[Replica]) -> None:
        super().__init__(message)
        self.failed = failed


def show_uuid(raw: bytes | None) -> str:
    return "none" if raw is None else str(uuidlib.UUID(bytes=raw))


def _remote_uuid(head: bytes) -> bytes:
    """The uuid from the primary header copy, else the backup; PoolFormatError if neither."""
    try:
        return Header.decode(head[HEADER_OFF : HEADER_OFF + BLOCK]).uuid
    except PoolFormatError as primary:
        try:
            return Header.decode(head[BACKUP_OFF : BACKUP_OFF + BLOCK]).uuid
        except PoolFormatError as backup:
            raise PoolFormatError(f"no valid pool header (primary: {primary}; backup: {backup})") from None


class ReplicaSet:
    """The replicas of one local pool and the barrier that serves them all."""

    def __init__(self, replicas: list[Replica], local_buf: memoryview, *,
                 min_replicas: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if min_replicas is None:
            min_replicas = len(replicas)
        if not 0 <= min_replicas <= len(replicas):
            raise ValueError(f"min_replicas={min_replicas} with {len(replicas)} replicas")
        self.replicas = replicas
        self.local_buf = local_buf
        self.min_replicas = min_replicas
        self.timeout = timeout
        self.spin_us = DEFAULT_SPIN_US

    create_remote = staticmethod(create_remote)

    @classmethod
    async def open(
        cls,
        specs: list[ReplicaSpec],
        local_buf: memoryview,
        uuid: bytes,
        token: bytes | None,
        lanes: int = 2,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        min_replicas: int | None = None,
        transport: Transport | None = None,
    ) -> ReplicaSet:
        """Connect to every replica in parallel and check each against the local pool.

        A replica that cannot be reached, or whose pool is not this pool's replica, is left
        "failed" with the reason in ``last_error``; nothing is raised, so the caller decides
        by its policy (``min_replicas``) whether to go on.
        """
        if lanes < 1:
            raise ValueError(f"lanes={lanes}: a replica needs at least one lane")
        replicas = [Replica(spec) for spec in specs]
        self = cls(replicas, local_buf, min_replicas=min_replicas, timeout=timeout)
        tp = transport or TcpTransport()
        async with trio.open_nursery() as nursery:
            for replica in replicas:
                nursery.start_soon(self._open_one, replica, tp, uuid, token, lanes)
        return self

    async def _open_one(self, replica: Replica, tp: Transport, uuid: bytes, token: bytes | None,
                        lanes: int) -> None:
        spec = replica.spec
        session: Session | None = None
        try:
            with trio.fail_after(self.timeout):
                session = await tp.connect(spec.address, token, lanes=lanes, timeout=self.timeout)
                region = await session.open_pool(spec.name)
                problem = await self._check(spec, session, region, uuid)
        except TransportError as exc:
            replica.fail(f"cannot open: {exc}")
        except trio.TooSlowError:
            replica.fail(f"not opened within {self.timeout:g}s")
        else:
            if problem is None:
                replica.attach(session, region)
                return
            replica.fail(problem)
        if session is not None:
            replica.session = session
            await replica.aclose(self.timeout)

    async def _check(self, spec: ReplicaSpec, session: Session, region: RemoteRegion,
                     uuid: bytes) -> str | None:
        """Why this remote pool cannot serve as the local pool's replica, or None."""
        if region.size != len(self.local_buf):
            return (f"replica {spec}: remote pool is {region.size} bytes but the local pool is "
                    f"{len(self.local_buf)} bytes")
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

    @property
    def in_sync(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "in-sync"]

    def _writes(self, ranges: list[tuple[int, int]]) -> list[tuple[int, memoryview]]:
        size = len(self.local_buf)
        writes: list[tuple[int, memoryview]] = []
        for off, length in ranges:
            if off < 0 or length < 0 or off + length > size:
                raise ValueError(f"range ({off}, {length}) is outside the local pool of {size} bytes")
            if length:
                writes.append((off, self.local_buf[off : off + length]))
        return writes

    def _shortfall(self, acked: int, what: str) -> ReplicaError:
        failed = [r for r in self.replicas if r.state != "in-sync"]
        detail = "; ".join(f"{r.spec} ({r.last_error or r.state})" for r in failed)
        return ReplicaError(
            f"{what}: {acked} of {len(self.replicas)} replicas, {self.min_replicas} required"
            + (f"; failed: {detail}" if detail else ""),
            failed,
        )

    async def barrier(self, ranges: list[tuple[int, int]]) -> None:
        """Make ``ranges`` of the local pool durable on the replicas; in list order per replica.

        ReplicaError when fewer than ``min_replicas`` replicas acknowledged it. Replicas that
        failed are marked so whether or not the barrier raises.
        """
        if len(self.in_sync) < self.min_replicas:
            raise self._shortfall(len(self.in_sync), "too few replicas in sync")
        writes = self._writes(ranges)
        if not writes:
            return
        nbytes = sum(view.nbytes for _, view in writes)
        acked: list[Replica] = []

        async def serve(replica: Replica) -> None:
            if await replica.barrier(writes, nbytes, self.timeout):
                acked.append(replica)

        async def finish(posted: Posted) -> None:
            if await posted.replica.finish(posted, self.timeout):
                acked.append(posted.replica)

        try:
            # Post to every replica first, then poll all their completions together: the
            # common barrier completes here without one scheduling round trip or wake-up.
            posted: list[Posted] = []
            busy: list[Replica] = []
            for replica in self.in_sync:
                p = replica.post(writes, nbytes)
                if p is not None:
                    posted.append(p)
                elif replica.state == "in-sync":
                    busy.append(replica)
            spin([p.ticket for p in posted], self.spin_budget(nbytes))
            pending: list[Posted] = []
            for p in posted:
                done = p.replica.poll(p)
                if done:
                    acked.append(p.replica)
                elif done is None:
                    pending.append(p)
            if pending or busy:
                async with trio.open_nursery() as nursery:
                    for p in pending:
                        nursery.start_soon(finish, p)
                    for replica in busy:
                        nursery.start_soon(serve, replica)
        finally:
            # A view left alive (say, by a traceback that holds this frame) keeps the mapping
            # exported, and the pool could then never be unmapped.
            for _, view in writes:
                view.release()
        if len(acked) < self.min_replicas:
            raise self._shortfall(len(acked), "barrier acknowledged by too few replicas")

    def spin_budget(self, nbytes: int) -> int:
        """How long (us) a barrier of ``nbytes`` polls before it sleeps: about what a
        healthy loopback replica takes, so only a slow or distant one costs a wake-up."""
        if self.spin_us <= 0:
            return 0
        return min(self.spin_us + nbytes // SPIN_BYTES_PER_US, MAX_SPIN_US)

    def status(self) -> list[dict[str, Any]]:
        return [r.status() for r in self.replicas]

    async def aclose(self) -> None:
        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                nursery.start_soon(replica.aclose, self.timeout)
