"""One replica: its session, lanes and registered pool, its state, and its counters.

States: "connecting" until its first connection attempt ends; "in-sync" while it receives
every barrier; "stale" when it misses them (unreachable, or a barrier failed on it), with
what it misses marked in the pool's sync map; "resyncing" while it is sent what it missed.
Only in-sync replicas count for ``min_replicas``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import trio

from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import BytesLike, Lane, Method, RemoteRegion, Session, Ticket, TransportError

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
        self._free: deque[Lane] = deque()
        self._slots = trio.Semaphore(0)
        # Set whenever the replica falls out of sync: its keeper reconnects it.
        self.fell_behind = trio.Event()

    def attach(self, session: Session, region: RemoteRegion) -> None:
        """Take the session's lanes; the caller brings the replica in sync (see ReplicaSet)."""
        self.session = session
        self.region = region
        self.method = region.method
        self.lanes = list(session.lanes)
        self._free = deque(self.lanes)
        self._slots = trio.Semaphore(len(self.lanes))
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

    @asynccontextmanager
    async def lane(self) -> AsyncIterator[Lane]:
        """Borrow a lane nobody else is using; waits for one while all are busy.

        The least recently used lane comes first, so that sequential barriers take turns and
        every lane's connection is known to work before concurrency needs it.
        """
        async with self._slots:
            lane = self._free.popleft()
            try:
                yield lane
            finally:
                self._free.append(lane)

    async def barrier(self, writes: Sequence[tuple[int, BytesLike]], nbytes: int, timeout: float) -> bool:
        """One batch of writes and one flush on a free lane; False (and failed) on any error.

        True only if the replica is still in sync afterwards: when a concurrent barrier on
        another lane failed meanwhile, this one's bytes are on the target but the replica as
        a whole is stale, so it cannot count as an acknowledgement.
        """
        if self.state != "in-sync" or self.region is None:
            return False
        in_flight = False
        try:
            with trio.fail_after(timeout):
                async with self.lane() as lane:
                    if self.state != "in-sync":
                        return False
                    in_flight = True
                    await lane.barrier(self.region, writes, self.method)
                    in_flight = False
        except TransportError as exc:
            self.fail(str(exc))
            return False
        except trio.TooSlowError:
            self.fail(f"barrier not acknowledged within {timeout:g}s")
            return False
        except trio.Cancelled:
            # Cancelled mid-send, the lane's stream may hold half a frame: never reuse it.
            if in_flight:
                self.fail("barrier cancelled while in flight; the lane's state is unknown")
            raise
        self.barriers += 1
        self.writes += len(writes)
        self.flushes += 1
        self.bytes += nbytes
        return self.state == "in-sync"

    def post(self, writes: Sequence[tuple[int, BytesLike]], nbytes: int) -> Posted | None:
        """Post a barrier on a free lane without waiting.

        None when the replica is not in sync, posting failed (the replica is then failed), or
        every lane is busy (the replica is still in sync: use :meth:`barrier`).
        """
        if self.state != "in-sync" or self.region is None:
            return None
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            return None
        lane = self._free.popleft()
        try:
            ticket = lane.post_barrier(self.region, writes, self.method)
        except TransportError as exc:
            self._give_back(lane)
            self.fail(str(exc))
            return None
        return Posted(self, lane, ticket, len(writes), nbytes)

    def _give_back(self, lane: Lane) -> None:
        self._free.append(lane)
        self._slots.release()

    def _completed(self, posted: Posted) -> bool:
        self._give_back(posted.lane)
        self.barriers += 1
        self.writes += posted.writes
        self.flushes += 1
        self.bytes += posted.nbytes
        return self.state == "in-sync"

    def poll(self, posted: Posted) -> bool | None:
        """True when the barrier completed (and the replica is in sync), False when it failed,
        None while it is pending."""
        try:
            if not posted.lane.poll(posted.ticket):
                return None
        except TransportError as exc:
            self._give_back(posted.lane)
            self.fail(str(exc))
            return False
        return self._completed(posted)

    async def finish(self, posted: Posted, timeout: float) -> bool:
        """Wait for a posted barrier; like :meth:`barrier`, False (and failed) on any error."""
        try:
            with trio.fail_after(timeout):
                await posted.lane.wait(posted.ticket)
        except TransportError as exc:
            self._give_back(posted.lane)
            self.fail(str(exc))
            return False
        except trio.TooSlowError:
            self._give_back(posted.lane)
            self.fail(f"barrier not acknowledged within {timeout:g}s")
            return False
        except trio.Cancelled:
            self._give_back(posted.lane)
            self.fail("barrier cancelled while in flight; the lane's state is unknown")
            raise
        return self._completed(posted)

    def status(self) -> dict[str, Any]:
        return {
            "address": self.spec.address,
            "name": self.spec.name,
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
        self.lanes, self._free = [], deque()
        if session is None:
            return
        with trio.move_on_after(timeout) as scope:
            scope.shield = True
            try:
                await session.aclose()
            except (TransportError, OSError):
                pass  # the session is gone either way
