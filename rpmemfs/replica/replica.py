"""One replica: its session, lanes and registered pool, its state, and its counters.

The states and the moves between them are written once, in TRANSITIONS, and every change of
state goes through :meth:`Replica.move`, which refuses any other move.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import trio

from rpmemfs.latency import Histogram
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import (
    BytesLike,
    Flush,
    Lane,
    LocalPool,
    LocalRanges,
    Method,
    PackedRanges,
    RemoteRegion,
    Session,
    Ticket,
    TransportError,
    declared,
)


class ReplicaState(StrEnum):
    """Where a replica stands; the values are what status and the CLI show.

    Only in-sync replicas receive barriers and count for ``min_replicas``.
    """

    CONNECTING = "connecting"  # until its first connection attempt ends
    IN_SYNC = "in-sync"  # it receives every barrier
    STALE = "stale"  # it misses barriers (unreachable, or one failed on it): the sync map has which
    RESYNCING = "resyncing"  # it is being sent what it missed


# Module-level names for the members: the barrier path compares states several times per
# barrier, and looking a member up on its class costs ~50 ns in Python 3.11, a global ~5.
CONNECTING = ReplicaState.CONNECTING
IN_SYNC = ReplicaState.IN_SYNC
STALE = ReplicaState.STALE
RESYNCING = ReplicaState.RESYNCING

# Every move a replica's state may make, and the only place they are written. A replica
# reaches in-sync only through a resync (even one that finds nothing to send), and nothing
# makes it "connecting" again.
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    CONNECTING: frozenset({STALE, RESYNCING}),  # its first connection failed, or succeeded
    STALE: frozenset({RESYNCING}),  # its keeper reconnected it
    RESYNCING: frozenset({IN_SYNC, STALE}),  # the resync ended, or failed
    IN_SYNC: frozenset({STALE}),  # a barrier or a live repair failed on it
}


class TransitionError(RuntimeError):
    """A move of a replica's state that TRANSITIONS does not allow: a bug, not a fault."""


# Why a replica whose barrier's wait was cancelled is failed: the lane may hold half of it.
CANCELLED_IN_FLIGHT = "barrier cancelled while in flight; the lane's state is unknown"


@dataclass(slots=True)
class Posted:
    """A barrier posted to one replica on one of its lanes, not yet known to be complete."""

    replica: Replica
    lane: Lane
    ticket: Ticket
    writes: int
    nbytes: int
    started: int  # perf_counter_ns when posted


class Replica:
    """A replica pool on a target, as the initiator sees it."""

    def __init__(self, spec: ReplicaSpec, slot: int = 0) -> None:
        self.spec = spec
        self.slot = slot  # its bitmap in the pool's sync map
        self.session: Session | None = None
        self.lanes: list[Lane] = []
        self.region: RemoteRegion | None = None
        self.state: ReplicaState = CONNECTING  # changed only by move()
        self.method: Method | None = None
        self.flush: Flush | None = None  # what its barriers end with (status and metrics say)
        self.barriers = 0
        self.writes = 0
        self.flushes = 0
        self.bytes = 0
        # What keeps it out of sync, and when that was seen (ISO 8601, UTC); both cleared
        # once it is in sync again (its keeper logs what it cleared).
        self.last_error: str | None = None
        self.last_error_at: str | None = None
        self.resyncs = 0
        self.resync: dict[str, Any] | None = None  # progress of the resync under way
        self.last_resync: dict[str, Any] | None = None  # summary of the last one
        # Whether its target records a resync of it that has not ended (begun by this mount,
        # or by one killed during it): cleared on the target once it is in sync.
        self.resync_marked = False
        self.latency = Histogram()  # of its barriers, post to acknowledgement
        # When it last left in-sync (or was created): how long it has been behind.
        self.behind_since: float | None = time.time()
        self.claimed = False  # its session claimed the pool (only a claimant may mark a resync)
        # Who holds it, as its target said at the last attempt, when another primary claimed it
        # since this mount's epoch (a failover): this mount is fenced from it.
        self.taken_over: str | None = None
        # Set whenever the replica falls out of sync: its keeper reconnects it.
        self.fell_behind = trio.Event()
        # Times it joined: an asynchronous sender that served it before it fell behind must
        # not serve it again after it rejoined (the resync sent it newer bytes meanwhile).
        self.joins = 0

    def attach(self, session: Session, region: RemoteRegion) -> None:
        """Take the session's lanes; the caller brings the replica in sync (see ReplicaSet)."""
        self.session = session
        self.region = region
        self.method = region.method
        self.flush = region.flush
        self.lanes = list(session.lanes)
        if not self.lanes:
            self.fail("the session has no lanes")

    def move(self, to: ReplicaState) -> None:
        """Change state; TransitionError if TRANSITIONS does not allow the move."""
        if to not in TRANSITIONS[self.state]:
            raise TransitionError(f"replica {self.spec}: no move from {self.state} to {to}")
        self.state = to

    def fail(self, reason: str) -> None:
        """The replica misses writes from now on (its keeper will reconnect it)."""
        # The first error is the cause; later ones are usually its echoes on other lanes, so
        # failing a stale replica changes nothing (and is no move of its state).
        if self.state is not STALE:
            if self.state is IN_SYNC:
                self.behind_since = time.time()
            self.move(STALE)
            self.note(reason)
            self.fell_behind.set()

    def note(self, reason: str) -> None:
        self.last_error = reason if reason.startswith("replica ") else f"replica {self.spec}: {reason}"
        self.last_error_at = datetime.now(UTC).isoformat(timespec="milliseconds")

    def joined(self) -> None:
        """In sync again (its resync is done): every barrier from now on reaches it."""
        self.move(IN_SYNC)
        self.joins += 1
        self.behind_since = None
        self.fell_behind = trio.Event()
        self.last_error = self.last_error_at = None

    @property
    def barrier_lane(self) -> Lane:
        """The one lane barriers go on, one after another without waiting for each other.

        One ordered lane, not one per concurrent fsync: writes on different lanes are not
        ordered against each other (as with RDMA queue pairs), so a crash of this node could
        leave a replica with a later barrier's log records but not an earlier one's, a log
        no mount would accept. On one lane a replica always holds a prefix of the barriers.
        """
        return self.lanes[0]

    @property
    def bulk_lane(self) -> Lane:
        """The lane resync and repair copies go on (the last one), beside the barriers."""
        return self.lanes[-1]

    def post(self, local: LocalPool, ranges: Sequence[tuple[int, int]], nbytes: int) -> Posted | None:
        """Post a barrier of ``ranges`` of the local pool on the barrier lane without waiting
        (earlier ones may still be in flight there). None when the replica is not in sync, or
        posting failed (the replica is then stale)."""
        if self.state is not IN_SYNC or self.region is None or not self.lanes:
            return None
        lane = self.barrier_lane
        try:
            ticket = lane.post(self.region, LocalRanges(local, ranges), self.method)
        except TransportError as exc:
            self.fail(str(exc))
            return None
        return Posted(self, lane, ticket, len(ranges), nbytes, time.perf_counter_ns())

    def post_copies(self, data: BytesLike, ranges: Sequence[tuple[int, int]]) -> Posted | None:
        """:meth:`post` of bytes copied from the local pool at a durability point (asynchronous
        replication sends them after the mapping moved on): the ranges' bytes back to back
        in ``data``, each range to its own offset."""
        if self.state is not IN_SYNC or self.region is None or not self.lanes:
            return None
        lane = self.barrier_lane
        try:
            ticket = lane.post(self.region, PackedRanges(data, ranges), self.method)
        except TransportError as exc:
            self.fail(str(exc))
            return None
        return Posted(self, lane, ticket, len(ranges), len(data), time.perf_counter_ns())

    def _completed(self, posted: Posted) -> bool:
        self.latency.observe_ns(time.perf_counter_ns() - posted.started)
        self.barriers += 1
        self.writes += posted.writes
        self.flushes += 1
        self.bytes += posted.nbytes
        # Not an acknowledgement if the replica fell out of sync meanwhile (an earlier
        # barrier on the lane failed): its bytes may be there, but not all before them.
        return self.state is IN_SYNC

    def poll(self, posted: Posted) -> bool | None:
        """True when the barrier completed (and the replica is in sync), False when it failed,
        None while it is pending."""
        try:
            if not posted.lane.poll(posted.ticket):
                return None
        except TransportError as exc:
            self.fail(str(exc))
            return False
        return self._completed(posted)

    async def finish(self, posted: Posted, timeout: float, deadline: float | None = None) -> bool:
        """Wait for a posted barrier until ``timeout`` seconds from now, or until ``deadline``
        (trio's clock) when given; like :meth:`barrier`, False (and failed) on any error."""
        # A bare cancel scope, not fail_after: on this path, which a loaded mount runs twice
        # per fsync, fail_after's context manager costs twice the scope itself.
        if deadline is None:
            deadline = trio.current_time() + timeout
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                try:
                    await posted.lane.wait(posted.ticket)
                except TransportError as exc:
                    self.fail(str(exc))
                    return False
        except trio.Cancelled:
            # Not this deadline's (the scope would have caught that): the caller is cancelled.
            self.fail(CANCELLED_IN_FLIGHT)
            raise
        if scope.cancelled_caught:
            self.fail(f"barrier not acknowledged within {timeout:g}s")
            return False
        return self._completed(posted)

    def status(self) -> dict[str, Any]:
        return {
            "address": self.spec.address,
            "name": self.spec.name,
            # What this connection uses (for "auto", what was picked), else what was asked.
            "transport": (self.session.info.get("transport", "tcp") if self.session is not None
                          else self.spec.transport),
            "state": self.state.value,
            # What the target declared: its barriers' native FLUSH (method "flush" inside the
            # transport) is how apm is kept, and "flush" says which one ends them.
            "method": declared(self.method),
            "flush": self.flush,
            "lanes": len(self.lanes),
            "slot": self.slot,
            "resyncs": self.resyncs,
            "resync": self.resync,
            "last_resync": self.last_resync,
            "barriers": self.barriers,
            "writes": self.writes,
            "flushes": self.flushes,
            "bytes": self.bytes,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "behind_since": self.behind_since,
        }

    async def aclose(self, timeout: float) -> None:
        """Close the session; a dead or slow target cannot hold this up past ``timeout``."""
        session, self.session = self.session, None
        self.region = None
        self.lanes = []
        if session is None:
            return
        with trio.move_on_after(timeout) as scope:
            scope.shield = True
            try:
                await session.aclose()
            except (TransportError, OSError):
                pass  # the session is gone either way
