"""Which connections a target takes, before and after they authenticate.

Anyone who reaches the port can open connections, so connections that have not authenticated
yet are capped apart from the rest, in total and per peer address, and each has a short
handshake deadline (server.py). The caps must never starve a client that holds the token:

- A connection over the per-peer cap pushes out that peer's own oldest handshake, never
  another peer's, so one peer's flood costs only itself.
- A connection over the total cap pushes out the oldest handshake of the peers with the most
  handshakes open. A client's handshake takes a round trip or two; to push it out, a flood
  must hold as many handshakes open as the client from more addresses than the cap, and
  renew all of them within the client's round trip (an old handshake is an idle one: a
  client that holds the token finishes in milliseconds).
- Authenticated connections are counted apart (``max_connections``), and a handshake
  slot is given back the moment its connection authenticates.

The newest connection is always let in to try (as OpenSSH's MaxStartups drops early): a
legitimate client retrying gets its chance, while old idle handshakes are what is dropped.

Failed proofs are throttled per peer address (``FailedProofs``): the target answers a failed
proof only after a delay that doubles with each recent failure from that address (up to
``MAX_FAILURE_DELAY``), holding the handshake slot meanwhile. With the per-peer cap, a peer
learns at most ``max_per_peer / MAX_FAILURE_DELAY`` guesses a second, and a newer connection
pushing out a waiting one loses that guess's answer. A client that holds the token is never
delayed, even from an address that fails often (loopback is shared by every local user).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

log = logging.getLogger("rpmemfs.target.admission")

DEFAULT_MAX_HANDSHAKES = 64
DEFAULT_MAX_HANDSHAKES_PER_PEER = 8
MAX_HANDSHAKE_TIMEOUT = 2.0
DROP_LOG_INTERVAL = 10.0  # seconds between lines about connections pushed out
FIRST_FAILURE_DELAY = 0.05
MAX_FAILURE_DELAY = 1.5  # below the handshake deadline, so the peer hears why
FAILURE_MEMORY = 60.0  # seconds after a peer's last failure that it is forgotten
MAX_FAILING_PEERS = 4096  # addresses remembered; the longest quiet is forgotten first


class FailedProofs:
    """Recent failed proofs per peer address, and the delay before answering the next one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._peers: dict[str, tuple[int, float]] = {}  # peer -> (failures, time of the last)
        self.total = 0

    def failed(self, peer: str) -> float:
        """Count a failure from ``peer``; the seconds to wait before telling it."""
        now = self._clock()
        count, last = self._peers.pop(peer, (0, now))
        if now - last > FAILURE_MEMORY:
            count = 0
        count += 1
        self._peers[peer] = (count, now)  # re-inserted: dict order is least recent first
        if len(self._peers) > MAX_FAILING_PEERS:
            del self._peers[next(iter(self._peers))]
        self.total += 1
        return float(min(FIRST_FAILURE_DELAY * 2.0 ** (count - 1), MAX_FAILURE_DELAY))


@dataclass(eq=False)
class Handshake:
    """One connection that has not authenticated yet."""

    peer: str  # the peer's address (host only: a port is the peer's to choose)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: float = field(default_factory=time.monotonic)
    dropped: bool = False  # pushed out by a newer connection


class Admission:
    def __init__(self, max_connections: int, max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
                 max_per_peer: int = DEFAULT_MAX_HANDSHAKES_PER_PEER) -> None:
        if max_connections < 1 or max_handshakes < 1 or max_per_peer < 1:
            raise ValueError("connection caps must be at least 1")
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.max_per_peer = max_per_peer
        self.authenticated = 0
        self._open: dict[str, list[Handshake]] = {}  # peer -> its handshakes, oldest first
        self._count = 0
        self.dropped = 0  # handshakes pushed out, since start
        self._dropped_logged = 0
        self._last_log = 0.0

    @property
    def handshakes(self) -> int:
        return self._count

    def begin(self, peer: str) -> Handshake | None:
        """A new connection from ``peer`` starts its handshake: its slot, pushing out an older
        handshake where a cap is reached; None when authenticated connections are at their
        cap (then nothing a handshake could win is left)."""
        if self.authenticated >= self.max_connections:
            return None
        mine = self._open.get(peer, [])
        if len(mine) >= self.max_per_peer:
            self._drop(mine[0])
        elif self._count >= self.max_handshakes:
            most = max(len(v) for v in self._open.values())
            self._drop(min((v[0] for v in self._open.values() if len(v) == most),
                           key=lambda h: h.started))
        hs = Handshake(peer)
        self._open.setdefault(peer, []).append(hs)
        self._count += 1
        return hs

    def authenticate(self, hs: Handshake) -> bool:
        """The handshake succeeded: its slot goes back, and the connection counts as
        authenticated; False when authenticated connections are at their cap."""
        self._forget(hs)
        if self.authenticated >= self.max_connections:
            return False
        self.authenticated += 1
        return True

    def end_handshake(self, hs: Handshake) -> None:
        """The handshake failed, timed out, or its peer left."""
        self._forget(hs)

    def end_authenticated(self) -> None:
        self.authenticated -= 1

    def _drop(self, hs: Handshake) -> None:
        hs.dropped = True
        hs.scope.cancel()
        self._forget(hs)
        self.dropped += 1
        now = time.monotonic()
        if now - self._last_log >= DROP_LOG_INTERVAL:
            log.warning("unauthenticated connections over the cap (%d in total, %d per peer): "
                        "%d oldest handshakes closed since the last report, the latest from %s",
                        self.max_handshakes, self.max_per_peer, self.dropped - self._dropped_logged,
                        hs.peer)
            self._dropped_logged = self.dropped
            self._last_log = now

    def _forget(self, hs: Handshake) -> None:
        mine = self._open.get(hs.peer)
        if mine is None or hs not in mine:
            return
        mine.remove(hs)
        self._count -= 1
        if not mine:
            del self._open[hs.peer]
