"""Asynchronous replication (`-o replication=async`): the durability points the replicas have
not acknowledged yet, and the senders that carry them to the replicas in the background.

A point in async mode ends when its ranges are persistent locally; what the replicas must get
is queued here as a :class:`Batch`: a **copy of the bytes taken at the point** (one buffer,
the ranges back to back, which the transport sends from C as it is), under the
barrier lock, right after the local persist. A copy, not a view of the mapping, because the
filesystem goes on writing the mapping after fsync returns (and, told the point is durable,
reuses the log space and the blocks it freed): bytes read later would put a later state
under an earlier log record. With the copy each replica receives exactly the sequence of
states the local pool went through at its points, in order, as DRBD's protocol A does with
its buffered writes. Within a batch the order is the sync mode's (what earlier points left,
data, then the log record that points at it), and every batch goes on the replica's one
ordered barrier lane, so a replica cut off at any instant holds some points whole and a prefix
of the next: the state of a crash of the primary in the middle of that point, which recovery
handles (a torn or missing record is ignored).

Points taken while a replica has a barrier in flight **share one batch** (group commit, as
sync mode's points share a barrier): the batch at the tail of the queue stays open to later
points until a sender posts it, which a sender does at once when nothing is in flight to its
replica, else when its barriers in flight are acknowledged; or until it holds ``merge`` bytes.
A batch is one barrier (its writes and one flush), and a target persists one barrier's ranges
in no particular order, but a lane's barriers one after another (it persists a flush before it
reads the next frame). So what a point frees (log space, blocks) must not be reused in its own
batch: the filesystem is told a point is durable (:meth:`Backlog.take`'s ``durable``) only when
its batch is closed to later points. A later point that reuses what it freed is then a later
barrier, which each target places only after it persisted the one that freed it, and a replica
behind sees the primary's states in order, even across a power loss of its own node, as in sync
mode. Under load this is what keeps the daemon's work per point small: one barrier to each
replica per round trip, not one per point (2 replicas, 16 writers: about 1 barrier per point
before, docs/benchmarks.md).

Each in-sync replica has a :class:`Follower`: a sender that posts the batches behind its last
one (at once from the point itself when nothing is in flight to it), and a completer that
takes their acknowledgements in order. A sender that finds several closed batches queued (a
slow replica, or points larger than ``merge``) posts up to ``GROUP`` of them in one go, each a
barrier of its own, and hands them to the completer together, which releases them and wakes
the writers once for the group. At most ``WINDOW`` groups are in flight.

A replica's **lag** is the bytes of the batches it has not acknowledged, and the age of the
oldest of them. A replica that fails (an error, a timeout, or more than ``max_lag`` behind
when the policy does not wait for it) is marked in the sync map for every batch it has not
acknowledged, the queued ones included, so its resync sends it just that; it never gets a
batch from before it rejoined (the resync sent it newer bytes).

Writers block in :meth:`Backlog.wait_room` while the replicas that ``min_replicas`` requires
(the K-th least behind) lag by more than ``max_lag`` bytes; so the copies held here stay
within about ``max_lag`` plus the points being taken at that moment. When every replica is
required, a point larger than ``max_lag`` is not copied here (point.py sends it from the
pool, as in sync mode, once the batches before it are acknowledged): about twice ``max_lag``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rpmemfs.ranges import Ranges
from rpmemfs.replica.barriers import Barriers, ReplicaError
from rpmemfs.replica.replica import IN_SYNC, Posted, Replica

# 64 MiB: about 0.2 s of what this machine replicates with 1 MiB writes (~300 MB/s), so a
# burst of that size costs no writer a wait; it is also the most memory the copies take
# and the most acknowledged data a failover may lose, both modest for a database volume.
DEFAULT_MAX_LAG = 64 << 20
WINDOW = 32  # groups of barriers in flight per replica (what they hold is bounded by max_lag)
GROUP = 16  # queued batches a sender posts in one go, each a barrier of its own
# A batch stays open to later points up to this size (and MERGE_RANGES ranges): large enough
# for a round of 16 writers' 4 KiB points many times over, small enough that a batch is
# soon closed under a stream of large writes, and what a point's "durable" may wait for.
MERGE_BYTES = 1 << 20
MERGE_RANGES = 1024
# Batch buffers kept for reuse: fresh memory costs a page fault per 4 KiB on first touch, and
# on VMs with free page reporting a trip to the host (the daemon took 0.66 page faults per
# point at 16 writers with a fresh buffer per batch, 0.36-0.48 with reuse; 0.07 without
# replicas: the rest are pool pages that deferred reuse of freed blocks touches first).
SPARE_BUFFERS = 4


@dataclass(eq=False)
class Batch:
    """A point's ranges with their bytes as they were at the point, in the order to place."""

    n: int  # its number in the backlog: 0, 1, 2, ...
    ranges: Ranges  # (offset, length), none empty
    # The ranges' bytes, back to back (one copy, sent from C as it is), in data[:nbytes]: a
    # buffer of ``merge`` bytes used again once every replica has this batch, or one of
    # exactly its size for a point larger than that.
    data: bytearray
    nbytes: int
    end: int  # bytes taken up to and including this batch
    taken: float  # trio.current_time() at its first point
    wall: float  # time.time() at its last point
    # While later points may join it: what to tell the filesystem once it is closed (each
    # point's "durable", in order). None once closed.
    joining: list[Callable[[], None]] | None = field(default_factory=list)
    # A replica dropped while this batch was in flight to it: its transport may still hold
    # views of the buffer, which is then never used again.
    pinned: bool = False

    @property
    def payload(self) -> memoryview:
        return memoryview(self.data)[: self.nbytes]

    def close(self) -> None:
        """No later point joins it: its points are durable to the filesystem from now on."""
        told, self.joining = self.joining, None
        for durable in told or ():
            durable()


def _copy(src: memoryview, ranges: Ranges, dst: bytearray, at: int) -> int:
    """The ranges' bytes, back to back into ``dst`` from ``at``; where they end."""
    for off, length in ranges:
        dst[at : at + length] = src[off : off + length]
        at += length
    return at


PostedGroup = list[tuple[Posted, Batch]]  # barriers posted together, in order


@dataclass(eq=False)
class Follower:
    """One in-sync replica's place in the backlog."""

    replica: Replica
    joins: int  # the replica's join this follower serves (Replica.joins)
    next_post: int  # the first batch not posted to it
    next_ack: int  # the first batch it has not acknowledged
    acked_bytes: int  # Batch.end of its last acknowledged batch
    acked_wall: float  # when the last batch it acknowledged was taken (time.time())
    wake: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    gone: bool = False
    send: trio.MemorySendChannel[PostedGroup] | None = None  # to its completer


class Backlog:
    """The batches of one mount's replicas, and their senders (run :meth:`run`)."""

    def __init__(self, rs: Barriers, max_lag: int = DEFAULT_MAX_LAG, merge: int = MERGE_BYTES) -> None:
        if max_lag <= 0:
            raise ValueError(f"max_lag={max_lag}: must be above 0")
        self.rs = rs
        self.max_lag = max_lag
        self.merge = merge  # bytes a batch open to later points may hold (0: none joins)
        self._spare: list[bytearray] = []  # buffers of ``merge`` bytes free for new batches
        self.batches: deque[Batch] = deque()
        self.count = 0  # batches taken
        self.points = 0  # points taken (several may share a batch)
        self.total = 0  # bytes taken
        self.direct = self.direct_bytes = 0  # barriers (bytes) sent from the pool by point.py
        self.followers: dict[Replica, Follower] = {}
        self._moved = trio.Event()  # set (and replaced) when an acknowledgement or a failure lands
        self._nursery: trio.Nursery | None = None
        rs.backlog_drained = self.drained
        rs.on_fell_behind = self.fell_behind

    @classmethod
    def for_mode(cls, rs: Barriers, replication: str, max_lag: int | None) -> Backlog | None:
        """The backlog of a mount with ``-o replication=`` (None for sync)."""
        return cls(rs, max_lag or DEFAULT_MAX_LAG) if replication == "async" else None

    # ---------------------------------------------------------------- the points

    def take(self, ranges: Ranges, durable: Callable[[], None] = lambda: None) -> None:
        """Queue a point's ranges with their bytes now (call under the barrier lock, right after
        the local persist). ReplicaError, queuing nothing, when fewer than ``min_replicas``
        are in sync (as a barrier in sync mode); replicas out of sync are marked either way.

        ``durable`` is called once the point's batch is closed to later points (at once when
        a replica can be sent it now): from then on what the point freed may be reused."""
        rs = self.rs
        # Every point in async mode comes here: the common case (every replica in sync and
        # followed, the tail open) costs few Python steps.
        in_sync = rs.in_sync
        if len(in_sync) < len(rs.replicas):
            rs.mark_missing(ranges)
            error = rs.shortfall()
            if error is not None:
                raise error
        buf = rs.local_buf
        size = len(buf)
        kept: Ranges = []
        nbytes = 0
        for off, length in ranges:
            if off < 0 or length < 0 or off + length > size:
                raise ValueError(f"range ({off}, {length}) is outside the local pool of {size} bytes")
            if length:
                kept.append((off, length))
                nbytes += length
        if not kept:
            self.after_queued(durable)
            return
        self.points += 1
        followers = self.followers
        joined = self.follow_in_sync(in_sync)
        self.total += nbytes
        tail = self.batches[-1] if self.batches else None
        # A replica that joined now follows from the next batch on (its resync sent it what
        # came before), so this point must not join the tail.
        if (not joined and tail is not None and tail.joining is not None
                and tail.nbytes + nbytes <= self.merge and len(tail.ranges) + len(kept) <= MERGE_RANGES):
            # Every replica has a barrier in flight (or it would have been sent the tail):
            # this point goes out with the tail, after the points already in it, once a
            # completer finds its replica with nothing in flight and wakes its sender.
            tail.nbytes = _copy(buf, kept, tail.data, tail.nbytes)
            tail.ranges += kept
            tail.end, tail.wall = self.total, time.time()
            tail.joining.append(durable)
        else:
            # A batch closed now may go out behind those in flight: their senders must see it.
            closed = tail is not None and tail.joining is not None
            if tail is not None:
                tail.close()
            if nbytes <= self.merge:
                data = self._spare.pop() if self._spare else bytearray(self.merge)
            else:
                data = bytearray(nbytes)
            _copy(buf, kept, data, 0)
            self.batches.append(Batch(self.count, kept, data, nbytes, self.total, trio.current_time(),
                                      time.time(), [durable]))
            self.count += 1
            if nbytes > self.merge:
                self.batches[-1].close()
                closed = True
            for f in list(followers.values()):
                if f.send is not None and f.next_post == f.next_ack == self.count - 1:
                    # Nothing in flight to it: post at once, saving a hop to its sender.
                    item = self._post_now(f)
                    if item is not None:
                        f.send.send_nowait(item)
                elif closed:
                    f.wake.set()  # (an open batch waits for its completer to wake it)
        if len(followers) > rs.min_replicas:
            self._pull_ahead()
        if not followers:
            self._release()  # nobody to send it to (no replica in sync, min_replicas=0): nothing kept

    def follow_in_sync(self, in_sync: list[Replica] | None = None) -> bool:
        """Follow each in-sync replica not followed yet (it joined since the last point taken)
        from the next batch on: what came before reached it otherwise (its resync, or a
        barrier from the pool sent after drained()). Whether any was."""
        joined = False
        followers = self.followers
        for replica in self.rs.in_sync if in_sync is None else in_sync:
            f = followers.get(replica)
            if f is None or f.joins != replica.joins:
                if f is not None:
                    self._drop(f)
                self._follow(replica)
                joined = True
        return joined

    def after_queued(self, durable: Callable[[], None]) -> None:
        """``durable`` of a point with nothing to send: after the points queued before it."""
        tail = self.batches[-1] if self.batches else None
        if tail is not None and tail.joining is not None:
            tail.joining.append(durable)
        else:
            durable()

    def has_room(self) -> bool:
        """Whether wait_room() would return at once."""
        lag = self.required_lag()
        return lag is not None and lag <= self.max_lag

    async def wait_room(self) -> None:
        """Wait while the replicas the policy requires lag by more than ``max_lag`` bytes;
        ReplicaError when fewer than ``min_replicas`` are left to wait for."""
        while True:
            lag = self.required_lag()
            if lag is None:
                error = self.rs.shortfall()
                raise error or ReplicaError("too few replicas in sync", [])
            if lag <= self.max_lag:
                return
            await self._moved.wait()

    def required_lag(self) -> int | None:
        """The lag of the K-th least behind replica (K = min_replicas; 0 when K is 0), None
        when fewer than K are followed."""
        k = self.rs.min_replicas
        if k == 0:
            return 0
        followers = self.followers
        if len(followers) == k:  # the common case: the most behind of them
            return self.total - min([f.acked_bytes for f in followers.values()])
        lags = sorted(self.total - f.acked_bytes for f in followers.values())
        return lags[k - 1] if len(lags) >= k else None

    async def drained(self) -> None:
        """Wait until every replica followed holds every batch taken so far (or has been left
        behind and marked); batches taken meanwhile are not waited for."""
        upto = self.count
        if self._nursery is None:
            # Nobody sends (the mount is ending, or a test drives it): send until done here.
            async with trio.open_nursery() as nursery:
                await nursery.start(self.run)
                await self._until_held(upto)
                nursery.cancel_scope.cancel()
            return
        await self._until_held(upto)

    async def _until_held(self, upto: int) -> None:
        while self.batches and self.batches[0].n < upto:
            await self._moved.wait()

    # ---------------------------------------------------------------- lag, for status

    def lag(self, replica: Replica) -> dict[str, Any] | None:
        """Bytes and seconds the replica is behind the points taken, and when the last point it
        holds was taken; None when it is not followed (not in sync: its sync map says)."""
        f = self.followers.get(replica)
        if f is None:
            return None
        oldest = self._batch(f.next_ack)
        return {"lag_bytes": self.total - f.acked_bytes,
                "lag_seconds": round(trio.current_time() - oldest.taken, 3) if oldest else 0.0,
                "lag_batches": self.count - f.next_ack,
                "acked_at": f.acked_wall or None}

    def annotate(self, replicas: list[Replica], rows: list[dict[str, Any]]) -> None:
        """Add each replica's lag to its status row: an in-sync replica's is what it has not
        acknowledged; one out of sync keeps its sync map's count, and its lag_seconds is how
        long it has been behind."""
        for r, row in zip(replicas, rows, strict=True):
            lag = self.lag(r)
            if lag is not None:
                row.update(lag)
            elif isinstance(r.behind_since, float):
                row["lag_seconds"] = round(time.time() - r.behind_since, 3)

    def status(self) -> dict[str, Any]:
        return {"max_lag": self.max_lag, "queued_bytes": sum(b.nbytes for b in self.batches),
                "queued_batches": len(self.batches), "taken_batches": self.count, "taken_points": self.points,
                "taken_bytes": self.total, "direct_barriers": self.direct, "direct_bytes": self.direct_bytes}

    def _batch(self, n: int) -> Batch | None:
        if not self.batches or n >= self.count:
            return None
        return self.batches[n - self.batches[0].n]

    # ---------------------------------------------------------------- the senders

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the followers until cancelled (start it with ``nursery.start``: two senders
        for one replica would interleave their barriers)."""
        if self._nursery is not None:
            raise RuntimeError("the backlog's senders run already")
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                for f in list(self.followers.values()):
                    nursery.start_soon(self._serve, f)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def _follow(self, replica: Replica) -> None:
        f = Follower(replica, replica.joins, self.count, self.count, self.total, 0.0)
        self.followers[replica] = f
        if self._nursery is not None:
            self._nursery.start_soon(self._serve, f)

    async def _serve(self, f: Follower) -> None:
        if f.gone:
            return
        if f.next_post != f.next_ack:
            # Its sender was cancelled with barriers in flight (run() ended and started again):
            # whether they landed is unknown, and posting them again could put older bytes
            # over newer ones. Resync it instead.
            f.replica.fail("asynchronous sender stopped with barriers in flight")
            self._drop(f)
            return
        f.scope = trio.CancelScope()
        with f.scope:
            send, recv = trio.open_memory_channel[PostedGroup](WINDOW - 1)
            f.send = send
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._complete, f, recv)
                    await self._post(f, send)
            finally:
                f.send = None

    async def _post(self, f: Follower, send: trio.MemorySendChannel[PostedGroup]) -> None:
        while not f.gone:
            b = self._batch(f.next_post)
            if b is None or (b.joining is not None and f.next_post != f.next_ack):
                # Nothing queued, or only the open batch while barriers are in flight: later
                # points join it until they are acknowledged (the completer wakes this).
                await f.wake.wait()
                f.wake = trio.Event()
                continue
            item = self._post_now(f)
            if item is None:
                return
            await send.send(item)

    def _post_now(self, f: Follower) -> PostedGroup | None:
        """Post the follower's next batches (up to GROUP of those queued), each as a barrier
        of its own; None when its replica cannot take them (it is dropped then)."""
        replica = f.replica
        if replica.state is not IN_SYNC or replica.joins != f.joins or replica not in self.rs.replicas:
            self._drop(f)
            return None
        group: PostedGroup = []
        while f.next_post < self.count and len(group) < GROUP:
            b = self._batch(f.next_post)
            assert b is not None
            if b.joining is not None:
                if group:
                    break  # the open batch goes out alone, when these are acknowledged
                b.close()
            posted = replica.post_copies(b.payload, b.ranges)
            if posted is None:  # the replica is stale now
                self._drop(f)
                return None
            f.next_post += 1
            group.append((posted, b))
        return group

    async def _complete(self, f: Follower, recv: trio.MemoryReceiveChannel[PostedGroup]) -> None:
        replica = f.replica
        async for group in recv:
            for posted, batch in group:
                done = replica.poll(posted)
                if done is None:
                    done = await replica.finish(posted, self.rs.timeout)
                if not done or f.gone:
                    self._drop(f)
                    return
                f.next_ack = batch.n + 1
                f.acked_bytes = batch.end
                f.acked_wall = batch.wall
            if f.next_ack == f.next_post < self.count:
                f.wake.set()  # nothing in flight, something queued: it may go now
            self._release()

    # ---------------------------------------------------------------- failures

    def fell_behind(self, replica: Replica) -> None:
        """The replica failed (its keeper saw it): what it has not acknowledged is marked now,
        before its keeper resyncs it."""
        f = self.followers.get(replica)
        if f is not None:
            self._drop(f)

    def _pull_ahead(self) -> None:
        """A replica the policy does not wait for that fell more than max_lag behind is left
        behind (marked, resynced later), so that the copies stay bounded (DRBD's pull-ahead)."""
        k = self.rs.min_replicas
        ranked = sorted(self.followers.values(), key=lambda f: self.total - f.acked_bytes)
        for f in ranked[k:]:
            if self.total - f.acked_bytes > self.max_lag:
                f.replica.fail(f"more than max_lag={self.max_lag} bytes behind with "
                               f"min_replicas={k} not waiting for it")
                self._drop(f)

    def _drop(self, f: Follower) -> None:
        """The follower's replica gets no more batches: everything it has not acknowledged is
        marked in the sync map (its resync sends that), and its sender stops."""
        if f.gone:
            return
        f.gone = True
        if self.followers.get(f.replica) is f:
            del self.followers[f.replica]
        missed: Ranges = []
        for n in range(f.next_ack, self.count):
            b = self._batch(n)
            if b is not None:
                missed += b.ranges
                b.pinned = b.pinned or n < f.next_post
        if missed and self.rs.syncmap is not None and f.replica in self.rs.replicas:
            self.rs.syncmap.mark([f.replica.slot], missed)
        if f.replica.state is IN_SYNC and f.replica.joins == f.joins:
            # Not failed by its transport (a membership change, say): it must resync all the same.
            f.replica.fail("left behind by the asynchronous sender")
        f.scope.cancel()
        self._release()

    def _release(self) -> None:
        """Free the batches every follower has acknowledged; wake whoever waits for progress."""
        low = min((f.next_ack for f in self.followers.values()), default=self.count)
        while self.batches and self.batches[0].n < low:
            b = self.batches.popleft()
            b.close()
            if not b.pinned and len(b.data) == self.merge and len(self._spare) < SPARE_BUFFERS:
                self._spare.append(b.data)
        self._moved.set()
        self._moved = trio.Event()
