"""Polling for completions before sleeping on them, as an RDMA consumer polls its CQ.

A thread that sleeps until a reply arrives pays a wake-up; on a virtual machine whose idle
vCPUs halt that is about 100 us, more than a whole loopback barrier. So the initiator polls
its posted barriers for a short budget first (in C, without the GIL) and only then falls
back to trio's waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from rpmemfs.native import ffi, lib
from rpmemfs.transport.base import Ticket


def spin(tickets: Sequence[Ticket], budget_us: int, stop_fd: int = -1) -> int:
    """Poll until every ticket's completion is readable, ``budget_us`` passed or ``stop_fd``
    is readable (other work for this thread); how many are."""
    n = len(tickets)
    if not n or budget_us <= 0:
        return 0
    fds = ffi.new("int[]", [t.fd for t in tickets])
    want = ffi.new("uint32_t[]", [t.want for t in tickets])
    ready = ffi.new("uint8_t[]", n)
    return int(lib.rpm_spin_replies(fds, want, ready, n, budget_us, stop_fd))
