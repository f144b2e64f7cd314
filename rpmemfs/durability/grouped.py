"""Durability points for callers that are answered later, not awaited: the FUSE fsyncs.

Why: with replicas a point waits a network round trip. Awaited, as every other caller of
:meth:`Durability.point` does, each fsync held a task of its own (pyfuse3's reader of
/dev/fuse), parked it and woke it once or twice per point, and went through the group
commit's bookkeeping one fsync at a time: most of the Python the primary spent per replicated
fsync. Here an fsync is one entry in a list (:meth:`GroupedPoints.ask`, called from the request
handler itself), and one task runs a point for every fsync asked for before it began, then
answers them all: the group commit of point.py with no task per fsync.

Correctness is the point's: a point takes the filesystem's changes after it begins, and every
fsync of the group was asked for before that, after the writes it covers had returned (writes
are answered only once their data is in the pool). A point that fails fails its whole group,
as a pipelined point fails those behind it.

Grouping is for callers that come together: :meth:`GroupedPoints.offer` declines a caller
alone (no caller came while a point was in flight in the last GROUPING_S), whose point is
better started at once by the caller itself; the hand-over to the group's task would only
delay it.

While barriers come back quickly (:meth:`Durability.quick`) one point runs at a time: fsyncs
asked for meanwhile form the next group. Over a slow link each group's point starts at once,
behind those in flight (point.py pipelines them), so that an fsync costs one round trip,
not up to two.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Generic, TypeVar

import trio

from rpmemfs.durability.point import Durability, DurabilityError

log = logging.getLogger("rpmemfs.durability")

W = TypeVar("W")

# After a caller came while a point was in flight, callers are grouped for this long even when
# none is in flight: programs fsyncing concurrently come in waves.
GROUPING_S = 0.05
_clock = time.perf_counter  # (a test's stand-in replaces it)


class GroupedPoints(Generic[W]):
    """Points for callers of type ``W`` that ``answer(caller, error)`` tells how theirs ended
    (error None: durable). ``held`` is entered around each point (the mount's /dev/fuse
    poller: no polling while a point waits)."""

    def __init__(self, durability: Durability, answer: Callable[[W, BaseException | None], None],
                 held: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self._durability = durability
        self._answer = answer
        self._held = held
        self._asked: list[tuple[W, int]] = []  # (caller, when asked: ns), not in a point yet
        self._wake: trio.Event | None = None  # set when the runner sleeps for want of work
        self._serving = 0  # groups whose point runs now
        self._idle = trio.Event()
        self._idle.set()
        self._grouping_until = 0.0  # _clock(): callers came during points until then
        self.asked = 0  # callers asked for a point here, for status
        self.groups = 0  # points run for them

    def offer(self, caller: W) -> bool:
        """:meth:`ask` for ``caller`` where a group may form; False, with nothing asked, for a
        caller alone (see the module's text)."""
        now = _clock()
        if self._durability.in_flight():
            self._grouping_until = now + GROUPING_S
        elif now >= self._grouping_until:
            return False
        self.ask(caller)
        return True

    def ask(self, caller: W) -> None:
        """A point for ``caller``, answered once it ended; never blocks (trio thread only)."""
        self._asked.append((caller, time.perf_counter_ns()))
        self.asked += 1
        if self._idle.is_set():
            self._idle = trio.Event()
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    async def run(self) -> None:
        """Serve groups until cancelled; a group already in its point is answered first."""
        async with trio.open_nursery() as nursery:
            while True:
                if not self._asked:
                    wake = self._wake = trio.Event()
                    await wake.wait()
                group, self._asked = self._asked, []
                self._serving += 1
                if self._durability.quick():
                    await self._serve(group)
                else:
                    nursery.start_soon(self._serve, group)

    async def _serve(self, group: list[tuple[W, int]]) -> None:
        error: BaseException | None = None
        try:
            # Shielded: a point cancelled in flight fails its replicas for nothing; it is
            # bounded by replica_timeout, and the mount's final point follows.
            with trio.CancelScope(shield=True), self._held():
                await self._durability.point(timed=False)
        except Exception as e:  # DurabilityError (logged by the point), or a bug
            if not isinstance(e, DurabilityError):
                log.exception("internal error in a grouped durability point")
            error = e
        finally:
            self.groups += 1
            stats = self._durability.stats
            now = time.perf_counter_ns()
            for caller, asked in group:
                stats.add(now - asked)
                try:
                    self._answer(caller, error)
                except Exception:
                    log.exception("answering an fsync")
            self._serving -= 1
            if not self._serving and not self._asked:
                self._idle.set()

    async def answered(self) -> None:
        """Wait until every caller asked so far was answered (the mount is ending)."""
        while not self._idle.is_set():
            await self._idle.wait()

