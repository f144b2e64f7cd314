"""A replica's states: the moves TRANSITIONS allows work, every other move raises, and the
state reads as the strings status and the CLI have always shown."""

from __future__ import annotations

import json
import logging
from itertools import product
from typing import Any

import pytest
import trio

from rpmemfs.replica.barriers import Barriers
from rpmemfs.replica.replica import TRANSITIONS, Replica, ReplicaState, TransitionError
from rpmemfs.replica.resync import resync
from rpmemfs.replica.spec import ReplicaSpec

S = ReplicaState
ALLOWED = sorted((a, b) for a, moves in TRANSITIONS.items() for b in moves)
REFUSED = sorted((a, b) for a, b in product(S, S) if b not in TRANSITIONS[a])


def _replica(state: ReplicaState = S.CONNECTING) -> Replica:
    replica = Replica(ReplicaSpec("127.0.0.1:7000", "pool"))
    replica.state = state  # test set-up: start from any state
    return replica


def test_every_state_has_its_moves_written() -> None:
    assert set(TRANSITIONS) == set(S)
    # the moves that happen: a first connection fails or succeeds, a stale replica is
    # resynced, a resync ends or fails, an in-sync replica fails
    expected = [
        (S.CONNECTING, S.STALE), (S.CONNECTING, S.RESYNCING), (S.STALE, S.RESYNCING),
        (S.RESYNCING, S.IN_SYNC), (S.RESYNCING, S.STALE), (S.IN_SYNC, S.STALE),
    ]
    assert sorted(expected) == ALLOWED


@pytest.mark.parametrize(("start", "to"), ALLOWED)
def test_allowed_moves(start: ReplicaState, to: ReplicaState) -> None:
    replica = _replica(start)
    replica.move(to)
    assert replica.state is to


@pytest.mark.parametrize(("start", "to"), REFUSED)
def test_refused_moves(start: ReplicaState, to: ReplicaState) -> None:
    replica = _replica(start)
    with pytest.raises(TransitionError, match=f"from {start} to {to}"):
        replica.move(to)
    assert replica.state is start


def test_states_read_as_strings() -> None:
    assert [str(s) for s in S] == ["connecting", "in-sync", "stale", "resyncing"]
    replica = _replica(S.IN_SYNC)
    assert replica.state == "in-sync" and f"{replica.state}" == "in-sync"
    status = replica.status()
    assert type(status["state"]) is str and json.loads(json.dumps(status))["state"] == "in-sync"


def test_fail_and_join() -> None:
    replica = _replica()
    replica.fail("no route")
    assert replica.state is S.STALE and replica.last_error == "replica 127.0.0.1:7000/pool: no route"
    assert replica.fell_behind.is_set()
    # failing a stale replica is no move, and the first error stays the cause
    replica.fail("an echo on another lane")
    assert replica.state is S.STALE and replica.last_error.endswith("no route")
    with pytest.raises(TransitionError):
        replica.joined()  # only a resync makes a replica in sync
    replica.move(S.RESYNCING)
    replica.joined()
    assert replica.status()["state"] == "in-sync" and not replica.fell_behind.is_set()


class _Map:
    """What resync asks of a sync map: one chunk pending, taken, marked again, settled."""

    chunk = 4096

    def __init__(self) -> None:
        self.pending = [(0, 4096)]
        self.settled = False
        self.missed = [4096]

    def full(self, slot: int) -> bool:
        return False

    def count(self, slot: int) -> int:
        return len(self.pending)

    def take(self, slot: int) -> list[tuple[int, int]]:
        runs, self.pending = self.pending, []
        return runs

    def mark(self, slots: list[int], ranges: list[tuple[int, int]], *, again: bool = False) -> None:
        self.pending += ranges

    def settle(self, slot: int) -> None:
        self.settled = True


class _Lane:
    def __init__(self, during: Any) -> None:
        self.during = during

    def post(self, region: object, writes: object, method: object = None) -> object:
        self.during()
        return object()

    async def wait(self, ticket: object) -> None:
        pass


@pytest.mark.parametrize("old_barrier_fails", [False, True])
def test_resync_joins_only_a_replica_still_resyncing(old_barrier_fails: bool) -> None:
    """A barrier posted on the replica's previous session that fails during its resync
    makes it stale and marks what it missed; the resync then neither settles the map nor
    lets it join, so its keeper tries again and sends that."""
    replica = _replica(S.STALE)
    syncmap = _Map()

    def during_copy() -> None:
        if old_barrier_fails:
            replica.fail("the previous session's lane is closed")
            syncmap.mark([replica.slot], [(8192, 4096)])

    replica.lanes = [_Lane(during_copy)]  # type: ignore[list-item]
    replica.region = object()  # type: ignore[assignment]
    rs = Barriers([replica], memoryview(bytearray(16384)), min_replicas=0,
                  syncmap=syncmap)  # type: ignore[arg-type]

    joined = trio.run(resync, rs, replica, lambda n: None)

    assert joined is not old_barrier_fails
    if old_barrier_fails:
        assert replica.state is S.STALE and not syncmap.settled and syncmap.pending == [(8192, 4096)]
    else:
        assert replica.state is S.IN_SYNC and syncmap.settled and replica.last_resync is not None


def test_a_resync_that_ends_is_one_info_line_in_words(caplog: pytest.LogCaptureFixture) -> None:
    """A replica catching up is routine: the default level (warning) does not show it, and at
    info it reads as a sentence, not as a Python dict."""
    caplog.set_level(logging.INFO, logger="rpmemfs")
    replica = _replica(S.STALE)
    replica.lanes = [_Lane(lambda: None)]  # type: ignore[list-item]
    replica.region = object()  # type: ignore[assignment]
    rs = Barriers([replica], memoryview(bytearray(16384)), min_replicas=0,
                  syncmap=_Map())  # type: ignore[arg-type]

    assert trio.run(resync, rs, replica, lambda n: None)

    lines = [r for r in caplog.records if "resynced" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO], lines
    assert lines[0].getMessage() == ("replica 127.0.0.1:7000/pool resynced: 1 chunk sent (4.0 KiB, "
                                     "1.00x the bytes it missed) in 1 pass, "
                                     f"{replica.last_resync['seconds']:.3f} s")
