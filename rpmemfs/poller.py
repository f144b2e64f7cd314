"""Keeps the mount daemon's thread awake for a short while after each FUSE request.

Why: a FUSE request is a hand-off between two threads, and on virtual machines (ours: idle
vCPUs halt, guest halt polling off) waking a thread that slept in epoll costs about as much
as everything the daemon does for a 4 KiB write. A program issuing durability points
back to back (write, fsync, write, fsync ...) sends its next request within microseconds,
so polling for a budget after each request catches it without a wake-up. This is the same
trade the target daemon makes with its lanes' polling budget (``--spin-us``): CPU time
while requests arrive, nothing while idle.

How: one trio task that, while the budget lasts, yields to the scheduler in a loop. A
runnable task makes trio poll its I/O with a zero timeout instead of sleeping in
epoll_wait, so pyfuse3's reader (which waits on /dev/fuse through trio) is woken by the
scheduler itself. pyfuse3 is not touched.

Only an idle loop polls: each pass waits until every other task is blocked
(trio.testing.wait_all_tasks_blocked, which the scheduler answers after an epoll_wait with
a zero timeout found nothing to do). While requests keep the loop busy (several programs
fsyncing at once) the poller is not scheduled at all; before this, its passes took a quarter
of a busy daemon's time (sched_yield between every batch of requests, measured at 4 jobs).

On a busy machine polling would take CPU time from the very threads a request waits for
(on our 2-core machines: the program, the target daemons, the kernel's work), so every pass
yields the CPU first, and once another thread ran on this CPU meanwhile (this thread's
involuntary context switches: a yield taken, or a preemption) the poll ends; after GIVEN
polls in a row ended so, there is no polling for BACKOFF_S (a kernel worker now and then
ends one poll, a program that wants the CPU ends them all). Timing each yield,
as before, missed a program that runs a few microseconds and blocks in its next request:
it is rarely runnable at a yield but preempts the poller, so a loaded machine went on
polling. The target daemon's lanes judge their spin the same way (native/rpmem_lane.c says
why not by CPU time).

No polling while a durability point waits (:meth:`RequestPoller.held`, around every point the
FUSE edge asks for): with replicas the wait is a network round trip, and polling through it
spent the primary's CPU on what a wake-up costs less, and on shared cores took time from the
target daemons the point waits for. The point's end starts a whole budget again, for the
program's next request. Measured with 2 replicas (bench concurrent_fsync, two runs, daemon CPU
per write + fsync): 4 writers 147.5 -> 137.0 and 189 -> 153 µs, 16 writers 100 -> 94 and
190 -> 115 µs, IOPS up with it; 1 writer within noise (372 -> 336, 291 -> 385).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio
from trio.testing import wait_all_tasks_blocked

DEFAULT_POLL_US = 300
MAX_POLL_US = 1_000_000
# No polling for BACKOFF_S after GIVEN polls in a row gave way: a machine that busy stays
# busy for a while (the target's lanes use the same numbers).
GIVEN = 2
BACKOFF_S = 0.05


def involuntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class RequestPoller:
    def __init__(self, budget_us: int) -> None:
        if not 0 <= budget_us <= MAX_POLL_US:
            raise ValueError(f"polling budget must be between 0 and {MAX_POLL_US} µs")
        self.budget_us = budget_us
        self._budget = budget_us / 1e6
        self._until = 0.0
        self._idle: trio.Event | None = None
        self._quiet_until = 0.0  # no polling before this (time.perf_counter())
        self._given = 0  # polls in a row that gave way
        self.polls = 0  # scheduler passes spent polling, for status
        self.yielded = 0  # polls ended because another thread wanted the CPU
        self._held = 0  # durability points waiting now: no polling meanwhile

    def kick(self) -> None:
        """A request arrived: poll for the whole budget from now."""
        if self._budget and (now := time.perf_counter()) >= self._quiet_until:
            self._until = now + self._budget
            idle = self._idle
            if idle is not None:
                self._idle = None
                idle.set()

    @contextmanager
    def held(self) -> Iterator[None]:
        """No polling while the block runs (a durability point waiting); a whole budget after."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            self.kick()

    async def run(self) -> None:
        """Poll while the budget lasts, sleep otherwise; runs until cancelled."""
        if not self._budget:
            return
        while True:
            idle = self._idle = trio.Event()
            await idle.wait()
            n = 0
            switches = involuntary_switches()
            while not self._held and time.perf_counter() < self._until:
                await wait_all_tasks_blocked()
                # Only an otherwise idle CPU is worth polling on: if other threads want it
                # (the program about to send the next request, a target daemon, anything),
                # they run now, and polling stops for a while.
                os.sched_yield()
                if involuntary_switches() != switches:
                    self.yielded += 1
                    self._given += 1
                    if self._given >= GIVEN:
                        self._given, self._quiet_until = 0, time.perf_counter() + BACKOFF_S
                    break
                n += 1
            else:
                self._given = 0
            self.polls += n
