"""The replica set over an in-memory transport: barriers, the min_replicas policy, and what
happens when a replica stops answering, answers late, out of order or with an error, or drops
its connection and comes back.

Only the replica set's public face is used (ReplicaSet.open/post/complete/barrier/keep/status/
aclose/in_sync/replicas, Replica.state/last_error). Time is trio's MockClock: a timeout costs
no real time, and durations are exact.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from mempool import new_pool
from memtransport import MemTarget, MemTransport

from rpmemfs.pool.layout import BLOCK, Header
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.replica import ReplicaError, ReplicaSet, ReplicaSpec
from rpmemfs.replica import resync as resync_module
from rpmemfs.replica.barriers import QUICK_OF
from rpmemfs.replica.replica_set import DEFAULT_RECONNECT, MAX_RECONNECT, PROBE_INTERVAL

TIMEOUT = 2.0
NAME = "app"


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


class Rig:
    """A local pool in memory with its sync map, and targets holding copies of it."""

    def __init__(self, n: int = 3) -> None:
        self.buf, self.hdr = new_pool()
        self.local = memoryview(self.buf)
        self.map_persists: list[list[tuple[int, int]]] = []
        self.syncmap = SyncMap(self.local, self.hdr, self.map_persists.append)
        self.syncmap.start(self.hdr, n)
        self.transport = MemTransport()
        self.targets = [self.transport.add(MemTarget(f"10.0.0.{i + 1}:7420", "apm" if i == 0 else "gpspm"))
                        for i in range(n)]
        content = bytes(self.buf[: self.hdr.map_off])
        for t in self.targets:
            t.pools[NAME] = bytearray(content) + bytearray(len(self.buf) - len(content))
        self.specs = [ReplicaSpec.make(t.address, NAME) for t in self.targets]

    async def open(self, min_replicas: int | None = None, timeout: float = TIMEOUT) -> ReplicaSet:
        rs = await ReplicaSet.open(self.specs, self.local, self.hdr.uuid, None, lanes=2, timeout=timeout,
                                   min_replicas=min_replicas, transport=self.transport,
                                   syncmap=self.syncmap)
        rs.probe = self.transport.probe
        return rs

    def scribble(self, ranges: list[tuple[int, int]]) -> None:
        """Change the local pool there (as the filesystem would before a durability point)."""
        for off, n in ranges:
            self.buf[off: off + n] = os.urandom(n)

    def replica_holds(self, i: int, ranges: list[tuple[int, int]]) -> bool:
        pool = self.targets[i].pools[NAME]
        return all(pool[o: o + n] == self.buf[o: o + n] for o, n in ranges)

    def identical(self, i: int) -> bool:
        return self.targets[i].pools[NAME][: self.hdr.map_off] == self.buf[: self.hdr.map_off]

    def chunks(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The sync map chunks ranges touch, as merged runs."""
        size = self.syncmap.chunk
        hit = sorted({c for o, n in ranges for c in range(o // size, (o + n - 1) // size + 1)})
        runs: list[tuple[int, int]] = []
        for c in hit:
            if runs and runs[-1][0] + runs[-1][1] == c * size:
                runs[-1] = (runs[-1][0], runs[-1][1] + size)
            else:
                runs.append((c * size, size))
        return runs

    def nchunks(self, ranges: list[tuple[int, int]]) -> int:
        """How many sync map chunks ranges touch."""
        return sum(n // self.syncmap.chunk for _, n in self.chunks(ranges))


def data(hdr: Header, block: int, n: int = BLOCK, skip: int = 0) -> tuple[int, int]:
    return (hdr.data_off + block * BLOCK + skip, n)


async def until(cond: Callable[[], bool], limit: float = 60.0) -> None:
    """Wait (in trio time) until cond() holds."""
    with trio.fail_after(limit):
        while not cond():
            await trio.sleep(0.01)


def states(rs: ReplicaSet) -> list[str]:
    return [r.state for r in rs.replicas]


# ------------------------------------------------------------------ healthy replicas


def test_barrier_places_exactly_the_ranges_on_every_replica() -> None:
    async def main() -> None:
        rig = Rig(3)
        rs = await rig.open()
        assert states(rs) == ["in-sync"] * 3 and len(rs.in_sync) == 3
        hdr = rig.hdr
        ranges = [data(hdr, 3, 5000, skip=100), data(hdr, 40, 10), (hdr.area_off(0) + 4096, 300)]
        elsewhere = [data(hdr, 20), data(hdr, 3, 50, skip=0)]  # changed, not asked for
        rig.scribble(ranges + elsewhere)
        before = [bytearray(t.pools[NAME]) for t in rig.targets]
        marks = [len(t.ops) for t in rig.targets]
        await rs.barrier(ranges)
        for i, t in enumerate(rig.targets):
            assert t.writes(marks[i]) == ranges  # these bytes, in this order, nothing else
            assert t.flushes(marks[i]) == 1  # and exactly one flush
            want = before[i]
            for o, n in ranges:
                want[o: o + n] = rig.buf[o: o + n]
            assert t.pools[NAME] == want
        st = rs.status()
        assert [r["barriers"] for r in st] == [1, 1, 1]
        assert [r["bytes"] for r in st] == [5310] * 3
        assert [r["method"] for r in st] == ["apm", "gpspm", "gpspm"]
        assert [r["flush"] for r in st] == ["read", "send", "send"]  # what each barrier ended with
        # An empty barrier reaches nobody.
        marks = [len(t.ops) for t in rig.targets]
        await rs.barrier([])
        assert [len(t.ops) for t in rig.targets] == marks
        await rs.aclose()
        assert all(t.sessions == [] for t in rig.targets)

    run(main)


def test_a_range_outside_the_pool_is_refused_before_anything_is_sent() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        marks = [len(t.ops) for t in rig.targets]
        with pytest.raises(ValueError, match="outside the local pool"):
            await rs.barrier([(len(rig.buf) - 10, 20)])
        assert [len(t.ops) for t in rig.targets] == marks
        assert states(rs) == ["in-sync"] * 2
        await rs.aclose()

    run(main)


def test_slow_replies_within_the_timeout_are_waited_for() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        rig.targets[1].delay(1.5)
        ranges = [data(rig.hdr, 1)]
        rig.scribble(ranges)
        t0 = trio.current_time()
        await rs.barrier(ranges)
        assert trio.current_time() - t0 == pytest.approx(1.5)
        assert states(rs) == ["in-sync"] * 2
        assert rig.replica_holds(1, ranges)
        await rs.aclose()

    run(main)


def test_barriers_are_quick_until_the_fastest_of_the_last_ones_took_over_2_ms() -> None:
    """quick() decides whether points wait for the one in flight (group commit) or post
    behind it (durability/point.py): a slow link turns it off, a fast one back on."""

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        ranges = [data(rig.hdr, 1)]
        assert rs.quick()  # nothing timed yet
        await rs.barrier(ranges)
        assert rs.quick()
        rig.targets[1].delay(0.5)
        for _ in range(QUICK_OF - 1):
            await rs.barrier(ranges)
        assert rs.quick()  # the fast one is still among the last QUICK_OF
        await rs.barrier(ranges)
        assert not rs.quick()
        rig.targets[1].delay(0)
        await rs.barrier(ranges)
        assert rs.quick()
        await rs.aclose()

    run(main)


def test_a_barrier_whose_wait_is_cancelled_fails_every_replica_it_still_waited_for() -> None:
    """The replicas are awaited one after another: a cancellation while the first is awaited
    must fail the second too (its barrier may be half sent), as a task each would have."""

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        for t in rig.targets:
            t.delay(1.0)
        ranges = [data(rig.hdr, 1)]
        rig.scribble(ranges)
        flight = rs.post(ranges)
        with trio.move_on_after(0.5):
            await rs.complete(flight)
        assert states(rs) == ["stale"] * 2
        assert all("cancelled while in flight" in (r.last_error or "") for r in rs.replicas)
        await rs.aclose()

    run(main)


def test_pipelined_barriers_answered_out_of_order_all_complete() -> None:
    """Replies to later barriers arrive before those to earlier ones (each fsync waits for
    its own): every barrier completes, nobody falls out of sync."""

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        rig.targets[0].reply_delays([0.5, 0.3, 0.1])
        rig.targets[1].reply_delays([0.4, 0.05, 0.2])
        batches = [[data(rig.hdr, 10 * i + 1, 100)] for i in range(3)]
        flights = []
        for ranges in batches:
            rig.scribble(ranges)
            flights.append(rs.post(ranges))
        done: list[tuple[int, float]] = []

        async def complete(i: int) -> None:
            await rs.complete(flights[i])
            done.append((i, trio.current_time()))

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(complete, i)
        assert [i for i, _ in done] == [2, 1, 0]  # the slower replica decides each
        assert [round(t - t0, 3) for _, t in done] == [0.2, 0.3, 0.5]
        assert states(rs) == ["in-sync"] * 2
        for i in range(2):
            assert rig.replica_holds(i, [r for b in batches for r in b])
            assert rig.targets[i].flushes() == 3
        await rs.aclose()

    run(main)


# ------------------------------------------------------------------ failures and the policy


def test_an_error_reply_with_min_replicas_1_leaves_that_replica_stale_and_marked() -> None:
    async def main() -> None:
        rig = Rig(3)
        rs = await rig.open(min_replicas=1)
        rig.targets[1].fail_flushes(1, "persist failed: Input/output error")
        first = [data(rig.hdr, 2), data(rig.hdr, 300, 10)]
        rig.scribble(first)
        await rs.barrier(first)  # enough replicas acknowledged it
        assert states(rs) == ["in-sync", "stale", "in-sync"]
        bad = rs.replicas[1]
        assert bad.last_error is not None and "persist failed: Input/output error" in bad.last_error
        assert str(rig.specs[1]) in bad.last_error
        assert rs.status()[1]["state"] == "stale" and rs.status()[1]["last_error"] == bad.last_error
        assert [r.spec for r in rs.in_sync] == [rig.specs[0], rig.specs[2]]
        # What it missed is in the sync map (its own slot only), before barrier() returned.
        assert rig.syncmap.count(1) == rig.nchunks(first)
        assert rig.syncmap.count(0) == rig.syncmap.count(2) == 0
        assert rig.map_persists, "the marks were persisted"
        # Later barriers go to the others only, and are marked for it too.
        mark = len(rig.targets[1].ops)
        second = [data(rig.hdr, 600)]
        rig.scribble(second)
        await rs.barrier(second)
        assert len(rig.targets[1].ops) == mark
        assert rig.syncmap.count(1) == rig.nchunks(first + second)
        assert rig.replica_holds(0, first + second) and rig.replica_holds(2, first + second)
        await rs.aclose()

    run(main)


def test_an_error_reply_with_min_replicas_2_of_2_fails_the_barrier() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=2)
        rig.targets[0].fail_flushes(1, "no space left on the target")
        ranges = [data(rig.hdr, 5)]
        rig.scribble(ranges)
        with pytest.raises(ReplicaError) as info:
            await rs.barrier(ranges)
        assert info.value.failed == [rs.replicas[0]]
        msg = str(info.value)
        assert "1 of 2 replicas, 2 required" in msg and "no space left on the target" in msg
        assert states(rs) == ["stale", "in-sync"]
        assert rig.syncmap.count(0) == 1
        # Until it is back, every barrier is refused at once, and still marked for it.
        more = [data(rig.hdr, 700)]
        with pytest.raises(ReplicaError, match="too few replicas in sync"):
            rs.post(more)
        assert rig.syncmap.count(0) == 2
        await rs.aclose()

    run(main)


def test_a_hung_replica_times_out_within_the_replica_timeout() -> None:
    async def main() -> None:
        rig = Rig(3)
        rs = await rig.open(min_replicas=2)
        rig.targets[2].hang()
        ranges = [data(rig.hdr, 7, 100)]
        rig.scribble(ranges)
        t0 = trio.current_time()
        await rs.barrier(ranges)
        assert trio.current_time() - t0 == pytest.approx(TIMEOUT)
        assert states(rs) == ["in-sync", "in-sync", "stale"]
        err = rs.replicas[2].last_error
        assert err is not None and ("within 2s" in err or "timed out after 2s" in err), err
        assert rig.replica_holds(0, ranges) and rig.replica_holds(1, ranges)
        assert rig.syncmap.count(2) == 1
        # The next barrier does not wait for it any more.
        t0 = trio.current_time()
        await rs.barrier([data(rig.hdr, 8)])
        assert trio.current_time() - t0 == 0
        await rs.aclose()

    run(main)


def test_a_hung_replica_with_min_replicas_all_fails_after_the_timeout() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        rig.targets[0].hang()
        t0 = trio.current_time()
        with pytest.raises(ReplicaError, match="1 of 2 replicas, 2 required"):
            await rs.barrier([data(rig.hdr, 1)])
        assert trio.current_time() - t0 == pytest.approx(TIMEOUT)
        await rs.aclose()

    run(main)


def test_an_acknowledgement_after_an_earlier_failure_on_the_lane_does_not_count() -> None:
    """Barriers on one lane land in order: once an earlier one failed on a replica, a later
    one's reply does not prove the replica holds everything before it."""

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=2)
        rig.targets[1].fail_flushes(1, "persist failed")
        rig.targets[1].reply_delays([0.1, 0.2])  # the failure arrives first
        f1 = rs.post([data(rig.hdr, 1)])
        f2 = rs.post([data(rig.hdr, 2)])
        results: dict[str, BaseException | None] = {}

        async def complete(name: str, flight: Any) -> None:
            try:
                await rs.complete(flight)
                results[name] = None
            except ReplicaError as exc:
                results[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete, "f2", f2)
            nursery.start_soon(complete, "f1", f1)
        assert isinstance(results["f1"], ReplicaError)
        assert isinstance(results["f2"], ReplicaError)
        assert states(rs) == ["in-sync", "stale"]
        assert rig.syncmap.count(1) == 2  # blocks 1 and 2: a chunk each
        await rs.aclose()

    run(main)


# ------------------------------------------------------------------ coming back


def test_a_dropped_replica_reconnects_and_gets_exactly_what_it_missed() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        rs.reconnect_interval = 0.05
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            synced = [data(rig.hdr, 1)]
            rig.scribble(synced)
            await rs.barrier(synced)
            target = rig.targets[1]
            target.drop()
            missed = [data(rig.hdr, 100, 3 * BLOCK), (rig.hdr.area_off(0) + 8192, 200)]
            rig.scribble(missed[:1])
            await rs.barrier(missed[:1])  # fails on the dropped replica...
            assert states(rs) == ["in-sync", "stale"]
            assert "connection lost" in (rs.replicas[1].last_error or "")
            rig.scribble(missed[1:])
            await rs.barrier(missed[1:])  # ...and this one is not even sent to it
            await trio.sleep(1.0)  # reconnection attempts fail meanwhile
            assert states(rs) == ["in-sync", "stale"]
            assert rig.syncmap.count(1) == rig.nchunks(missed)
            mark = len(target.ops)
            target.restart()
            await until(lambda: rs.replicas[1].state == "in-sync")
            # The resync sent the chunks of what it missed, no more, then joined the barriers.
            assert target.writes(mark) == rig.chunks(missed)
            assert rig.identical(1)
            assert rig.syncmap.count(1) == 0
            last = rs.status()[1]["last_resync"]
            assert last["bytes_sent"] == sum(n for _, n in rig.chunks(missed))
            assert rs.status()[1]["resyncs"] == 2  # at open, and now
            after = [data(rig.hdr, 200)]
            rig.scribble(after)
            mark = len(target.ops)
            await rs.barrier(after)
            assert target.writes(mark) == after
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_hung_replica_that_resumes_is_brought_back_by_keep() -> None:
    async def main() -> None:
        rig = Rig(3)
        rs = await rig.open(min_replicas=2, timeout=1.0)
        rs.reconnect_interval = 0.05
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            rig.targets[0].hang()
            missed = [data(rig.hdr, 9)]
            rig.scribble(missed)
            await rs.barrier(missed)
            assert states(rs) == ["stale", "in-sync", "in-sync"]
            await trio.sleep(3.0)  # reconnecting to a hung target times out too
            assert states(rs)[0] == "stale"
            assert "not opened within 1s" in (rs.replicas[0].last_error or "")
            rig.targets[0].resume()
            await until(lambda: states(rs) == ["in-sync"] * 3)
            assert rig.identical(0)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)]


def test_reconnect_attempts_back_off_to_at_most_max_reconnect() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)

        async def silent(address: str) -> bool:
            return False  # a port that never answers: only the backoff brings it back

        rs.probe = silent
        target = rig.targets[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            target.drop()
            await rs.barrier([data(rig.hdr, 1)])
            t0 = trio.current_time()
            await trio.sleep(600)  # a long outage
            tried = [t for t in target.attempts if t > t0]
            assert tried[0] - t0 == pytest.approx(DEFAULT_RECONNECT)
            assert gaps(tried)[:3] == [2 * DEFAULT_RECONNECT, 4 * DEFAULT_RECONNECT, MAX_RECONNECT]
            assert max(gaps(tried)) == MAX_RECONNECT == 5.0
            back = trio.current_time()
            target.restart()
            await until(lambda: states(rs) == ["in-sync"] * 2)
            assert trio.current_time() - back <= MAX_RECONNECT
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_target_that_accepts_connections_again_is_tried_at_once() -> None:
    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        target = rig.targets[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            target.drop()
            missed = [data(rig.hdr, 7)]
            rig.scribble(missed)
            await rs.barrier(missed)
            t0 = trio.current_time()
            await trio.sleep(100.1)  # the backoff is at its cap: the next attempt is seconds away
            tried = [t for t in target.attempts if t > t0]
            # The probes woke nobody while the target was down: full attempts as the backoff says.
            assert len(tried) == len([t for t in (1, 3, 7, *range(12, 101, 5)) if t <= 100.1])
            back = trio.current_time()
            target.restart()
            await until(lambda: states(rs) == ["in-sync"] * 2)
            assert trio.current_time() - back <= PROBE_INTERVAL
            assert target.probes == 1  # the probe that saw it back, then the attempt
            assert rig.identical(1)
            assert rs.status()[1]["last_error"] is None
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


def test_a_target_that_is_up_but_refuses_is_not_retried_faster() -> None:
    async def main() -> None:
        rig = Rig(2)
        rig.targets[1].pools[NAME] = other_pool()
        rs = await rig.open(min_replicas=1)
        target = rig.targets[1]
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            await trio.sleep(60)
            nursery.cancel_scope.cancel()
        tried = [t for t in target.attempts if t > t0]
        assert max(gaps(tried)) == MAX_RECONNECT
        assert len(tried) <= 14  # 1, 3, 7, then every 5 s
        # One probe per wait (which finds it accepting, so the wait runs its course).
        assert target.probes <= len(tried) + 1
        assert states(rs) == ["in-sync", "stale"]
        await rs.aclose()

    run(main)


# ------------------------------------------------------------------ the wrong pool


def other_pool(size: int | None = None) -> bytearray:
    buf, _ = new_pool(size) if size else new_pool()
    return buf


@pytest.mark.parametrize(
    ("pool", "reason"),
    [
        (lambda rig: other_pool(), "does not match the local pool uuid"),
        (lambda rig: other_pool(8 << 20), "remote pool is 8388608 bytes but the local pool is 4194304"),
        (lambda rig: bytearray(len(rig.buf)), "not an rpmemfs pool"),
        (None, "cannot open"),
    ],
    ids=["uuid", "size", "blank", "missing"],
)
def test_a_replica_that_is_not_this_pools_stays_stale_with_the_reason(
        pool: Callable[[Rig], bytearray] | None, reason: str) -> None:
    async def main() -> None:
        rig = Rig(2)
        if pool is None:
            del rig.targets[1].pools[NAME]
        else:
            rig.targets[1].pools[NAME] = pool(rig)
        foreign = bytes(rig.targets[1].pools.get(NAME, b""))
        rs = await rig.open(min_replicas=1)
        assert states(rs) == ["in-sync", "stale"]
        err = rs.replicas[1].last_error
        assert err is not None and reason in err and str(rig.specs[1]) in err, err
        rs.reconnect_interval = 0.05
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            await rs.barrier([data(rig.hdr, 3)])
            await trio.sleep(2.0)  # retried, refused again each time
            assert states(rs) == ["in-sync", "stale"]
            assert reason in (rs.replicas[1].last_error or "")
            nursery.cancel_scope.cancel()
        assert bytes(rig.targets[1].pools.get(NAME, b"")) == foreign  # never written to
        assert rig.targets[1].connects > 2
        # With both required, the mount could not go on.
        with pytest.raises(ReplicaError, match="too few replicas in sync"):
            rs2 = await rig.open(min_replicas=2)
            try:
                rs2.post([data(rig.hdr, 3)])
            finally:
                await rs2.aclose()
        await rs.aclose()

    run(main)


def test_an_unreachable_replica_at_open_joins_once_it_is_up() -> None:
    async def main() -> None:
        rig = Rig(2)
        rig.targets[1].drop()
        rs = await rig.open(min_replicas=1)
        assert states(rs) == ["in-sync", "stale"]
        assert "connection refused" in (rs.replicas[1].last_error or "")
        rs.reconnect_interval = 0.05
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            missed = [data(rig.hdr, 50, 2 * BLOCK)]
            rig.scribble(missed)
            await rs.barrier(missed)
            rig.targets[1].restart()
            await until(lambda: states(rs) == ["in-sync"] * 2)
            assert rig.identical(1)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


# ------------------------------------------------------------------ the barrier lock


async def timed_barrier(rs: ReplicaSet, ranges: list[tuple[int, int]]) -> float:
    """A barrier posted under the barrier lock, as a durability point posts it; how long it took."""
    t = trio.current_time()
    async with rs.lock:
        flight = rs.post(ranges)
    await rs.complete(flight)
    return trio.current_time() - t


def test_a_slow_last_resync_pass_holds_barriers_no_longer_than_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resync_module, "COPY_BATCH", BLOCK)

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        target = rig.targets[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            target.drop()
            missed = [data(rig.hdr, 16 * i) for i in range(8)]  # 8 chunks: 8 copy batches
            rig.scribble(missed)
            await rs.barrier(missed)
            # Each batch answered within the timeout, but 8 of them take 12 s: the last pass
            # (under the barrier lock: 8 chunks is a small one) must give up at the timeout.
            target.reply_delays([1.5] * 8)
            target.restart()
            await until(lambda: rs.replicas[1].state == "resyncing")
            waited = await timed_barrier(rs, [data(rig.hdr, 300)])
            assert waited <= TIMEOUT
            await until(lambda: rs.replicas[1].state == "stale", limit=0.1)
            assert "last resync pass did not end within 2s" in (rs.replicas[1].last_error or "")
            # Tried again (the delays run out): everything reaches it.
            await until(lambda: states(rs) == ["in-sync"] * 2)
            assert rig.identical(1)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    run(main)


@pytest.fixture
def inline_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checksums computed in the task, not a worker thread: MockClock jumps ahead while a
    thread runs, so timings measured around one would be whatever the jumps made them."""
    async def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


def _damage(rig: Rig, i: int, blocks: list[int]) -> None:
    pool = rig.targets[i].pools[NAME]
    for b in blocks:
        off, n = data(rig.hdr, b)
        pool[off: off + n] = os.urandom(n)


def test_a_live_repair_holds_barriers_for_one_batch_at_a_time(
        monkeypatch: pytest.MonkeyPatch, inline_threads: None) -> None:
    monkeypatch.setattr(resync_module, "COPY_BATCH", BLOCK)

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open()
        _damage(rig, 1, [16 * i for i in range(8)])
        rig.targets[1].delay(0.5)  # every flush: a batch of the repair, a barrier
        result: dict[str, Any] = {}

        async def repair() -> None:
            result.update(await rs.repair(rs.replicas[1]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(repair)
            await until(lambda: (rs.replicas[1].resync or {}).get("phase") == "repair")
            waits = [await timed_barrier(rs, [data(rig.hdr, 300 + k)]) for k in range(3)]
        # Each waited for one batch (0.5 s) and its own flush (0.5 s), not the whole repair (4 s).
        assert max(waits) <= 1.0 + 0.05, waits
        assert result["differing_chunks"] == 8 and result["chunks_sent"] == 8
        assert result["bytes_sent"] == 8 * BLOCK  # the damaged block of each 64 KiB chunk
        assert rig.identical(1) and states(rs) == ["in-sync"] * 2
        await rs.aclose()

    run(main)


def test_a_cut_link_during_a_live_repair_holds_barriers_no_longer_than_the_timeout(
        monkeypatch: pytest.MonkeyPatch, inline_threads: None) -> None:
    monkeypatch.setattr(resync_module, "COPY_BATCH", BLOCK)

    async def main() -> None:
        rig = Rig(2)
        rs = await rig.open(min_replicas=1)
        _damage(rig, 1, [16 * i for i in range(8)])
        rig.targets[1].reply_delays([math.inf])  # the first batch of the repair is never answered

        async def repair() -> None:
            with pytest.raises(trio.TooSlowError):
                await rs.repair(rs.replicas[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(repair)
            await until(lambda: (rs.replicas[1].resync or {}).get("phase") == "repair")
            waited = await timed_barrier(rs, [data(rig.hdr, 300)])
        # It waited for the lock until the batch timed out, and then not for the replica
        # that had failed: less than one timeout in all.
        assert waited <= TIMEOUT
        assert states(rs) == ["in-sync", "stale"]
        # What it found to differ and did not get is compared again when it is back.
        assert rig.syncmap.full(1)
        await rs.aclose()

    run(main)


# ------------------------------------------------------------------ membership


def test_a_replica_added_is_compared_resynced_and_joins_while_barriers_go_on() -> None:
    async def main() -> None:
        rig = Rig(3)
        third = rig.specs.pop()  # the pool starts with two; the third target holds a stale copy
        rs = await ReplicaSet.open(rig.specs, rig.local, rig.hdr.uuid, None, lanes=2, timeout=TIMEOUT,
                                   transport=rig.transport, syncmap=rig.syncmap)
        rs.probe = rig.transport.probe
        rs.reconnect_interval = 0.05
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            await trio.sleep(0.1)
            changed = [data(rig.hdr, 3), data(rig.hdr, 40)]
            rig.scribble(changed)
            await rs.barrier(changed)
            replica = await rs.add(third)
            assert replica.slot == 2 and rig.syncmap.full(2)
            for i in range(5):  # barriers meanwhile: never waiting on the new one
                more = [data(rig.hdr, 60 + i)]
                rig.scribble(more)
                await rs.barrier(more)
            await until(lambda: replica.state == "in-sync")
            assert rig.identical(2)
            assert not rig.syncmap.full(2)
            nursery.cancel_scope.cancel()
        await rs.aclose()

    trio.run(main)  # real time: a full compare checksums in a worker thread


def test_removing_a_replica_moves_the_later_ones_down_a_slot_with_what_they_miss() -> None:
    async def main() -> None:
        rig = Rig(3)
        rs = await rig.open(min_replicas=1)
        rs.reconnect_interval = 0.05
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rs.keep)
            await trio.sleep(0.05)  # its keepers running
            rig.targets[2].drop()
            missed = [data(rig.hdr, 7)]
            rig.scribble(missed)
            await rs.barrier(missed)
            assert states(rs) == ["in-sync", "in-sync", "stale"]
            assert rig.syncmap.count(2) == 1
            await rs.remove(rs.replicas[1])
            assert [r.spec for r in rs.replicas] == [rig.specs[0], rig.specs[2]]
            assert [r.slot for r in rs.replicas] == [0, 1]
            # What the third one missed is the second slot's now (and it is compared in full).
            assert rig.syncmap.full(1) and rig.syncmap.count(2) == 0 and not rig.syncmap.full(2)
            rig.targets[2].restart()
            await until(lambda: states(rs) == ["in-sync", "in-sync"])
            assert rig.identical(2)
            after = [data(rig.hdr, 9)]
            rig.scribble(after)
            mark = len(rig.targets[1].ops)
            await rs.barrier(after)
            assert rig.targets[1].writes(mark) == []  # the removed one gets nothing more
            nursery.cancel_scope.cancel()
        await rs.aclose()

    trio.run(main)  # real time: a full compare checksums in a worker thread
