"""Barriers: the replicas of one local pool and the barrier that serves them all at once.

A barrier is the replication half of a durability point. The caller hands over the pool
ranges to make durable, in the order they must land (data before the log records that point
at it); every in-sync replica gets one batch of writes of exactly those bytes, taken from the
local mapping without copies, and exactly one flush, all replicas in parallel.

This is the hot path of every fsync, so it is kept on its own: `Barriers` is the base of
`ReplicaSet` (replica_set.py), which adds opening, reconnecting, resync and live verify
(connect.py, resync.py, live_verify.py) without a layer between the caller and `post`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from rpmemfs.native import ffi
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.replica.errors import ReplicationError
from rpmemfs.replica.replica import CANCELLED_IN_FLIGHT, IN_SYNC, Posted, Replica
from rpmemfs.transport.base import DEFAULT_TIMEOUT, LocalPool, RangeList

# Points wait for the one in flight and go out together (group commit, durability/point.py)
# while the fastest of the last QUICK_OF barriers came back within QUICK_S: waiting then
# costs a writer less than another barrier costs the daemon. Over a slow link (a distant
# replica) each point posts at once behind those in flight instead, and its fsync takes one
# round trip, not up to two. The fastest, not the mean: a loaded machine slows every barrier
# down, and it is then that grouping pays most.
QUICK_S = 0.002
QUICK_OF = 16


class ReplicaError(ReplicationError):
    """Fewer replicas than the policy requires acknowledged a barrier."""

    def __init__(self, message: str, failed: list[Replica]) -> None:
        super().__init__(message)
        self.failed = failed


@dataclass(eq=False)
class InFlight:
    """A barrier posted to the in-sync replicas, not yet complete."""

    ranges: list[tuple[int, int]]
    nbytes: int
    posted: list[Posted]
    # The policy when it was posted: a replica that joins (and raises "all") meanwhile was
    # never sent this barrier, so it cannot be owed an acknowledgement of it.
    required: int
    # trio.current_time() when posted: a hung replica shows as its age, and how long each
    # took decides quick()
    posted_at: float = 0.0


class Barriers:
    """The replicas of one local pool and the barriers posted to them.

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
        self.syncmap = syncmap
        self.lock = lock or trio.Lock()
        self._inflight = 0
        self._waiting: set[InFlight] = set()  # posted to some replica, not complete
        self._drained = trio.Event()
        self._took: deque[float] = deque(maxlen=QUICK_OF)  # seconds each recent barrier took
        # Asynchronous replication (durability/backlog.py): waits until the replicas hold
        # every point taken so far, so that drain() means no barrier is owed to them.
        self.backlog_drained: Callable[[], Awaitable[None]] | None = None
        # Asynchronous replication: told at once when a replica falls behind, so that what
        # was still queued for it is marked in the sync map before its keeper resyncs it.
        self.on_fell_behind: Callable[[Replica], None] = lambda replica: None
        # Where the pool starts, for the C code that builds and sends barriers; released
        # in ReplicaSet.aclose(), so the mapping can be closed afterwards.
        self._local = LocalPool(local_buf, ffi.from_buffer(local_buf))

    @property
    def in_sync(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is IN_SYNC]

    def _checked(self, ranges: list[tuple[int, int]]) -> RangeList:
        """The non-empty ranges, each checked to lie in the local pool (as one list every
        replica's lane reads, so that C code gets them once for all)."""
        size = len(self.local_buf)
        out = RangeList()
        for off, length in ranges:
            if off < 0 or length < 0 or off + length > size:
                raise ValueError(f"range ({off}, {length}) is outside the local pool of {size} bytes")
            if length:
                out.append((off, length))
        return out

    def _shortfall(self, acked: int, what: str) -> ReplicaError:
        failed = [r for r in self.replicas if r.state is not IN_SYNC]
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
        in_sync = self.in_sync
        if len(in_sync) < len(self.replicas):
            self.mark_missing(ranges)
            if len(in_sync) < self.min_replicas:
                raise self._shortfall(len(in_sync), "too few replicas in sync")
        ranges = self._checked(ranges)
        nbytes = sum([n for _, n in ranges])
        posted: list[Posted] = []
        if ranges:
            for replica in in_sync:
                p = replica.post(self._local, ranges, nbytes)
                if p is not None:
                    posted.append(p)
                else:  # posting failed: the replica is stale now
                    self._mark([replica], ranges)
        self._inflight += 1
        flight = InFlight(ranges, nbytes, posted, self.min_replicas, trio.current_time())
        if posted:
            self._waiting.add(flight)
        return flight

    async def complete(self, flight: InFlight) -> None:
        """Wait for a posted barrier; ReplicaError when too few replicas acknowledged it."""
        acked: list[Replica] = []
        try:
            if not flight.ranges:
                return
            # Replies already here are taken without a trip through the scheduler. No polling
            # for the others: the mount's /dev/fuse poller keeps this thread awake after each
            # request (poller.py), which catches them as well, and a poll here held up the
            # requests already read (docs/benchmarks.md, "fifth round").
            pending: list[Posted] = []
            for p in flight.posted:
                done = p.replica.poll(p)
                if done:
                    acked.append(p.replica)
                elif done is None:
                    pending.append(p)
            # One after another under one deadline, not a task each: the barrier waits for
            # the slowest replica either way, and a nursery with its tasks costs more than
            # the rest of a loaded point's waiting.
            deadline = trio.current_time() + self.timeout
            for i, p in enumerate(pending):
                # A later one may have come while an earlier one was awaited.
                done = p.replica.poll(p) if i else None
                if done is None:
                    try:
                        done = await p.replica.finish(p, self.timeout, deadline)
                    except trio.Cancelled:
                        # As a task each would have been: every replica still waited for
                        # has a barrier in an unknown state (maybe half sent).
                        for q in pending[i + 1 :]:
                            got = q.replica.poll(q)
                            if got:
                                acked.append(q.replica)
                            elif got is None:
                                q.replica.fail(CANCELLED_IN_FLIGHT)
                        raise
                if done:
                    acked.append(p.replica)
        finally:
            # Before the fsync returns: what a replica that failed this barrier misses is in
            # the pool, so it gets just that when it is back, even after a restart here.
            self._mark([p.replica for p in flight.posted if p.replica not in acked], flight.ranges)
            self._waiting.discard(flight)
            if flight.posted:
                self._took.append(trio.current_time() - flight.posted_at)
            self._inflight -= 1
            if not self._inflight:
                self._drained.set()
                self._drained = trio.Event()
        if len(acked) < min(flight.required, self.min_replicas):
            raise self._shortfall(len(acked), "barrier acknowledged by too few replicas")

    def mark_missing(self, ranges: list[tuple[int, int]]) -> None:
        """Mark ``ranges`` for every replica out of sync now (they get them by resync)."""
        self._mark([r for r in self.replicas if r.state is not IN_SYNC], ranges)

    def shortfall(self) -> ReplicaError | None:
        """The error a point gets when fewer than ``min_replicas`` are in sync now, else None."""
        n = len(self.in_sync)
        return self._shortfall(n, "too few replicas in sync") if n < self.min_replicas else None

    def _mark(self, replicas: list[Replica], ranges: list[tuple[int, int]]) -> None:
        if replicas and self.syncmap is not None:
            self.syncmap.mark([r.slot for r in replicas], ranges)

    def quick(self) -> bool:
        """Whether barriers come back quickly enough for points to wait for the one in flight
        (see QUICK_S); so until the first ones are timed."""
        return not self._took or min(self._took) < QUICK_S

    def oldest_in_flight(self) -> float:
        """Seconds the oldest barrier still waiting for replicas has waited (0: none). A
        replica that stops answering keeps its state until replica_timeout; this shows it
        at once (status, metrics)."""
        if not self._waiting:
            return 0.0
        return trio.current_time() - min(f.posted_at for f in self._waiting)

    async def drain(self) -> None:
        """Wait until no posted barrier is in flight (call with the barrier lock held)."""
        if self.backlog_drained is not None:
            await self.backlog_drained()
        while self._inflight:
            await self._drained.wait()
