"""The replica set: open every replica in parallel, then serve barriers to all of them at once.

A barrier is the replication half of a durability point. The caller hands over the pool
ranges to make durable, in the order they must land (data before the log records that point
at it); every in-sync replica gets one batch of writes of exactly those bytes, taken from the
local mapping without copies, and exactly one flush, all replicas in parallel.
"""

from __future__ import annotations

import logging
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from rpmemfs.errors import RpmemfsError
from rpmemfs.native import ffi
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK, PoolFormatError
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.replica.remote import create_remote
from rpmemfs.replica.replica import Posted, Replica
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.verify import ReplicaReport, content_size, differing_chunks
from rpmemfs.transport.base import (
    DEFAULT_TIMEOUT,
    LocalPool,
    RemoteRegion,
    Session,
    Transport,
    TransportError,
)
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.spin import spin

log = logging.getLogger(__name__)

DEFAULT_RECONNECT = 1.0  # seconds before a replica that fell behind is tried again...
MAX_RECONNECT = 30.0  # ...doubling up to this
COPY_BATCH = 8 << 20  # bytes per barrier while resyncing
COMPARE_CHUNK = 1 << 20  # checksum chunk when the pool has no sync map
MAX_PASSES = 8  # resync passes outside the barrier lock before the last one under it...
LAST_PASS_CHUNKS = 64  # ...or fewer chunks left than this
VERIFY_ROUNDS = 3  # durability points a live verify waits for before a difference is real
# The polling budget of a barrier before it sleeps on its replies (see spin_budget).
DEFAULT_SPIN_US = 200
SPIN_BYTES_PER_US = 1000  # a loopback replica takes about 1 us per KB on top
MAX_SPIN_US = 2000


class ReplicaUnusable(Exception):
    """A replica could not be connected or is not this pool's replica; the message says why."""


class ReplicaError(RpmemfsError):
    """Fewer replicas than the policy requires acknowledged a barrier."""

    def __init__(self, message: str, failed: list[Replica]) -> None:
        super().__init__(message)
        self.failed = failed


def show_uuid(raw: bytes | None) -> str:
    return "none" if raw is None else str(uuidlib.UUID(bytes=raw))


def _remote_uuid(head: bytes) -> bytes:
    """The uuid from the primary header copy, else the backup; PoolFormatError if neither."""
    return read_header(head)[0].uuid


@dataclass
class InFlight:
    """A barrier posted to the in-sync replicas, not yet complete."""

    ranges: list[tuple[int, int]]
    nbytes: int
    posted: list[Posted]


class ReplicaSet:
    """The replicas of one local pool, the barrier that serves them all, and their repair.

    ``lock`` is held by whoever runs a barrier (the filesystem's durability point); a resync
    takes it for its last pass, so that no barrier runs between "the replica has everything"
    and "the replica gets every barrier".
    """

    def __init__(self, replicas: list[Replica], local_buf: memoryview, *,
                 min_replicas: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                 syncmap: SyncMap | None = None, lock: trio.Lock | None = None) -> None:
        if min_replicas is None:
            min_replicas = len(replicas)
        if not 0 <= min_replicas <= len(replicas):
            raise ValueError(f"min_replicas={min_replicas} with {len(replicas)} replicas")
        self.replicas = replicas
        self.local_buf = local_buf
        self.min_replicas = min_replicas
        self.timeout = timeout
        self.spin_us = DEFAULT_SPIN_US
        self.syncmap = syncmap
        self.lock = lock or trio.Lock()
        self.reconnect_interval = DEFAULT_RECONNECT
        # Set by the mount: called whenever a replica's state changes (the replica table
        # records which replicas are stale).
        self.on_change: Callable[[], None] = lambda: None
        self._connect: Callable[[Replica], Awaitable[tuple[Session, RemoteRegion]]] | None = None
        self._inflight = 0
        self._drained = trio.Event()
        # Where the pool starts, for the C code that builds and sends barriers; released
        # in aclose(), so the mapping can be closed afterwards.
        self._local = LocalPool(local_buf, ffi.from_buffer(local_buf))
        # Bytes compared or copied by resyncs, for a progress bar.
        self.progress: Callable[[int], None] = lambda n: None

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
        syncmap: SyncMap | None = None,
        lock: trio.Lock | None = None,
        epoch: tuple[int, int] | None = None,
        slots: list[int] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ReplicaSet:
        """Connect to every replica in parallel, check each against the local pool, and bring
        those that miss something up to date (from the sync map, or by comparing checksums).

        A replica that cannot be reached, or whose pool is not this pool's replica, is left
        "stale" with the reason in ``last_error``; nothing is raised, so the caller decides
        by its policy (``min_replicas``) whether to go on, and :meth:`keep` retries it.
        """
        if lanes < 1:
            raise ValueError(f"lanes={lanes}: a replica needs at least one lane")
        slots = slots if slots is not None else list(range(len(specs)))
        replicas = [Replica(spec, slot) for spec, slot in zip(specs, slots, strict=True)]
        self = cls(replicas, local_buf, min_replicas=min_replicas, timeout=timeout,
                   syncmap=syncmap, lock=lock)
        if progress is not None:
            self.progress = progress
        async def connect(replica: Replica) -> tuple[Session, RemoteRegion]:
            tp = transport or transport_for(replica.spec.transport)
            return await self._open_session(replica, tp, uuid, token, lanes, epoch)

        self._connect = connect
        async with trio.open_nursery() as nursery:
            for replica in replicas:
                nursery.start_soon(self._bring_up, replica)
        return self

    async def _open_session(self, replica: Replica, tp: Transport, uuid: bytes, token: bytes | None,
                            lanes: int, epoch: tuple[int, int] | None) -> tuple[Session, RemoteRegion]:
        """A checked session with the replica's pool; ReplicaUnusable says why not."""
        spec = replica.spec
        session: Session | None = None
        try:
            with trio.fail_after(self.timeout):
                session = await tp.connect(spec.address, token, lanes=lanes, timeout=self.timeout)
                region = await session.open_pool(spec.name, epoch)
                problem = await self._check(spec, session, region, uuid)
        except TransportError as exc:
            problem = f"cannot open: {exc}"
        except trio.TooSlowError:
            problem = f"not opened within {self.timeout:g}s"
        if problem is None:
            assert session is not None
            return session, region
        if session is not None:
            with trio.move_on_after(self.timeout) as scope:
                scope.shield = True
                try:
                    await session.aclose()
                except (TransportError, OSError):
                    pass
        raise ReplicaUnusable(problem)

    async def _bring_up(self, replica: Replica) -> bool:
        """Connect, resync, rejoin; False (the replica stale, the reason noted) on failure."""
        assert self._connect is not None
        try:
            session, region = await self._connect(replica)
        except ReplicaUnusable as exc:
            replica.fail(str(exc))
            replica.note(str(exc))
            return False
        replica.attach(session, region)
        if not replica.lanes:
            await replica.aclose(self.timeout)
            return False
        try:
            await self._resync(replica)
        except (TransportError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, TransportError) else f"no answer within {self.timeout:g}s"
            replica.fail(f"resync failed: {why}")
            replica.note(f"resync failed: {why}")
            await replica.aclose(self.timeout)
            return False
        return True

    async def keep(self) -> None:
        """Reconnect replicas that fell behind, for as long as the mount lives."""
        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                nursery.start_soon(self._keeper, replica)

    async def _keeper(self, replica: Replica) -> None:
        backoff = self.reconnect_interval
        while True:
            if replica.state == "in-sync":
                await replica.fell_behind.wait()
                log.warning("replica %s fell behind: %s", replica.spec, replica.last_error)
                self.on_change()
                await replica.aclose(self.timeout)
                backoff = self.reconnect_interval
                continue
            await trio.sleep(backoff)
            log.info("replica %s: reconnecting", replica.spec)
            if await self._bring_up(replica):
                log.warning("replica %s is in sync again", replica.spec)
                self.on_change()
            else:
                log.info("replica %s still unusable: %s", replica.spec, replica.last_error)
                backoff = min(backoff * 2, MAX_RECONNECT)

    async def _resync(self, replica: Replica) -> None:
        """Send the replica what it misses, then let it join the barriers.

        Passes run while barriers go on without the replica (marking what they write as
        missing, so the next pass sends it again); the last pass runs under the barrier
        lock, and the replica joins before the lock is released. With nothing known about
        what it misses (no sync map, or its slot FULL), every chunk is compared first.
        """
        syncmap = self.syncmap
        slot = replica.slot
        replica.state = "resyncing"
        replica.resyncs += 1
        t0 = time.monotonic()
        totals = {"compared_chunks": 0, "differing_chunks": 0, "chunks_sent": 0, "bytes_sent": 0,
                  "passes": 0}
        if syncmap is None or syncmap.full(slot):
            if syncmap is not None:
                syncmap.take(slot)  # the comparison covers what the map held until now
            totals["bytes_sent"] += await self._compare_and_repair(replica, totals, locked=False)
        if syncmap is not None:
            for _ in range(MAX_PASSES):
                if syncmap.count(slot) <= LAST_PASS_CHUNKS:
                    break
                totals["bytes_sent"] += await self._send_missing(replica, totals)
        async with self.lock:
            if syncmap is not None:
                totals["bytes_sent"] += await self._send_missing(replica, totals)
                syncmap.settle(slot)
            replica.joined()
        replica.resync = None
        replica.last_resync = {**totals, "seconds": round(time.monotonic() - t0, 3)}
        if totals["bytes_sent"] or totals["compared_chunks"]:
            log.warning("replica %s resynced: %s", replica.spec, replica.last_resync)

    async def _send_missing(self, replica: Replica, totals: dict[str, int]) -> int:
        """One pass: the chunks the sync map has for the replica, in barriers."""
        assert self.syncmap is not None
        runs = self.syncmap.take(replica.slot)
        totals["passes"] += 1
        if not runs:
            return 0
        totals["chunks_sent"] += sum(-(-n // self.syncmap.chunk) for _, n in runs)
        try:
            return await self._copy(replica, runs, "resync")
        except BaseException:
            # Not sent after all: still missing (the durable bits never went away).
            self.syncmap.mark([replica.slot], runs)
            raise

    async def _compare_and_repair(self, replica: Replica, totals: dict[str, int], *, locked: bool,
                                  progress: Callable[[int], None] | None = None) -> int:
        """Compare every chunk by checksum, then copy the ones that differ (under the barrier
        lock when ``locked``, for a replica that takes barriers meanwhile); bytes sent."""
        assert replica.session is not None and replica.region is not None
        limit = content_size(self.local_buf)
        chunk = self.syncmap.chunk if self.syncmap and self.syncmap.enabled else COMPARE_CHUNK
        replica.resync = {"phase": "compare", "done": 0, "total": limit}

        report = progress or self.progress

        def compared_some(n: int) -> None:
            assert replica.resync is not None
            replica.resync["done"] += n
            report(n)

        compared, runs = await differing_chunks(replica.session, replica.region, self.local_buf,
                                                [(0, limit)], chunk, compared_some, self.timeout)
        differing = sum(-(-n // chunk) for _, n in runs)
        totals["compared_chunks"] += compared
        totals["differing_chunks"] += differing
        totals["chunks_sent"] += differing
        log.info("replica %s: %d of %d chunks differ", replica.spec, differing, compared)
        if not locked:
            return await self._copy(replica, runs, "repair")
        async with self.lock:
            # Current content: anything written since the comparison is newer still, and
            # barriers cannot overtake this copy while the lock is held and none is in
            # flight.
            await self.drain()
            return await self._copy(replica, runs, "repair")

    async def verify(self, chunk: int, durable: Callable[[], Awaitable[None]],
                     progress: Callable[[int], None] = lambda n: None) -> list[ReplicaReport]:
        """Compare the live pool with every replica by chunk checksums.

        A live pool runs ahead of its replicas until the next durability point, so chunks
        that differ are compared again after one (up to VERIFY_ROUNDS times): what still
        differs then is a real difference.
        """
        reports = [ReplicaReport(str(r.spec)) for r in self.replicas]
        limit = content_size(self.local_buf)
        for replica, report in zip(self.replicas, reports, strict=True):
            if replica.state != "in-sync" or replica.session is None or replica.region is None:
                report.error = f"not in sync ({replica.state}): {replica.last_error}"
                continue
            try:
                report.chunks, runs = await differing_chunks(
                    replica.session, replica.region, self.local_buf, [(0, limit)], chunk,
                    progress, self.timeout)
                for _ in range(VERIFY_ROUNDS):
                    if not runs or replica.session is None or replica.region is None:
                        break
                    await durable()
                    _, runs = await differing_chunks(replica.session, replica.region, self.local_buf,
                                                     runs, chunk, lambda n: None, self.timeout)
                report.differing = runs
            except TransportError as exc:
                report.error = str(exc)
            except trio.TooSlowError:
                report.error = f"no checksum reply within {self.timeout:g}s"
            except Exception as exc:  # the durability point failed: EIO from the filesystem
                report.error = f"could not make the pool durable to compare again: {exc!r}"
        return reports

    async def repair(self, replica: Replica, progress: Callable[[int], None] | None = None
                     ) -> dict[str, Any]:
        """Verify-and-repair of an in-sync replica while the mount serves (rpmemfs sync)."""
        totals = {"compared_chunks": 0, "differing_chunks": 0, "chunks_sent": 0, "bytes_sent": 0}
        t0 = time.monotonic()
        try:
            totals["bytes_sent"] = await self._compare_and_repair(replica, totals, locked=True,
                                                                  progress=progress)
        except (TransportError, trio.TooSlowError) as exc:
            replica.fail(f"repair failed: {exc}")
            raise
        finally:
            replica.resync = None
        return {**totals, "seconds": round(time.monotonic() - t0, 3)}

    async def _copy(self, replica: Replica, runs: list[tuple[int, int]], phase: str) -> int:
        """Write ``runs`` of the local pool to the replica in barriers of COPY_BATCH bytes."""
        assert replica.region is not None and replica.lanes
        total = sum(n for _, n in runs)
        replica.resync = {"phase": phase, "done": 0, "total": total}
        lane = replica.bulk_lane
        batch: list[tuple[int, int]] = []
        size = 0
        last_log = time.monotonic()

        async def flush() -> None:
            nonlocal size, last_log
            writes = [(off, self.local_buf[off : off + n]) for off, n in batch]
            try:
                with trio.fail_after(self.timeout):
                    await lane.barrier(replica.region, writes)  # type: ignore[arg-type]
            finally:
                for _, view in writes:
                    view.release()
            assert replica.resync is not None
            replica.resync["done"] += size
            self.progress(size)
            batch.clear()
            size = 0
            if time.monotonic() - last_log > 1:
                last_log = time.monotonic()
                log.info("replica %s: %s %d of %d bytes", replica.spec, phase,
                         replica.resync["done"], total)

        for off, length in runs:
            pos, end = off, off + length
            while pos < end:
                n = min(end - pos, COPY_BATCH - size)
                batch.append((pos, n))
                size += n
                pos += n
                if size >= COPY_BATCH:
                    await flush()
        if batch:
            await flush()
        return total

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

    def _checked(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The non-empty ranges, each checked to lie in the local pool."""
        size = len(self.local_buf)
        out: list[tuple[int, int]] = []
        for off, length in ranges:
            if off < 0 or length < 0 or off + length > size:
                raise ValueError(f"range ({off}, {length}) is outside the local pool of {size} bytes")
            if length:
                out.append((off, length))
        return out

    def _shortfall(self, acked: int, what: str) -> ReplicaError:
        failed = [r for r in self.replicas if r.state != "in-sync"]
        detail = "; ".join(f"{r.spec} ({r.last_error or r.state})" for r in failed)
        return ReplicaError(
            f"{what}: {acked} of {len(self.replicas)} replicas, {self.min_replicas} required"
            + (f"; out of sync: {detail}" if detail else ""),
            failed,
        )

    async def barrier(self, ranges: list[tuple[int, int]]) -> None:
        """Make ``ranges`` of the local pool durable on the replicas; in list order per replica.

        ReplicaError when fewer than ``min_replicas`` replicas acknowledged it. Replicas that
        failed are marked so whether or not the barrier raises.
        """
        await self.complete(self.post(ranges))

    def post(self, ranges: list[tuple[int, int]]) -> InFlight:
        """Send a barrier to every in-sync replica without waiting: one batch of writes and
        one flush each, on its barrier lane, behind the barriers posted before it.

        What a replica left out misses is marked in the sync map here, before the replica can
        rejoin (a rejoin waits for the barrier lock, which the caller holds): a mark made only
        when the barrier completes could miss a replica that rejoined in between.
        ReplicaError (after marking) when fewer than ``min_replicas`` are in sync.
        """
        self._mark([r for r in self.replicas if r.state != "in-sync"], ranges)
        if len(self.in_sync) < self.min_replicas:
            raise self._shortfall(len(self.in_sync), "too few replicas in sync")
        ranges = self._checked(ranges)
        nbytes = sum(n for _, n in ranges)
        posted: list[Posted] = []
        if ranges:
            for replica in self.in_sync:
                p = replica.post(self._local, ranges, nbytes)
                if p is not None:
                    posted.append(p)
                else:  # posting failed: the replica is stale now
                    self._mark([replica], ranges)
        self._inflight += 1
        return InFlight(ranges, nbytes, posted)

    async def complete(self, flight: InFlight) -> None:
        """Wait for a posted barrier; ReplicaError when too few replicas acknowledged it."""
        acked: list[Replica] = []

        async def finish(posted: Posted) -> None:
            if await posted.replica.finish(posted, self.timeout):
                acked.append(posted.replica)

        try:
            if not flight.ranges:
                return
            # Poll all the completions together first: the common barrier completes here
            # without one scheduling round trip or wake-up.
            spin([p.ticket for p in flight.posted], self.spin_budget(flight.nbytes))
            pending: list[Posted] = []
            for p in flight.posted:
                done = p.replica.poll(p)
                if done:
                    acked.append(p.replica)
                elif done is None:
                    pending.append(p)
            if pending:
                async with trio.open_nursery() as nursery:
                    for p in pending:
                        nursery.start_soon(finish, p)
        finally:
            # Before the fsync returns: what a replica that failed this barrier misses is in
            # the pool, so it gets just that when it is back, even after a restart here.
            self._mark([p.replica for p in flight.posted if p.replica not in acked], flight.ranges)
            self._inflight -= 1
            if not self._inflight:
                self._drained.set()
                self._drained = trio.Event()
        if len(acked) < self.min_replicas:
            raise self._shortfall(len(acked), "barrier acknowledged by too few replicas")

    def _mark(self, replicas: list[Replica], ranges: list[tuple[int, int]]) -> None:
        if replicas and self.syncmap is not None:
            self.syncmap.mark([r.slot for r in replicas], ranges)

    async def drain(self) -> None:
        """Wait until no posted barrier is in flight (call with the barrier lock held)."""
        while self._inflight:
            await self._drained.wait()

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
        ffi.release(self._local.base)
