"""The durability point over stand-ins: a change source, a persister and a replica set that
record what they are asked and fail or stall on demand (no pool, no FUSE, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from rpmemfs.durability import Durability, DurabilityError
from rpmemfs.ranges import Ranges
from rpmemfs.replica.replica_set import ReplicaError


@dataclass
class FakeChanges:
    persisted: Ranges = field(default_factory=list)
    stored: Ranges = field(default_factory=list)
    data: Ranges = field(default_factory=list)
    log: tuple[int, bytes] | None = None
    seq: int = 0
    tail: int = 0
    stamp: tuple[int, bytes] | None = None


class Source:
    """Hands out one prepared change set per point and records what was marked durable."""

    def __init__(self) -> None:
        self.queue: list[FakeChanges] = []
        self.durable: list[int] = []
        self.seq = 0

    def change(self, **kw: object) -> FakeChanges:
        self.seq += 1
        c = FakeChanges(seq=self.seq, tail=self.seq * 100, **kw)  # type: ignore[arg-type]
        self.queue.append(c)
        return c

    def has_changes(self) -> bool:
        return bool(self.queue)

    def take_changes(self) -> FakeChanges:
        return self.queue.pop(0) if self.queue else FakeChanges(seq=self.seq, tail=self.seq * 100)

    def mark_durable(self, seq: int, tail: int) -> None:
        assert tail == seq * 100
        self.durable.append(seq)


class Persister:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def persist(self, ranges: object) -> None:
        self.calls.append(("persist", list(ranges)))  # type: ignore[call-overload]

    def persist_then_store(self, first: object, offset: int, data: bytes,
                           then: tuple[int, bytes] | None = None) -> None:
        self.calls.append(("persist", list(first)))  # type: ignore[call-overload]
        self.calls.append(("store", (offset, len(data))))
        if then is not None:
            self.calls.append(("store", (then[0], len(then[1]))))


class Replicas:
    """The replica set's barrier API: post() records the ranges; complete() waits for the test
    to release it, then acknowledges or fails."""

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.replicas: list[object] = []
        self.posted: list[Ranges] = []
        self.release: list[trio.Event] = []
        self.fail_post = False
        self.fail_complete: set[int] = set()  # indexes of posts whose completion fails
        self.auto = True
        self.fast = True  # quick(): barriers come back fast enough to group points

    def quick(self) -> bool:
        return self.fast

    def post(self, ranges: Ranges) -> int:
        if self.fail_post:
            raise ReplicaError("too few replicas in sync", [])
        self.posted.append(list(ranges))
        self.release.append(trio.Event())
        if self.auto:
            self.release[-1].set()
        return len(self.posted) - 1

    async def complete(self, flight: int) -> None:
        await self.release[flight].wait()
        if flight in self.fail_complete:
            raise ReplicaError("barrier acknowledged by too few replicas", [])


def test_local_point_flushes_data_before_storing_the_log() -> None:
    src, p = Source(), Persister()
    d = Durability(src, p)
    src.change(data=[(4096, 10), (8192, 20)], log=(512, b"r" * 40))
    trio.run(d.point)
    assert p.calls == [("persist", [(4096, 10), (8192, 20)]), ("store", (512, 40))]
    assert src.durable == [1]
    assert d.stats.fsyncs == 1


def test_replicas_get_carried_ranges_then_data_then_the_log() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    d = Durability(src, p, rs, carry=[(0, 100)])  # type: ignore[arg-type]
    d.persist_outside([(2048, 50)])
    src.change(persisted=[(300, 3)], stored=[(1 << 20, 65536)], data=[(4096, 10)], log=(512, b"x" * 8))
    trio.run(d.point)
    assert rs.posted == [[(0, 100), (2048, 50), (300, 3), (1 << 20, 65536), (4096, 10), (512, 8)]]
    assert src.durable == [1]
    # what was carried went out once
    src.change(data=[(4096, 10)])
    trio.run(d.point)
    assert rs.posted[1] == [(4096, 10)]


def test_a_failed_point_raises_and_its_ranges_go_with_the_next() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    rs.fail_complete = {0}
    src.change(data=[(4096, 10)], log=(512, b"a" * 8))
    with pytest.raises(DurabilityError):
        trio.run(d.point)
    assert src.durable == []  # nothing ended: freed blocks stay unused
    assert p.calls[-1] == ("store", (512, 8))  # but the local pool has it
    src.change(data=[(8192, 10)], log=(520, b"b" * 8))
    trio.run(d.point)
    assert rs.posted[1] == [(4096, 10), (512, 8), (8192, 10), (520, 8)]
    assert src.durable == [2]


def test_a_post_refused_for_too_few_replicas_raises() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    rs.fail_post = True
    src.change(data=[(4096, 10)])
    with pytest.raises(DurabilityError):
        trio.run(d.point)
    rs.fail_post = False
    trio.run(d.point)
    assert rs.posted == [[(4096, 10)]]


class Stalled:
    """A durability point over stand-ins whose barriers complete only when the test releases
    them (``rs.release[i].set()``), and points started by name: which ended, which failed."""

    def __init__(self, fail_complete: set[int] | None = None, fast: bool = True) -> None:
        self.src, self.p, self.rs = Source(), Persister(), Replicas()
        self.rs.auto = False
        self.rs.fast = fast
        self.rs.fail_complete = fail_complete or set()
        self.d = Durability(self.src, self.p, self.rs)  # type: ignore[arg-type]
        self.ended: list[str] = []
        self.failed: list[str] = []

    async def point(self, name: str) -> None:
        try:
            await self.d.point()
        except DurabilityError:
            self.failed.append(name)
        else:
            self.ended.append(name)

    async def start(self, n: trio.Nursery, *names: str) -> None:
        for name in names:
            n.start_soon(self.point, name)
            await trio.testing.wait_all_tasks_blocked()

    async def release(self, i: int) -> None:
        self.rs.release[i].set()
        await trio.testing.wait_all_tasks_blocked()


def test_points_asked_during_a_flight_wait_and_go_out_as_one_barrier() -> None:
    t = Stalled()
    t.src.change(data=[(4096, 10)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            await t.start(n, "first")
            t.src.change(data=[(8192, 10)])  # written while the first is in flight
            await t.start(n, "a", "b", "c")
            assert len(t.rs.posted) == 1  # they wait for the one in flight...
            await t.release(0)
            assert t.rs.posted[1:] == [[(8192, 10)]]  # ...then one barrier takes all they wrote
            assert t.ended == ["first"]
            await t.release(1)

    trio.run(main)
    assert len(t.rs.posted) == 2
    assert sorted(t.ended) == ["a", "b", "c", "first"]
    assert t.src.durable == [1, 2]
    assert t.d.stats.fsyncs == 4


def test_points_covered_by_a_failed_barrier_fail_with_it() -> None:
    t = Stalled(fail_complete={1})
    t.src.change(data=[(4096, 10)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            await t.start(n, "first")
            t.src.change(data=[(8192, 10)])
            await t.start(n, "a", "b")
            await t.release(0)
            await t.release(1)

    trio.run(main)
    # Whichever of a and b took the changes, both fsyncs covered them: both fail.
    assert sorted(t.failed) == ["a", "b"]
    assert t.src.durable == [1]
    t.src.change(data=[(12288, 10)])
    t.rs.auto = True
    trio.run(t.d.point)  # the failed barrier's ranges go with the next one
    assert t.rs.posted[2] == [(8192, 10), (12288, 10)]


@pytest.mark.parametrize("why", ["lock held", "slow replicas"])
def test_points_that_post_behind_one_in_flight_end_in_log_order(why: str) -> None:
    t = Stalled(fast=why != "slow replicas")  # slow: nobody waits for the one in flight
    t.src.change(data=[(4096, 10)])
    t.src.change(data=[(8192, 10)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            # With the lock held (a resync), both are asked for before either posts: the
            # second finds none in flight, so it posts behind the first without waiting.
            if t.rs.fast:
                await t.rs.lock.acquire()
            await t.start(n, "first", "second")
            if t.rs.fast:
                t.rs.lock.release()
                await trio.testing.wait_all_tasks_blocked()
            assert len(t.rs.posted) == 2
            await t.release(1)  # the second's replies come first...
            assert t.ended == [] and t.src.durable == []  # ...but it waits for the first
            await t.release(0)

    trio.run(main)
    assert t.ended == ["first", "second"]
    assert t.src.durable == [1, 2]


def test_an_empty_point_posted_behind_a_failed_one_fails_too() -> None:
    t = Stalled(fail_complete={0})
    t.src.change(data=[(4096, 10)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            await t.rs.lock.acquire()  # both asked for before either posts (see above)
            # nothing changed since the first: the second fsync covers what the first carries
            await t.start(n, "first", "empty")
            t.rs.lock.release()
            await trio.testing.wait_all_tasks_blocked()
            assert len(t.rs.posted) == 1
            await t.release(0)

    trio.run(main)
    assert sorted(t.failed) == ["empty", "first"]
    assert t.src.durable == []


def test_a_point_waiting_behind_a_failed_one_sends_what_it_carries_again() -> None:
    t = Stalled(fail_complete={0})
    t.src.change(data=[(4096, 10)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            await t.start(n, "first", "waiting")  # the second asked for while the first is in flight
            await t.release(0)
            # It took no change of its own, but the first's ranges, carried: they go again.
            assert t.rs.posted[1:] == [[(4096, 10)]]
            await t.release(1)

    trio.run(main)
    assert t.failed == ["first"] and t.ended == ["waiting"]
    assert t.src.durable == [1]
