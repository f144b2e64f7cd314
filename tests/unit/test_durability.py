"""The durability point over stand-ins: a change source, a persister and a replica set that
record what they are asked and fail or stall on demand (no pool, no FUSE, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from rpmemfs.durability import Durability, DurabilityError
from rpmemfs.replica.replica_set import ReplicaError

Ranges = list[tuple[int, int]]


@dataclass
class FakeChanges:
    persisted: Ranges = field(default_factory=list)
    stored: Ranges = field(default_factory=list)
    data: Ranges = field(default_factory=list)
    log: tuple[int, bytes] | None = None
    seq: int = 0
    tail: int = 0


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

    def persist_then_store(self, first: object, offset: int, data: bytes) -> None:
        self.calls.append(("persist", list(first)))  # type: ignore[call-overload]
        self.calls.append(("store", (offset, len(data))))


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


def test_points_asked_during_a_flight_wait_and_go_out_as_one_barrier() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    rs.auto = False
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    src.change(data=[(4096, 10)])
    ended: list[str] = []

    async def main() -> None:
        async def one(name: str) -> None:
            await d.point()
            ended.append(name)

        async with trio.open_nursery() as n:
            n.start_soon(one, "first")
            await trio.testing.wait_all_tasks_blocked()
            src.change(data=[(8192, 10)])  # written while the first is in flight
            for name in ("a", "b", "c"):
                n.start_soon(one, name)
            await trio.testing.wait_all_tasks_blocked()
            assert len(rs.posted) == 1  # they wait for the one in flight...
            rs.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert rs.posted[1:] == [[(8192, 10)]]  # ...then one barrier takes all they wrote
            assert ended == ["first"]
            rs.release[1].set()

    trio.run(main)
    assert len(rs.posted) == 2
    assert sorted(ended) == ["a", "b", "c", "first"]
    assert src.durable == [1, 2]
    assert d.stats.fsyncs == 4


def test_points_covered_by_a_failed_barrier_fail_with_it() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    rs.auto = False
    rs.fail_complete = {1}
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    src.change(data=[(4096, 10)])
    failed: list[str] = []

    async def main() -> None:
        async def one(name: str) -> None:
            try:
                await d.point()
            except DurabilityError:
                failed.append(name)

        async with trio.open_nursery() as n:
            n.start_soon(one, "first")
            await trio.testing.wait_all_tasks_blocked()
            src.change(data=[(8192, 10)])
            for name in ("a", "b"):
                n.start_soon(one, name)
            await trio.testing.wait_all_tasks_blocked()
            rs.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            rs.release[1].set()

    trio.run(main)
    # Whichever of a and b took the changes, both fsyncs covered them: both fail.
    assert sorted(failed) == ["a", "b"]
    assert src.durable == [1]
    src.change(data=[(12288, 10)])
    rs.auto = True
    trio.run(d.point)  # the failed barrier's ranges go with the next one
    assert rs.posted[2] == [(8192, 10), (12288, 10)]


@pytest.mark.parametrize("why", ["lock held", "slow replicas"])
def test_points_that_post_behind_one_in_flight_end_in_log_order(why: str) -> None:
    src, p, rs = Source(), Persister(), Replicas()
    rs.auto = False
    rs.fast = why != "slow replicas"  # then nobody waits for the one in flight
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    src.change(data=[(4096, 10)])
    src.change(data=[(8192, 10)])
    ended: list[str] = []

    async def main() -> None:
        async def one(name: str) -> None:
            await d.point()
            ended.append(name)

        async with trio.open_nursery() as n:
            # With the lock held (a resync), both are asked for before either posts: the
            # second finds none in flight, so it posts behind the first without waiting.
            if rs.fast:
                await rs.lock.acquire()
            n.start_soon(one, "first")
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(one, "second")
            await trio.testing.wait_all_tasks_blocked()
            if rs.fast:
                rs.lock.release()
            await trio.testing.wait_all_tasks_blocked()
            assert len(rs.posted) == 2
            rs.release[1].set()  # the second's replies come first...
            await trio.testing.wait_all_tasks_blocked()
            assert ended == [] and src.durable == []  # ...but it waits for the first
            rs.release[0].set()

    trio.run(main)
    assert ended == ["first", "second"]
    assert src.durable == [1, 2]


def test_an_empty_point_posted_behind_a_failed_one_fails_too() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    rs.auto = False
    rs.fail_complete = {0}
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    src.change(data=[(4096, 10)])
    errors: list[str] = []

    async def main() -> None:
        async def one(name: str) -> None:
            try:
                await d.point()
            except DurabilityError:
                errors.append(name)

        async with trio.open_nursery() as n:
            await rs.lock.acquire()  # both asked for before either posts (see above)
            n.start_soon(one, "first")
            await trio.testing.wait_all_tasks_blocked()
            # nothing changed since: this fsync covers what the first one carries
            n.start_soon(one, "empty")
            await trio.testing.wait_all_tasks_blocked()
            rs.lock.release()
            await trio.testing.wait_all_tasks_blocked()
            assert len(rs.posted) == 1
            rs.release[0].set()

    trio.run(main)
    assert sorted(errors) == ["empty", "first"]
    assert src.durable == []


def test_a_point_waiting_behind_a_failed_one_sends_what_it_carries_again() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    rs.auto = False
    rs.fail_complete = {0}
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    src.change(data=[(4096, 10)])
    errors: list[str] = []
    ended: list[str] = []

    async def main() -> None:
        async def one(name: str) -> None:
            try:
                await d.point()
                ended.append(name)
            except DurabilityError:
                errors.append(name)

        async with trio.open_nursery() as n:
            n.start_soon(one, "first")
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(one, "waiting")  # asked for while the first is in flight
            await trio.testing.wait_all_tasks_blocked()
            rs.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            # It took no change of its own, but the first's ranges, carried: they go again.
            assert rs.posted[1:] == [[(4096, 10)]]
            rs.release[1].set()

    trio.run(main)
    assert errors == ["first"] and ended == ["waiting"]
    assert src.durable == [1]
