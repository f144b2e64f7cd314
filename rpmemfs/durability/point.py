"""A durability point from start to end: begin, persist locally, post to the replicas,
complete, end; pipelined, in log order, with what failed sent again.

1. **Begin.** Under the barrier lock, the filesystem hands over what changed since the last
   point (:meth:`ChangeSource.take_changes`): data written through the cache, data written with
   non-temporal stores, ranges it persisted outside a point (checkpoints), and the log record
   that describes it all.
2. **Persist locally.** The data is flushed and fenced, and only then is the log record
   stored and persisted (:meth:`Persister.persist_then_store`): no durable record ever points
   at data that is not durable.
3. **Post.** The ranges go to every in-sync replica at once (`ReplicaSet.post`), in the order
   a replica must place them: what earlier points left for it (ranges persisted outside a
   point, and the ranges of a point that failed), then data, then the log. The lock is
   released here. While barriers come back quickly (`Barriers.quick`), points asked for
   while this one is in flight wait for it, and then the first of them takes the changes of
   all (group commit: at 16 writers with 2 replicas, 0.1-0.15 barriers per fsync instead of
   0.5, and twice the fsyncs per second or more); the others end with it. Over a slow link,
   or when the lock was held (a resync), a point posts behind the ones in flight instead:
   one ordered lane per replica keeps them in log order on the replica.
4. **Complete.** The point waits for its own acknowledgements (`ReplicaSet.complete`); fewer
   than ``min_replicas`` is a failure. A replica that fell behind is written into the pool's
   replica table before the point returns.
5. **End.** After every earlier point has ended, the filesystem is told its changes are
   durable (:meth:`ChangeSource.mark_durable`): the log may reuse its space and the blocks
   freed by those changes become reusable. A failed point ends nothing: its ranges are carried
   to the next point, and the caller gets :class:`DurabilityError`.

With asynchronous replication (a :class:`~rpmemfs.durability.backlog.Backlog`), steps 3 and 4
are the backlog's: under the lock the point's bytes are copied into it, the point ends at once,
and the caller waits only while the replicas lag by more than ``max_lag``. Step 5 comes when
the batch the point joined is closed to later points (backlog.py says why then).

A point larger than ``max_lag`` is not copied when the policy waits for every replica
(``min_replicas`` all, the default): its caller would wait until they acknowledged it anyway
(the lag it adds is above the bound), and a copy of its size costs memory of that size and a
page fault per 4 KiB on the primary (a 256 MiB write + fsync took 6.2-9.1x the daemon CPU per
MB of a mount without replicas, mostly page faults, and 522 MiB of anonymous memory). It is
sent as in sync mode instead, from the pool, as one barrier, once every batch before it is
acknowledged, with the barrier lock held until the replicas acknowledged it: no later point
is queued behind it meanwhile, so it is told durable before any later one, and the replicas
see the primary's states in order as before (:meth:`Durability._send_carried`). With fewer
replicas required it is copied as any other point: a barrier from the pool would hold every
writer until the slowest replica answered, which that policy promises not to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from rpmemfs.changeset import Changes, ChangeSource, Persister
from rpmemfs.durability.backlog import Backlog
from rpmemfs.durability.stale_table import StaleTable
from rpmemfs.durability.stats import Stats
from rpmemfs.errors import RpmemfsError
from rpmemfs.pool import position
from rpmemfs.ranges import Ranges
from rpmemfs.replica.replica_set import InFlight, ReplicaError, ReplicaSet

log = logging.getLogger("rpmemfs.durability")


class DurabilityError(RpmemfsError):
    """A durability point did not complete everywhere the policy requires; the local pool
    has the changes, the replicas get them with the next point. ``unexpected`` is the
    exception behind it when that was not a replica shortfall (a bug, for its traceback)."""

    def __init__(self, message: str, unexpected: BaseException | None = None) -> None:
        super().__init__(message)
        self.unexpected = unexpected


def _failed(error: Exception, report: bool) -> DurabilityError:
    """What a replicated point that failed with ``error`` raises, logged when ``report``: a
    failure that is not a replica shortfall is a bug, logged with its traceback."""
    unexpected = not isinstance(error, ReplicaError)
    if report:
        log.error("replication barrier failed: %s", error, exc_info=unexpected)
    return DurabilityError(str(error), error if unexpected else None)


_STAMP = (position.POSITION_OFF, position.SIZE)


def _last_stamp_only(ranges: Ranges) -> Ranges:
    """``ranges`` with only the last of their position stamps. Every stamp is the same range of
    the pool, read when its barrier is sent: an earlier one in the same barrier would say too
    early that the later points are there."""
    if ranges.count(_STAMP) <= 1:
        return ranges
    last = len(ranges) - 1 - ranges[::-1].index(_STAMP)
    return [r for i, r in enumerate(ranges) if r != _STAMP or i == last]


class _held:  # noqa: N801 (used as "async with _held(lock)", like the lock itself)
    """``async with lock`` that takes a free lock without a trip through the scheduler: trio's
    acquire() always yields, and a loaded mount takes the barrier lock once per fsync."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


class _Outcome:
    """How a replicated point ended, for the points posted after it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.failed: Exception | None = None

    @classmethod
    def settled(cls) -> _Outcome:
        o = cls()
        o.done.set()
        return o


class Durability:
    """The durability points of one mounted pool.

    Without ``replicas`` a point is local and synchronous. With them, ``stale_table`` records
    which replicas fell behind, and ``carry`` holds ranges already persisted here that the
    replicas must still get with the first point (a new epoch in the header, for example).
    """

    def __init__(self, source: ChangeSource, persister: Persister, replicas: ReplicaSet | None = None,
                 stale_table: StaleTable | None = None, carry: Iterable[tuple[int, int]] = (),
                 backlog: Backlog | None = None) -> None:
        self._source = source
        self._persister = persister
        self._replicas = replicas
        self._table = stale_table
        # Persisted here outside a point, in order; the next point carries them to replicas.
        self._carry: Ranges = list(carry)
        self._last = _Outcome.settled()
        self._takes = 0  # replicated points that took changes so far
        self._failures = 0  # replicated points that failed so far
        # Async mode: the "durable" of points too large to copy, carried (in _carry) to be
        # sent from the pool; told in order once a barrier of them is acknowledged.
        self._deferred: list[Callable[[], None]] = []
        self.stats = Stats()
        self.backlog = backlog  # asynchronous replication, else None

    async def point(self, *, background: bool = False, timed: bool = True) -> None:
        """A durability point: DurabilityError when the policy's replicas did not all get it.

        ``background``: a periodic commit's (commit.py), neither counted as an fsync nor logged
        when it fails (its caller logs a failing episode once). ``timed`` False: counted by the
        caller (grouped.py counts each fsync of a group)."""
        t0 = time.perf_counter_ns()
        if self._replicas is None:
            self.sync_local()
        elif self.backlog is not None:
            await self._queued_point(self._replicas, self.backlog, report=not background)
        else:
            await self._replicated_point(self._replicas, report=not background)
        if timed and not background:
            self.stats.add(time.perf_counter_ns() - t0)

    def point_now(self) -> bool:
        """True: a point done before this returned, as :meth:`point` would have; that is
        without replicas, and in async mode while the barrier lock is free and the replicas
        lag by at most max_lag after it. False: the caller must still run :meth:`point` (in
        async mode this one may have been queued already; the next finds nothing new and
        waits for room). DurabilityError as from point()."""
        rs, backlog = self._replicas, self.backlog
        if rs is None:
            t0 = time.perf_counter_ns()
            self.sync_local()
            self.stats.add(time.perf_counter_ns() - t0)
            return True
        if backlog is None or rs.lock.locked():
            return False
        t0 = time.perf_counter_ns()
        if self._queue(rs, backlog, report=True) or not backlog.has_room():
            return False
        self.stats.add(time.perf_counter_ns() - t0)
        return True

    def in_flight(self) -> bool:
        """Whether a replicated point is under way (sync mode): one asked for now would wait
        for it, or post behind it."""
        return not self._last.done.is_set()

    def quick(self) -> bool:
        """Whether replicated points come back quickly enough for a point to wait for the one
        in flight rather than post behind it (barriers.py QUICK_S)."""
        return self._replicas is None or self._replicas.quick()

    async def flush(self, *, background: bool = False) -> None:
        """A point, and (in async mode) until the replicas hold everything taken so far: what
        the periodic commit, `rpmemfs flush`, verify and unmount mean by "durable everywhere"."""
        await self.point(background=background)
        await self.drain()

    def replication_status(self) -> dict[str, Any]:
        b = self.backlog
        return {"replication": "sync" if b is None else "async", "backlog": None if b is None else b.status()}

    def with_lag(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The replica set's status rows, with each replica's lag in async mode."""
        if self.backlog is not None and self._replicas is not None:
            self.backlog.annotate(self._replicas.replicas, rows)
        return rows

    @asynccontextmanager
    async def senders(self) -> AsyncIterator[None]:
        """Async mode: the backlog's senders run while this block does."""
        if self.backlog is None:
            yield
            return
        async with trio.open_nursery() as nursery:
            await nursery.start(self.backlog.run)
            yield
            nursery.cancel_scope.cancel()

    async def drain(self) -> None:
        """Async mode: wait until the replicas acknowledged every point taken (lag 0);
        DurabilityError when fewer than min_replicas are left in sync. Else nothing."""
        rs, backlog = self._replicas, self.backlog
        if rs is None or backlog is None:
            return
        await backlog.drained()
        self.note_replicas()
        error = rs.shortfall()
        if error is not None:
            raise DurabilityError(str(error))

    def pending(self) -> bool:
        """Whether a point would have anything to do: changes not handed to a point yet, or
        ranges the replicas still have to get (a failed point's, or persisted outside one)."""
        return bool(self._carry) or self._source.has_changes()

    def sync_local(self) -> None:
        """A point that waits for no replica (there are none, or the mount is closing and
        they were served already)."""
        c = self._persist_locally()
        self._source.mark_durable(c.seq, c.tail)

    def persist_outside(self, ranges: Ranges) -> None:
        """Persist ranges written outside a point; replicas get them with the next one."""
        self._persister.persist(ranges)
        if self._replicas is not None:
            self._carry.extend(ranges)

    def note_replicas(self) -> None:
        """Record in the pool's replica table which replicas are out of sync now."""
        if self._table is not None and self._replicas is not None:
            ranges = self._table.update(self._replicas.replicas)
            if ranges:
                self.persist_outside(ranges)

    def _persist_locally(self) -> Changes:
        c = self._source.take_changes()
        if c.log is not None:
            # The stamp only once the records are persistent: a crash inside their store may
            # leave a torn record with intact ones after it, and a stamp older than them is
            # what tells a mount they belong to a point that never ended (fs/log.py scan).
            self._persister.persist_then_store(c.data, c.log[0], c.log[1], c.stamp)
        elif c.data:
            self._persister.persist(c.data)
        return c

    def _for_replicas(self, c: Changes) -> Ranges:
        carried = self._carry
        ranges = carried + c.persisted + c.stored + c.data
        if c.log is not None:
            ranges.append((c.log[0], len(c.log[1])))
        if c.stamp is not None:
            ranges.append((c.stamp[0], len(c.stamp[1])))
        self._carry = []
        return _last_stamp_only(ranges) if carried else ranges

    async def _queued_point(self, rs: ReplicaSet, backlog: Backlog, report: bool) -> None:
        async with _held(rs.lock):
            if self._queue(rs, backlog, report):
                await self._send_carried(rs, backlog, report)
                return
        try:
            await backlog.wait_room()
        except ReplicaError as e:
            self.note_replicas()
            if report:
                log.error("replication barrier failed: %s", e)
            raise DurabilityError(str(e)) from None

    def _queue(self, rs: ReplicaSet, backlog: Backlog, report: bool) -> bool:
        """An asynchronous point's work under the barrier lock: persist, copy into the backlog.
        True when it is larger than max_lag and every replica is required (or follows one that is):
        persisted, not copied, but carried with its "durable" for :meth:`_send_carried`, which
        the caller must run."""
        changes = self._persist_locally()
        ranges = self._for_replicas(changes)
        # Durable to the filesystem once the point's batch is closed to later points, so
        # that what it frees is reused only in a later barrier (backlog.py says why).
        durable = partial(self._source.mark_durable, changes.seq, changes.tail)
        if ranges:
            if changes.stamp is None:  # a point without a log record is stamped here
                ranges.append(self._stamp(rs.local_buf, changes.seq))
            if self._deferred or (rs.min_replicas == len(rs.replicas) > 0
                                  and sum([n for _, n in ranges]) > backlog.max_lag):
                self._carry = _last_stamp_only(ranges)  # what was carried before is at its head
                self._deferred.append(durable)
                return True
            try:
                backlog.take(ranges, durable)
            except ReplicaError as e:
                # As in sync mode: nothing went out, the next point carries the ranges.
                self._carry[:0] = ranges
                self.note_replicas()
                if report:
                    log.error("replication barrier failed: %s", e)
                raise DurabilityError(str(e)) from None
        else:
            backlog.after_queued(durable)
        return False

    async def _send_carried(self, rs: ReplicaSet, backlog: Backlog, report: bool) -> None:
        """Async mode, under the barrier lock: the carried ranges of points too large to copy,
        sent from the pool as one barrier once the replicas acknowledged every batch before
        them, and their points told durable once it is acknowledged. On failure, as a failed
        point in sync mode: the ranges stay carried for the next point, their points stay
        not durable (what they freed stays unused), and the caller gets DurabilityError."""
        await backlog.drained()
        ranges, self._carry = self._carry, []
        deferred, self._deferred = self._deferred, []
        try:
            await rs.barrier(ranges)
        except BaseException as e:
            self._carry[:0] = ranges
            self._deferred[:0] = deferred
            self.note_replicas()
            if not isinstance(e, Exception):
                raise
            raise _failed(e, report) from None
        backlog.direct += 1
        backlog.direct_bytes += sum([n for _, n in ranges])
        # The replicas in sync hold everything taken so far, and nothing is queued (the lock
        # is held since drained()): those that joined meanwhile are followed from here on, or
        # the next point would find fewer followed than min_replicas.
        backlog.follow_in_sync()
        self.note_replicas()
        for durable in deferred:
            durable()

    def _stamp(self, buf: memoryview, seq: int) -> tuple[int, int]:
        """Stamp the point's place in the history last in its batch (pool/position.py): a
        replica holding it holds the whole point, and promote can tell how far behind it is."""
        off, raw = position.stamp(seq)
        buf[off : off + len(raw)] = raw
        self._persister.persist([(off, len(raw))])
        return off, len(raw)

    async def _replicated_point(self, rs: ReplicaSet, report: bool = True) -> None:
        asked, failures = self._takes, self._failures
        if not self._last.done.is_set() and rs.quick():
            # Group commit: a point asked for while another is in flight waits for it, and
            # the first of those waiting then takes the changes of all of them.
            await self._last.done.wait()
            if self._takes > asked:
                await self._covered(failures)
                return
        outcome = _Outcome()
        error: Exception | None = None
        flight: InFlight | None = None
        async with _held(rs.lock):
            changes = self._persist_locally()
            self._takes += 1
            ranges = self._for_replicas(changes)
            before, self._last = self._last, outcome
            if ranges:
                try:
                    flight = rs.post(ranges)
                except ReplicaError as e:
                    self.note_replicas()
                    error = e
                except Exception as e:
                    error = e
        try:
            if flight is not None:
                try:
                    await rs.complete(flight)
                except Exception as e:
                    error = e
                finally:
                    # Before the point returns: a replica left behind must be known as such
                    # even if this daemon dies right after.
                    self.note_replicas()
            if not before.done.is_set():  # (a settled Event's wait() still costs a checkpoint)
                await before.done.wait()
            if error is None and not ranges and before.failed:
                # Nothing of its own: what this point covers went out with the point before,
                # and that one failed.
                error = before.failed
            if error is not None:
                # Local data is durable; replicas get these ranges with the next point, and
                # blocks freed meanwhile stay unused until then.
                self._carry[:0] = ranges
                outcome.failed = error
                self._failures += 1
                raise _failed(error, report) from None
            self._source.mark_durable(changes.seq, changes.tail)
        finally:
            outcome.done.set()

    async def _covered(self, failures: int) -> None:
        """The end of a point whose changes another took after it was asked for (everything
        written before an fsync is in the pool when it asks): that point's outcome is this
        one's. It is one of those still in flight, so once the last ends, it has; any failure
        since this point was asked fails it too (that is how the pipelined points report it),
        already logged by the point that failed."""
        last = self._last
        if not last.done.is_set():
            await last.done.wait()
        if self._failures > failures:
            raise DurabilityError(str(last.failed or "an earlier replication barrier failed"))
