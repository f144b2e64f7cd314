"""Grouped durability points (rpmemfs/durability/grouped.py) over the stand-ins of
test_durability: callers answered later, one point per group, a failure failing its group."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from test_durability import Persister, Replicas, Source

from rpmemfs.durability import Durability, DurabilityError, grouped
from rpmemfs.durability.grouped import GroupedPoints


class Answers:
    def __init__(self) -> None:
        self.got: dict[str, BaseException | None] = {}

    def __call__(self, caller: str, error: BaseException | None) -> None:
        assert caller not in self.got, f"{caller} answered twice"
        self.got[caller] = error


def _setup(fast: bool = True) -> tuple[Source, Replicas, Durability, Answers, GroupedPoints[str]]:
    src, reps = Source(), Replicas()
    reps.fast = fast
    d = Durability(src, Persister(), reps)  # type: ignore[arg-type]
    answers = Answers()
    return src, reps, d, answers, GroupedPoints(d, answers)


async def _a_in_flight(nursery: trio.Nursery, src: Source, groups: GroupedPoints[str]) -> None:
    """The runner started, and "a" asked for a point over one change: in flight once this returns
    (where the test's replicas hold their barriers)."""
    nursery.start_soon(groups.run)
    src.change(data=[(4096, 10)])
    groups.ask("a")
    await trio.testing.wait_all_tasks_blocked()


def test_fsyncs_asked_while_a_point_is_in_flight_share_the_next_point() -> None:
    src, reps, d, answers, groups = _setup()
    reps.auto = False

    async def main() -> None:
        async with trio.open_nursery() as n:
            await _a_in_flight(n, src, groups)
            assert len(reps.posted) == 1 and d.in_flight()
            # Written and asked for while the first point waits for its replicas.
            src.change(data=[(8192, 10)])
            for who in "bcd":
                groups.ask(who)
            await trio.testing.wait_all_tasks_blocked()
            assert len(reps.posted) == 1 and answers.got == {}
            reps.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert answers.got == {"a": None}
            assert len(reps.posted) == 2 and reps.posted[1] == [(8192, 10)]
            reps.release[1].set()
            await groups.answered()
            n.cancel_scope.cancel()

    trio.run(main)
    assert answers.got == {"a": None, "b": None, "c": None, "d": None}
    assert groups.groups == 2 and d.stats.fsyncs == 4  # each fsync counted, not each point
    assert src.durable == [1, 2]


def test_a_failed_point_fails_its_whole_group_and_the_next_group_carries_its_ranges() -> None:
    src, reps, d, answers, groups = _setup()
    reps.fail_complete = {0}

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(groups.run)
            src.change(data=[(4096, 10)])
            groups.ask("a")
            groups.ask("b")
            await groups.answered()
            src.change(data=[(8192, 10)])
            groups.ask("c")
            await groups.answered()
            n.cancel_scope.cancel()

    trio.run(main)
    assert isinstance(answers.got["a"], DurabilityError) and answers.got["a"] is answers.got["b"]
    assert answers.got["c"] is None
    # Nothing of the failed point is lost: the next one sends it again, before its own.
    assert reps.posted == [[(4096, 10)], [(4096, 10), (8192, 10)]]


def test_answered_waits_for_the_group_in_flight_and_those_asked_meanwhile() -> None:
    src, reps, d, answers, groups = _setup()
    reps.auto = False

    async def main() -> None:
        async with trio.open_nursery() as n:
            await _a_in_flight(n, src, groups)
            src.change(data=[(8192, 10)])
            groups.ask("b")
            done = trio.Event()

            async def wait() -> None:
                await groups.answered()
                done.set()

            n.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()
            reps.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set() and answers.got == {"a": None}
            reps.release[1].set()
            await done.wait()
            assert answers.got == {"a": None, "b": None}
            n.cancel_scope.cancel()

    trio.run(main)


def test_over_a_slow_link_each_group_posts_at_once_behind_the_one_in_flight() -> None:
    src, reps, d, answers, groups = _setup(fast=False)
    reps.auto = False

    async def main() -> None:
        async with trio.open_nursery() as n:
            await _a_in_flight(n, src, groups)
            src.change(data=[(8192, 10)])
            groups.ask("b")
            await trio.testing.wait_all_tasks_blocked()
            # Pipelined: b's point is out before a's came back, and ends after it.
            assert len(reps.posted) == 2 and answers.got == {}
            reps.release[1].set()
            await trio.testing.wait_all_tasks_blocked()
            assert answers.got == {}
            reps.release[0].set()
            await groups.answered()
            n.cancel_scope.cancel()

    trio.run(main)
    assert answers.got == {"a": None, "b": None} and src.durable == [1, 2]


def test_a_cancelled_runner_still_answers_the_group_in_its_point() -> None:
    src, reps, d, answers, groups = _setup()
    reps.auto = False

    async def main() -> None:
        async with trio.open_nursery() as outer:
            runner = trio.CancelScope()

            async def run() -> None:
                with runner:
                    await groups.run()

            outer.start_soon(run)
            src.change(data=[(4096, 10)])
            groups.ask("a")
            await trio.testing.wait_all_tasks_blocked()
            runner.cancel()
            # The point is shielded: it ends (here, once released), and "a" gets its answer.
            await trio.testing.wait_all_tasks_blocked()
            assert answers.got == {}
            reps.release[0].set()

    trio.run(main)
    assert answers.got == {"a": None}


def test_point_now_without_replicas_and_in_async_mode_with_room() -> None:
    src, p = Source(), Persister()
    d = Durability(src, p)
    src.change(data=[(4096, 10)])
    assert d.point_now() and src.durable == [1] and d.stats.fsyncs == 1

    _, reps, sync_d, _, _ = _setup()
    assert not sync_d.point_now() and reps.posted == []  # sync replication always waits


def test_a_caller_alone_is_declined_and_callers_that_come_together_are_grouped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src, reps, d, answers, groups = _setup()
    reps.auto = False
    now = [100.0]
    monkeypatch.setattr(grouped, "_clock", lambda: now[0])

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(groups.run)
            # Nothing in flight, nobody came during a point: the caller posts its own.
            assert not groups.offer("alone") and groups.asked == 0
            src.change(data=[(4096, 10)])
            groups.ask("a")
            await trio.testing.wait_all_tasks_blocked()
            assert d.in_flight() and groups.offer("b")  # came during a point: grouped
            reps.release[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert not d.in_flight()
            now[0] += grouped.GROUPING_S / 2
            assert groups.offer("c")  # a wave is still coming
            await groups.answered()
            now[0] += grouped.GROUPING_S
            assert not groups.offer("late")  # alone again
            n.cancel_scope.cancel()

    trio.run(main)
    assert set(answers.got) == {"a", "b", "c"}
