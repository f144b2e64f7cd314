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
yields the CPU first, and once other threads took a part of the poll's time on this CPU
(the wall time this thread's CPU clock did not see: yields taken, preemptions) the poll
ends and the next BACKOFF requests are served without one. Timing each yield, as before,
missed a program that runs a few microseconds and blocks in its next request: it is rarely
runnable at a yield but preempts the poller, so a loaded machine went on polling. The
target daemon's lanes judge their spin the same way (native/rpmem_lane.c).
"""

from __future__ import annotations

import os
import time

import trio
from trio.testing import wait_all_tasks_blocked

DEFAULT_POLL_US = 300
MAX_POLL_US = 1_000_000
# Requests served without polling after a poll gave way: a machine busy once is busy for a
# while, and every poll on it costs a time slice.
BACKOFF = 256
# A poll gives way once other threads had more than 1/STOLEN_PART of its time on this CPU,
# and at least STOLEN_MIN_S: a kernel worker's few microseconds do not count.
STOLEN_PART = 8
STOLEN_MIN_S = 20e-6


class RequestPoller:
    def __init__(self, budget_us: int) -> None:
        if not 0 <= budget_us <= MAX_POLL_US:
            raise ValueError(f"polling budget must be between 0 and {MAX_POLL_US} µs")
        self.budget_us = budget_us
        self._budget = budget_us / 1e6
        self._until = 0.0
        self._idle: trio.Event | None = None
        self._skip = 0  # requests still to serve without polling
        self.polls = 0  # scheduler passes spent polling, for status
        self.yielded = 0  # polls ended because another thread wanted the CPU

    def kick(self) -> None:
        """A request arrived: poll for the whole budget from now."""
        if self._skip:
            self._skip -= 1
        elif self._budget:
            self._until = time.perf_counter() + self._budget
            idle = self._idle
            if idle is not None:
                self._idle = None
                idle.set()

    async def run(self) -> None:
        """Poll while the budget lasts, sleep otherwise; runs until cancelled."""
        if not self._budget:
            return
        while True:
            idle = self._idle = trio.Event()
            await idle.wait()
            n = 0
            start, cpu = time.perf_counter(), time.thread_time()
            while time.perf_counter() < self._until:
                await wait_all_tasks_blocked()
                # Only an otherwise idle CPU is worth polling on: if other threads want it
                # (the program about to send the next request, a target daemon, anything),
                # they run now, and polling stops for a while.
                os.sched_yield()
                wall = time.perf_counter() - start
                stolen = wall - (time.thread_time() - cpu)
                if stolen > STOLEN_MIN_S and stolen * STOLEN_PART > wall:
                    self.yielded += 1
                    self._skip = BACKOFF
                    break
                n += 1
            self.polls += n
