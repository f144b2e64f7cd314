"""The periodic commit (-o commit=SECONDS) over the durability point's stand-ins, in trio's
MockClock: it runs a point only when something is pending, keeps log order with fsyncs
in flight, logs a failing episode once, and never raises."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from test_durability import Persister, Replicas, Source

from rpmemfs.durability import Committer, Durability


def run_for(committer: Committer, seconds: float) -> None:
    async def main() -> None:
        with trio.move_on_after(seconds):
            await committer.run()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_nothing_pending_means_no_point_at_all() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    c = Committer(d, 5)
    run_for(c, 60)
    assert p.calls == [] and rs.posted == [] and c.points == 0


def test_a_change_is_made_durable_within_the_interval_and_is_not_counted_as_an_fsync() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    d = Durability(src, p, rs, carry=[(0, 100)])  # type: ignore[arg-type]
    c = Committer(d, 5)
    src.change(data=[(4096, 10)], log=(512, b"r" * 8))
    run_for(c, 5.5)
    # The first tick: the carried ranges (a new epoch, say), the data, then the log record.
    assert rs.posted == [[(0, 100), (4096, 10), (512, 8)]]
    assert src.durable == [1] and c.points == 1
    assert d.stats.fsyncs == 0
    run_for(c, 30)  # nothing since: nothing more
    assert len(rs.posted) == 1 and c.points == 1


def test_a_commit_asked_for_during_an_fsync_in_flight_goes_out_after_it() -> None:
    src, p, rs = Source(), Persister(), Replicas()
    rs.auto = False
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    c = Committer(d, 5)
    src.change(data=[(4096, 10)])
    src.change(data=[(8192, 10)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(d.point)  # an fsync, its replies not in yet
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(c.tick)
            await trio.testing.wait_all_tasks_blocked()
            assert rs.posted == [[(4096, 10)]]  # the commit waits for the fsync in flight...
            rs.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert rs.posted[1:] == [[(8192, 10)]] and src.durable == [1]  # ...then goes out
            rs.release[1].set()

    trio.run(main)
    assert src.durable == [1, 2]
    assert c.points == 1 and d.stats.fsyncs == 1


def test_a_failing_commit_is_logged_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rpmemfs")
    src, p, rs = Source(), Persister(), Replicas()
    d = Durability(src, p, rs)  # type: ignore[arg-type]
    c = Committer(d, 5)
    rs.fail_post = True
    src.change(data=[(4096, 10)])
    run_for(c, 62)
    assert c.failures == 12 and c.failing and "too few replicas" in c.failing
    failed = [r for r in caplog.records if "periodic commit failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR
    assert not [r for r in caplog.records if "replication barrier failed" in r.getMessage()]
    assert p.calls[0] == ("persist", [(4096, 10)])  # local persist happened the first time
    rs.fail_post = False
    run_for(c, 5.5)
    assert rs.posted == [[(4096, 10)]]  # what failed went out with the next commit
    assert src.durable == [1] and c.failing is None
    again = [r for r in caplog.records if "periodic commit works again" in r.getMessage()]
    assert len(again) == 1


def test_an_unexpected_error_never_ends_the_commit(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Source):
        def take_changes(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("a bug")

    src, p = Broken(), Persister()
    d = Durability(src, p)  # type: ignore[arg-type]
    c = Committer(d, 1)
    src.change(data=[(4096, 10)])
    run_for(c, 10.5)
    assert c.failures == 10
    logged = [r for r in caplog.records if "periodic commit failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


def test_the_interval_is_checked() -> None:
    d = Durability(Source(), Persister())  # type: ignore[arg-type]
    for bad in (0, -1, 1e9):
        with pytest.raises(ValueError):
            Committer(d, bad)
