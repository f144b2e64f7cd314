"""Asynchronous replication (durability/backlog.py) over the in-memory transport: points end
locally, the replicas follow in order with the bytes as they were at each point, writers wait
past max_lag, and a replica that fails is marked for everything it did not acknowledge.

Time is trio's MockClock: delays cost no real time, and durations are exact.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
from test_replica_set import NAME, Rig, data, run, until

from rpmemfs.admin.promote import behind
from rpmemfs.durability import Backlog, Committer, Durability, DurabilityError
from rpmemfs.durability.backlog import GROUP
from rpmemfs.pool.layout import BLOCK
from rpmemfs.pool.position import POSITION_OFF, Position, decode, encode
from rpmemfs.pool.position import SIZE as POSITION_SIZE
from rpmemfs.ranges import Ranges
from rpmemfs.replica import ReplicaError, ReplicaSet


def nchunks(rig: Rig, ranges: Ranges) -> int:
    """How many sync map chunks the ranges touch."""
    return sum(n for _, n in rig.chunks(ranges)) // rig.syncmap.chunk


async def take(rs: ReplicaSet, backlog: Backlog, ranges: Ranges) -> None:
    async with rs.lock:
        backlog.take(ranges)


def test_the_replica_gets_the_bytes_of_the_point_not_those_written_after_it() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        backlog = Backlog(rs)
        r = [data(rig.hdr, 5)]
        rig.scribble(r)
        at_point = bytes(rig.buf[r[0][0]: r[0][0] + BLOCK])
        await take(rs, backlog, r)
        rig.scribble(r)  # the primary writes the range again before anything was sent
        await backlog.drained()
        for t in rig.targets:
            assert t.pools[NAME][r[0][0]: r[0][0] + BLOCK] == at_point
        assert not rig.replica_holds(0, r)
        await take(rs, backlog, r)  # the next point carries the new bytes
        await backlog.drained()
        assert rig.replica_holds(0, r) and rig.replica_holds(1, r)
        await rs.aclose()

    run(main)


def test_points_reach_each_replica_in_order_each_a_barrier_with_its_own_flush() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        backlog = Backlog(rs, merge=0)  # no point joins another's batch
        marks = [len(t.ops) for t in rig.targets]
        points: list[Ranges] = []
        for i in range(10):
            # Overlapping ranges: only the order makes the last point's bytes win.
            p = [data(rig.hdr, 7, 100 + i, skip=i), data(rig.hdr, 9 + i)]
            rig.scribble(p)
            await take(rs, backlog, p)
            points.append(p)
        async with trio.open_nursery() as nursery:
            await nursery.start(backlog.run)
            await backlog.drained()
            nursery.cancel_scope.cancel()
        for i, t in enumerate(rig.targets):
            assert t.writes(marks[i]) == [r for p in points for r in p]
            # One flush per point: a target persists a lane's barriers one after another, so
            # a later point never lands before an earlier one is persisted.
            assert t.flushes(marks[i]) == len(points)
        assert rig.identical(0) and rig.identical(1)
        assert not backlog.batches  # nothing held once every replica acknowledged
        lag = backlog.lag(rs.replicas[0])
        assert lag is not None and (lag["lag_bytes"], lag["lag_seconds"], lag["lag_batches"]) == (0, 0.0, 0)
        await rs.aclose()

    run(main)


def test_points_queued_meanwhile_share_a_barrier_and_are_durable_only_once_it_is_closed() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        backlog = Backlog(rs)
        marks = [len(t.ops) for t in rig.targets]
        durable: list[int] = []
        points: list[Ranges] = []

        async def point(i: int) -> None:
            p = [data(rig.hdr, 7, 100 + i, skip=i), data(rig.hdr, 9 + i)]
            rig.scribble(p)
            async with rs.lock:
                backlog.take(p, lambda: durable.append(i))
            points.append(p)

        for i in range(5):  # no sender runs: each joins the open batch
            await point(i)
        # Not durable to the filesystem yet: a later point could still join their batch, and
        # so must not reuse what they freed.
        assert durable == [] and len(backlog.batches) == 1
        async with trio.open_nursery() as nursery:
            await nursery.start(backlog.run)
            await backlog.drained()
            assert durable == [0, 1, 2, 3, 4]  # closed when first sent
            for t in rig.targets:
                t.delay(0.5)
            await point(5)  # nothing in flight: sent at once, alone, durable at once
            assert durable[-1] == 5
            await point(6)  # both have 5 in flight: 6 and 7 share the next barrier
            await point(7)
            assert durable[-1] == 5 and len(backlog.batches) == 2
            await backlog.drained()
            assert durable == list(range(8))
            nursery.cancel_scope.cancel()
        for i, t in enumerate(rig.targets):
            assert t.writes(marks[i]) == [r for p in points for r in p]  # in order
        # One barrier for points 0-4, one for 5, one for 6 and 7.
        assert [t.flushes(m) for t, m in zip(rig.targets, marks, strict=True)] == [3, 3]
        assert rig.identical(0) and rig.identical(1)
        await rs.aclose()

    run(main)


def test_a_point_larger_than_merge_is_a_batch_of_its_own_and_durable_at_once() -> None:
    async def main() -> None:
        rig = Rig(1)
        rs = await rig.open()
        backlog = Backlog(rs, merge=2 * BLOCK)
        durable: list[int] = []
        async with rs.lock:
            backlog.take([data(rig.hdr, 1)], lambda: durable.append(1))
            backlog.take([data(rig.hdr, 2, 3 * BLOCK)], lambda: durable.append(2))
            backlog.after_queued(lambda: durable.append(3))  # nothing to send: after 2
            backlog.take([data(rig.hdr, 9)], lambda: durable.append(4))
        assert durable == [1, 2, 3] and len(backlog.batches) == 3
        await backlog.drained()
        assert durable == [1, 2, 3, 4]
        await rs.aclose()

    run(main)


def test_writers_wait_while_the_replicas_lag_past_max_lag_and_lag_is_reported() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        rig.targets[1].delay(1.0)
        backlog = Backlog(rs, max_lag=2 * BLOCK)
        async with trio.open_nursery() as nursery:
            await nursery.start(backlog.run)
            t0 = trio.current_time()
            for block in (1, 2):
                await take(rs, backlog, [data(rig.hdr, block)])
                await backlog.wait_room()  # within max_lag: no wait
            assert trio.current_time() == t0
            await trio.sleep(0.25)
            slow = backlog.lag(rs.replicas[1])
            assert slow is not None and slow["lag_bytes"] == 2 * BLOCK
            assert slow["lag_seconds"] == pytest.approx(0.25)
            fast = backlog.lag(rs.replicas[0])
            assert fast is not None and fast["lag_bytes"] == 0
            await take(rs, backlog, [data(rig.hdr, 3)])
            await backlog.wait_room()  # 3 blocks behind on the slow replica: until it acks
            assert trio.current_time() - t0 == pytest.approx(1.0)
            assert backlog.required_lag() is not None and backlog.required_lag() <= 2 * BLOCK  # type: ignore[operator]
            await backlog.drained()
            assert rig.identical(1)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_with_min_replicas_1_writers_wait_only_for_the_fastest_and_a_straggler_is_left_behind() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        rig.targets[1].delay(1.5)
        backlog = Backlog(rs, max_lag=2 * BLOCK)
        async with trio.open_nursery() as nursery:
            await nursery.start(backlog.run)
            t0 = trio.current_time()
            points = [[data(rig.hdr, b)] for b in range(1, 5)]
            for p in points:
                rig.scribble(p)
                await take(rs, backlog, p)
                await backlog.wait_room()
                await trio.sleep(0.01)
            assert trio.current_time() - t0 < 0.1  # the fast replica keeps up: nobody waited
            # The straggler went past max_lag: failed, and marked for all it had not acknowledged.
            assert rs.replicas[1].state == "stale"
            assert "max_lag" in (rs.replicas[1].last_error or "")
            assert rig.syncmap.count(1) == nchunks(rig, [r for p in points for r in p])
            assert backlog.lag(rs.replicas[1]) is None
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_replica_that_fails_is_marked_for_everything_it_missed_queued_included_then_resynced() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        rs.reconnect_interval = 0.05
        backlog = Backlog(rs)
        target = rig.targets[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            await nursery.start(backlog.run)
            first = [data(rig.hdr, 1)]
            rig.scribble(first)
            await take(rs, backlog, first)
            await backlog.drained()
            target.hang()  # nothing more is placed or answered
            missed = [[data(rig.hdr, 20)], [data(rig.hdr, 40, 3 * BLOCK)],
                      [(rig.hdr.area_off(0) + 8192, 200)]]
            for p in missed:
                rig.scribble(p)
                await take(rs, backlog, p)
            await until(lambda: rs.replicas[1].state != "in-sync", 30)
            assert rig.syncmap.count(1) == nchunks(rig, [r for p in missed for r in p])
            await until(lambda: not backlog.batches, 30)  # nothing is held for it
            mark = len(target.ops)
            target.restart()
            await until(lambda: rs.replicas[1].state == "in-sync", 60)
            # Its resync sent exactly the chunks of what it had not acknowledged.
            assert target.writes(mark) == rig.chunks([r for p in missed for r in p])
            assert rig.identical(1)
            # And it follows the points taken after it rejoined, not the ones before.
            after = [data(rig.hdr, 60)]
            rig.scribble(after)
            mark = len(target.ops)
            await take(rs, backlog, after)
            await backlog.drained()
            assert target.writes(mark) == after
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_replica_that_rejoins_while_the_open_batch_waits_gets_the_next_point() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        rs.reconnect_interval = 0.05
        backlog = Backlog(rs)
        target = rig.targets[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            await nursery.start(backlog.run)
            target.hang()
            p0 = [data(rig.hdr, 1)]
            rig.scribble(p0)
            await take(rs, backlog, p0)
            await until(lambda: rs.replicas[1].state != "in-sync", 30)
            rig.targets[0].delay(5.0)
            p1, p2 = [data(rig.hdr, 2)], [data(rig.hdr, 3)]
            for p in (p1, p2):  # p1 goes out at once; p2 opens a batch behind it
                rig.scribble(p)
                await take(rs, backlog, p)
            assert backlog.batches[-1].joining is not None
            target.restart()
            await until(lambda: rs.replicas[1].state == "in-sync", 4)  # p1 still in flight
            assert backlog.batches[-1].joining is not None
            mark = len(target.ops)
            p3 = [data(rig.hdr, 4)]
            rig.scribble(p3)
            await take(rs, backlog, p3)  # not in the open batch: the replica follows from here
            await backlog.drained()
            assert target.writes(mark) == p3
            assert rig.identical(0) and rig.identical(1)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_batch_buffer_is_used_again_once_held_everywhere_but_never_after_a_drop_in_flight() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        backlog = Backlog(rs)
        async with trio.open_nursery() as nursery:
            await nursery.start(backlog.run)
            p1, p2 = [data(rig.hdr, 1)], [data(rig.hdr, 2)]
            rig.scribble(p1)
            await take(rs, backlog, p1)
            first = backlog.batches[-1].data
            await backlog.drained()
            rig.scribble(p2)
            await take(rs, backlog, p2)
            assert backlog.batches[-1].data is first  # no fresh memory per batch
            await backlog.drained()
            assert rig.replica_holds(0, p2) and rig.replica_holds(1, p2)
            # A replica dropped with a batch in flight: its transport may still hold views of
            # that buffer, so the buffer is not used again.
            rig.targets[1].hang()
            p3 = [data(rig.hdr, 3)]
            rig.scribble(p3)
            await take(rs, backlog, p3)
            third = backlog.batches[-1].data
            await until(lambda: rs.replicas[1].state != "in-sync", 30)
            await backlog.drained()
            p4 = [data(rig.hdr, 4)]
            rig.scribble(p4)
            await take(rs, backlog, p4)
            assert backlog.batches[-1].data is not third
            await backlog.drained()
            assert rig.replica_holds(0, p4)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_barrier_failing_inside_a_group_marks_that_batch_and_the_later_ones_only() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        backlog = Backlog(rs, merge=0)  # a barrier per point
        # Queued before the senders start, so each replica's sender posts them as one group.
        points = [[data(rig.hdr, 20 * (i + 1))] for i in range(6)]
        assert len(points) <= GROUP
        for p in points:
            rig.scribble(p)
            await take(rs, backlog, p)
        rig.targets[1].fail_flushes(1, after=2)  # its third barrier fails
        async with trio.open_nursery() as nursery:
            await nursery.start(backlog.run)
            await backlog.drained()
            nursery.cancel_scope.cancel()
        assert rs.replicas[0].state == "in-sync" and rs.replicas[1].state != "in-sync"
        assert all(rig.replica_holds(0, p) for p in points)
        # What it acknowledged is not resent; the failed batch and those after it are.
        acked, missed = points[:2], points[2:]
        assert all(rig.replica_holds(1, p) for p in acked)
        assert rig.syncmap.count(1) == nchunks(rig, [r for p in missed for r in p])
        assert rig.syncmap.count(0) == 0
        await rs.aclose()

    run(main)


def test_a_point_below_min_replicas_queues_nothing_and_fails() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        rs.replicas[1].fail("test: gone")
        backlog = Backlog(rs)
        p = [data(rig.hdr, 3)]
        with pytest.raises(ReplicaError, match="too few replicas in sync"):
            await take(rs, backlog, p)
        assert not backlog.batches
        assert rig.syncmap.count(1) == 1  # the replica out of sync is marked all the same
        await rs.aclose()

    run(main)


@dataclass
class Changes:
    persisted: Ranges = field(default_factory=list)
    stored: Ranges = field(default_factory=list)
    data: Ranges = field(default_factory=list)
    log: tuple[int, bytes] | None = None
    seq: int = 0
    tail: int = 0
    stamp: tuple[int, bytes] | None = None


class Source:
    def __init__(self) -> None:
        self.queue: list[Changes] = []
        self.durable: list[int] = []

    def has_changes(self) -> bool:
        return bool(self.queue)

    def take_changes(self) -> Changes:
        return self.queue.pop(0) if self.queue else Changes()

    def mark_durable(self, seq: int, tail: int) -> None:
        self.durable.append(seq)


class Persister:
    def __init__(self, buf: bytearray) -> None:
        self.buf = buf

    def persist(self, ranges: object) -> None:
        pass

    def persist_then_store(self, first: object, offset: int, data: bytes,
                           then: tuple[int, bytes] | None = None) -> None:
        for at, part in ((offset, data), *((then,) if then is not None else ())):
            self.buf[at: at + len(part)] = part


@asynccontextmanager
async def _slow_pair(max_lag: int | None = None
                     ) -> AsyncIterator[tuple[Rig, ReplicaSet, Source, Backlog, Durability]]:
    """Two replicas that take 0.5 s per barrier, followed asynchronously, senders running."""
    rig = Rig(2)
    rs = await rig.open()
    for t in rig.targets:
        t.delay(0.5)
    src = Source()
    backlog = Backlog(rs) if max_lag is None else Backlog(rs, max_lag=max_lag)
    d = Durability(src, Persister(rig.buf), rs, backlog=backlog)
    async with trio.open_nursery() as nursery:
        await nursery.start(backlog.run)
        yield rig, rs, src, backlog, d
        nursery.cancel_scope.cancel()
    await rs.aclose()


def test_an_async_point_ends_locally_and_flush_waits_for_the_replicas() -> None:
    async def main() -> None:
        async with _slow_pair() as (rig, rs, src, backlog, d):
            block = [data(rig.hdr, 11)]
            rig.scribble(block)
            src.queue.append(Changes(data=block, log=(rig.hdr.area_off(0) + 4096, os.urandom(64)), seq=1))
            t0 = trio.current_time()
            await d.point()
            assert trio.current_time() == t0  # no replica was waited for
            await trio.testing.wait_all_tasks_blocked()  # (its replicas' senders start)
            # Sent, so no later point joins its barrier: its log space and freed blocks are
            # reusable, long before the replicas acknowledge it.
            assert src.durable == [1] and trio.current_time() == t0
            src.queue.append(Changes(data=[data(rig.hdr, 12)], seq=2))
            rig.scribble([data(rig.hdr, 12)])
            await d.flush()
            assert trio.current_time() - t0 >= 0.5
            assert rig.replica_holds(0, block + [data(rig.hdr, 12)])
            assert rig.replica_holds(1, block + [data(rig.hdr, 12)])
            assert all(backlog.lag(r)["lag_bytes"] == 0 for r in rs.replicas)  # type: ignore[index]
            # Below min_replicas the point fails, as in sync mode, and carries its ranges.
            rs.replicas[1].fail("test: gone")
            await trio.sleep(0)
            src.queue.append(Changes(data=[data(rig.hdr, 13)], seq=3))
            with pytest.raises(DurabilityError, match="too few replicas"):
                await d.point()
            assert src.durable == [1, 2]
            assert d.pending()

    run(main)


def test_max_lag_must_be_positive() -> None:
    async def main() -> None:
        rig = Rig(1)
        rs = await rig.open()
        with pytest.raises(ValueError, match="max_lag"):
            Backlog(rs, max_lag=0)
        await rs.aclose()

    run(main)


def test_promote_reports_how_far_behind_the_most_advanced_replica_its_source_was() -> None:
    a, b = Position(120, 5_000_000_000), Position(100, 4_250_000_000)
    assert behind("x", {"x": b, "y": a, "z": None}) == {
        "replicas": {"x": b.as_dict(), "y": a.as_dict(), "z": None},
        "most_advanced": "y", "records": 20, "seconds": 0.75}
    assert behind("y", {"x": b, "y": a})["records"] == 0  # type: ignore[index]
    # Replicated synchronously: no stamps, nothing to say.
    assert behind("x", {"x": None, "y": None}) is None
    # The stamp round-trips, and a torn one reads as none.
    raw = encode(a)
    assert decode(raw) == a and decode(raw[:-1] + bytes([raw[-1] ^ 1])) is None


def test_the_periodic_commit_and_the_barrier_drain_wait_until_the_replicas_hold_everything() -> None:
    async def main() -> None:
        async with _slow_pair() as (rig, rs, src, backlog, d):
            block = [data(rig.hdr, 21)]
            rig.scribble(block)
            src.queue.append(Changes(data=block, seq=1))
            t0 = trio.current_time()
            assert await Committer(d, 5).tick()  # a point, then until the replicas hold it
            assert trio.current_time() - t0 == pytest.approx(0.5)
            assert rig.replica_holds(0, block) and rig.replica_holds(1, block)
            # What a live repair or a removal waits for under the barrier lock: nothing owed.
            more = [data(rig.hdr, 22)]
            rig.scribble(more)
            src.queue.append(Changes(data=more, seq=2))
            await d.point()
            lag = backlog.lag(rs.replicas[1])
            assert lag is not None and lag["lag_bytes"] > 0  # not acknowledged yet
            async with rs.lock:
                await rs.drain()
                assert rig.replica_holds(0, more) and rig.replica_holds(1, more)
                assert not backlog.batches
                assert all(backlog.lag(r) == {**(backlog.lag(r) or {}), "lag_bytes": 0} for r in rs.replicas)

    run(main)


def test_a_point_larger_than_max_lag_goes_from_the_pool_behind_the_batches_before_it() -> None:
    """Not copied (its writer waits for the replicas anyway): one barrier sent once the batches
    before it are acknowledged, told durable only once acknowledged, and no later point is
    queued or told durable before it."""
    async def main() -> None:
        async with _slow_pair(max_lag=2 * BLOCK) as (rig, rs, src, backlog, d):
            small, big, after = [data(rig.hdr, 30)], [data(rig.hdr, 31, 3 * BLOCK)], [data(rig.hdr, 40)]
            rig.scribble(small + big + after)
            src.queue.append(Changes(data=small, seq=1))
            marks = [len(t.ops) for t in rig.targets]
            t0 = trio.current_time()
            await d.point()  # queued and sent at once: 0.5 s in flight
            src.queue.append(Changes(data=big, seq=2))
            seen: list[object] = []

            async def meanwhile() -> None:
                await trio.sleep(0.7)  # the big point's own barrier is in flight
                seen.append((list(src.durable), d.point_now(), len(backlog.batches)))
                src.queue.append(Changes(data=after, seq=3))
                await d.point()  # behind the big one: queued (copied) once it is acknowledged
                seen.append(list(src.durable))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(meanwhile)
                await d.point()
                assert trio.current_time() - t0 == pytest.approx(1.0)  # the small one's, then its own
                assert src.durable == [1, 2]
            # While it was in flight: not durable, point_now could not go (the lock is held),
            # and nothing was queued behind it.
            assert seen == [([1], False, 0), [1, 2, 3]]
            await d.flush()
            stamp = rig.targets[0].writes(marks[0])[-1]
            for i, t in enumerate(rig.targets):
                # A barrier each, in order, each point's ranges then its stamp.
                assert t.writes(marks[i]) == small + [stamp] + big + [stamp] + after + [stamp]
                assert t.flushes(marks[i]) == 3
                assert rig.replica_holds(i, small + big + after)
            st = backlog.status()
            assert (st["direct_barriers"], st["direct_bytes"]) == (1, 3 * BLOCK + stamp[1])
            assert st["taken_points"] == 2 and st["taken_bytes"] == 2 * (BLOCK + stamp[1])

    run(main)


def test_a_large_point_that_fails_stays_carried_and_not_durable_as_in_sync_mode() -> None:
    async def main() -> None:
        async with _slow_pair(max_lag=2 * BLOCK) as (rig, rs, src, backlog, d):
            big = [data(rig.hdr, 50, 4 * BLOCK)]
            rig.scribble(big)
            src.queue.append(Changes(data=big, seq=1))
            assert not d.point_now()  # too large to copy: carried for point(), nothing queued
            assert not backlog.batches and src.durable == [] and d.pending()
            rig.targets[1].fail_flushes()
            with pytest.raises(DurabilityError, match="acknowledged by too few"):
                await d.point()
            # What it freed stays unused; the replica that failed is marked for it, and the
            # next point carries it.
            assert src.durable == [] and d.pending()
            assert rig.syncmap.count(1) >= nchunks(rig, big) and rig.syncmap.count(0) == 0
            assert backlog.status()["direct_barriers"] == 0 and not backlog.batches  # (counts those sent)

    run(main)


@pytest.mark.parametrize("required", [0, 1])
def test_with_fewer_replicas_required_a_large_point_is_queued_as_any_other(required: int) -> None:
    """A barrier from the pool would hold every writer until the slowest replica answered."""
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=required)
        backlog = Backlog(rs, max_lag=2 * BLOCK)
        src = Source()
        d = Durability(src, Persister(rig.buf), rs, backlog=backlog)
        big = [data(rig.hdr, 60, 4 * BLOCK)]
        rig.scribble(big)
        src.queue.append(Changes(data=big, seq=1))
        d.point_now()  # (with min_replicas=1 its writer then waits for room, in point())
        assert backlog.status()["direct_barriers"] == 0 and backlog.status()["taken_points"] == 1
        await rs.aclose()

    run(main)


def test_after_a_large_point_alone_the_replicas_are_followed_and_an_empty_point_succeeds() -> None:
    """The backlog follows a replica from the first point it queues; a large point queues
    nothing, so it must start following them itself, or the next point finds fewer followed
    than min_replicas and fails although both are in sync."""
    async def main() -> None:
        async with _slow_pair(max_lag=2 * BLOCK) as (rig, rs, src, backlog, d):
            big = [data(rig.hdr, 70, 3 * BLOCK)]
            rig.scribble(big)
            src.queue.append(Changes(data=big, seq=1))
            await d.point()
            assert backlog.status()["direct_barriers"] == 1 and len(backlog.followers) == 2
            assert d.point_now()  # nothing new, nothing behind: done in the handler
            await d.point()
            await d.flush()
            small = [data(rig.hdr, 80)]
            rig.scribble(small)
            src.queue.append(Changes(data=small, seq=2))
            await d.flush()
            assert rig.replica_holds(0, big + small) and rig.replica_holds(1, big + small)
            assert [seq for seq in src.durable if seq] == [1, 2]  # (the empty points' are 0)

    run(main)


def test_large_points_carried_together_go_as_one_barrier_with_one_stamp_last() -> None:
    """Two handlers carry a large point each before a coroutine takes the lock: one barrier,
    their "durable" in order, and the position stamp once, after both (read when sent, an
    earlier copy of it would claim the second point before its bytes were there)."""
    async def main() -> None:
        async with _slow_pair(max_lag=2 * BLOCK) as (rig, rs, src, backlog, d):
            one, two = [data(rig.hdr, 90, 3 * BLOCK)], [data(rig.hdr, 94, 3 * BLOCK)]
            rig.scribble(one + two)
            marks = [len(t.ops) for t in rig.targets]
            src.queue += [Changes(data=one, seq=1), Changes(data=two, seq=2)]
            assert not d.point_now() and not d.point_now()
            assert src.durable == [] and not backlog.batches
            src.queue.append(Changes(seq=2))  # what the filesystem hands an empty point
            await d.point()
            assert src.durable == [1, 2, 2]
            stamp = (POSITION_OFF, POSITION_SIZE)
            for i, t in enumerate(rig.targets):
                assert t.writes(marks[i]) == one + two + [stamp] and t.flushes(marks[i]) == 1
            assert decode(bytes(rig.targets[0].pools[NAME][POSITION_OFF: POSITION_OFF + POSITION_SIZE])) \
                == Position(2, decode(bytes(rig.buf[POSITION_OFF: POSITION_OFF + POSITION_SIZE])).time_ns)

    run(main)
