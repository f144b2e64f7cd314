"""One replica: its session, lanes and registered pool, its state, and its counters.

States: "connecting" until its first connection attempt ends; "in-sync" while it receives
every barrier; "stale" when it misses them (unreachable, or a barrier failed on it), with
what it misses marked in the pool's sync map; "resyncing" while it is sent what it missed.
Only in-sync replicas count for ``min_replicas``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import trio

from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import Lane, LocalPool, Method, RemoteRegion, Session, Ticket, TransportError

State = Literal["connecting", "in-sync", "stale", "resyncing"]


@dataclass(slots=True)
class Posted:
    """A barrier posted to one replica on one of its lanes, not yet known to be complete."""

    replica: Replica
    lane: Lane
    ticket: Ticket
    writes: int
    nbytes: int


class Replica:
    """A replica pool on a target, as the initiator sees it."""

    def __init__(self, spec: ReplicaSpec, slot: int = 0) -> None:
        self.spec = spec
        self.slot = slot  # its bitmap in the pool's sync map
        self.session: Session | None = None
        self.lanes: list[Lane] = []
        self.region: RemoteRegion | None = None
        self.state: State = "connecting"
        self.method: Method | None = None
        self.barriers = 0
        self.writes = 0
        self.flushes = 0
        self.bytes = 0
        self.last_error: str | None = None
        self.resyncs = 0
        self.resync: dict[str, Any] | None = None  # progress of the resync under way
        self.last_resync: dict[str, Any] | None = None  # summary of the last one
        # Set whenever the replica falls out of sync: its keeper reconnects it.
        self.fell_behind = trio.Event()

    def attach(self, session: Session, region: RemoteRegion) -> None:
        """Take the session's lanes; the caller brings the replica in sync (see ReplicaSet)."""
        self.session = session
        self.region = region
        self.method = region.method
        self.lanes = list(session.lanes)
        if not self.lanes:
            self.fail("the session has no lanes")

    def fail(self, reason: str) -> None:
        """The replica misses writes from now on (its keeper will reconnect it)."""
        # The first error is the cause; later ones are usually its echoes on other lanes.
        if self.state != "stale":
            self.state = "stale"
            self.note(reason)
            self.fell_behind.set()

    def note(self, reason: str) -> None:
        self.last_error = reason if reason.startswith("replica ") else f"replica {self.spec}: {reason}"

    def joined(self) -> None:
        """In sync again: every barrier from now on reaches it."""
        self.state = "in-sync"
        self.fell_behind = trio.Event()

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
        if self.state != "in-sync" or self.region is None or not self.lanes:
            return None
        lane = self.barrier_lane
        try:
            ticket = lane.post_barrier_local(self.region, local, ranges, self.method)
        except TransportError as exc:
            self.fail(str(exc))
            return None
        return Posted(self, lane, ticket, len(ranges), nbytes)

    def _completed(self, posted: Posted) -> bool:
        self.barriers += 1
        self.writes += posted.writes
        self.flushes += 1
        self.bytes += posted.nbytes
        # Not an acknowledgement if the replica fell out of sync meanwhile (an earlier
        # barrier on the lane failed): its bytes may be there, but not all before them.
        return self.state == "in-sync"

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

    async def finish(self, posted: Posted, timeout: float) -> bool:
        """Wait for a posted barrier; like :meth:`barrier`, False (and failed) on any error."""
        try:
            with trio.fail_after(timeout):
                await posted.lane.wait(posted.ticket)
        except TransportError as exc:
            self.fail(str(exc))
            return False
        except trio.TooSlowError:
            self.fail(f"barrier not acknowledged within {timeout:g}s")
            return False
        except trio.Cancelled:
            self.fail("barrier cancelled while in flight; the lane's state is unknown")
            raise
        return self._completed(posted)

    def status(self) -> dict[str, Any]:
        return {
            "address": self.spec.address,
            "name": self.spec.name,
            # What this connection uses (for "auto", what was picked), else what was asked.
            "transport": (self.session.info.get("transport", "tcp") if self.session is not None
                          else self.spec.transport),
            "state": self.state,
            "method": self.method,
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
