"""Waiting for the machine to go quiet before measuring.

Every daemon the bench starts maps its pool in with a background thread (pmem.populate: on a
fresh pool on tmpfs that allocates and zeroes every page), and a replicated target starts
three of them. Measured straight away, the first rounds ran beside gigabytes of page faults:
seq_write with 2 replicas read 212 MB/s in round 1 and 380-550 after, which is how the
issue's "0.15 to 0.96 between runs" came about. So after bringing the targets up the bench
waits until the machine is mostly idle, for a bounded time (a machine others share may never
be).
"""

from __future__ import annotations

import time

from rpmemfs.tools.bench.cpu import idle_share, sample

IDLE = 0.8  # the fraction of all CPUs' time spent idle that counts as quiet
WINDOW = 0.25  # seconds per look
TIMEOUT = 30.0


def idle_fraction(seconds: float) -> float:
    """The fraction of the machine's CPU time spent idle over the next ``seconds``."""
    before = sample()
    time.sleep(seconds)
    return idle_share(before, sample())


def wait_until_quiet(idle: float = IDLE, window: float = WINDOW, timeout: float = TIMEOUT) -> float | None:
    """Seconds it took until one window was at least ``idle`` idle; None if none was within
    ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if idle_fraction(window) >= idle:
            return time.monotonic() - start
    return None
