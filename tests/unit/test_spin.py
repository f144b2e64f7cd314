"""Polling for replies (rpmemfs.transport.spin): what ends a spin."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from rpmemfs.transport.spin import spin


@dataclass
class _Ticket:
    fd: int
    want: int


def test_spin_ends_when_every_reply_is_readable() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, b, c, d:
        b.send(b"x" * 8)
        d.send(b"y" * 8)
        assert spin([_Ticket(a.fileno(), 8), _Ticket(c.fileno(), 8)], 60_000_000) == 2


def test_spin_counts_only_complete_replies_when_the_budget_runs_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.send(b"x" * 4)  # half a reply
        assert spin([_Ticket(a.fileno(), 8)], 1000) == 0


def test_spin_gives_way_when_the_stop_descriptor_turns_readable() -> None:
    """The mount passes /dev/fuse: a waiting request ends the spin, whose budget here (60 s)
    would otherwise hold the caller's thread for a minute."""
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        with a, b:
            os.write(w, b"!")
            t0 = time.monotonic()
            assert spin([_Ticket(a.fileno(), 8)], 60_000_000, stop_fd=r) == 0
            assert time.monotonic() - t0 < 30
            b.send(b"x" * 8)  # a reply that is there is still counted
            assert spin([_Ticket(a.fileno(), 8)], 60_000_000, stop_fd=r) == 1
    finally:
        os.close(r)
        os.close(w)
