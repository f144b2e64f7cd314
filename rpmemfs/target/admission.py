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

Authenticated connections are shared between tenants (``Connection``, ``Admission.authenticate``),
so that none can lock out another:

- Each token (by name: the tokens of one file or authz line, a rotation's old and new alike)
  holds at most its own cap of connections, lanes included (``connections=`` on its authz
  line; else ``--max-connections-per-token`` for a pools token, none for an admin token).
- Pools tokens together hold at most ``max_connections - admin_reserve``: the rest is kept
  for admin tokens (the administrator, and the cluster's own mounts).
- Where a cap is reached, the newcomer pushes out the oldest connection that holds nothing:
  a control connection whose session has no pool open and that waits for a request. It is
  taken from the newcomer's own token first (over its cap), else from the pools token with
  the most connections. A connection whose session holds a pool is never pushed out, so the
  owner of a pool gets back in as long as anyone holds a connection for nothing.

Failed proofs are throttled (``FailedProofs``) per peer address, per key id (the token the
HELLO names; every unknown key id counts as one) and in all: the target answers a failed
proof only after a delay that doubles with each recent failure from that address or for that
key id (up to ``MAX_FAILURE_DELAY``), and after ``MAX_FAILURE_DELAY`` whenever more than
``GLOBAL_FAILURE_BURST`` failed at once beyond ``GLOBAL_FAILURE_RATE`` a second, holding the
handshake slot meanwhile. So a peer is answered at most ``max_per_peer / MAX_FAILURE_DELAY``
times a second, and all peers together, whatever their addresses and key ids, at most
``GLOBAL_FAILURE_RATE + max_handshakes / MAX_FAILURE_DELAY``; a newer connection pushing out
a waiting one loses that guess's answer. A client that holds the token is never delayed,
whatever its address, its token or anyone else has failed (loopback is shared by every
local user).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
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
MAX_FAILING_PEERS = 4096  # addresses (and key ids) remembered; the longest quiet is forgotten first
# Failed proofs a second, over every address and key id, that a target answers with no more
# than their own delays; beyond a burst of GLOBAL_FAILURE_BURST, each waits MAX_FAILURE_DELAY.
GLOBAL_FAILURE_RATE = 5.0
GLOBAL_FAILURE_BURST = 10
UNKNOWN_KEY = b""  # what every key id the target does not know counts as
DEFAULT_MAX_PER_TOKEN = 64  # authenticated connections of one pools token
DEFAULT_ADMIN_RESERVE = 64  # of --max-connections, kept for admin tokens
DEFAULT_EMPTY_SESSION_TIMEOUT = 60.0  # idle control connections holding no pool are closed


class _Recent:
    """Recent failures per key (an address, a key id), in a bounded memory."""

    def __init__(self) -> None:
        self._by: dict[object, tuple[int, float]] = {}  # key -> (failures, time of the last)

    def __len__(self) -> int:
        return len(self._by)

    def __contains__(self, key: object) -> bool:
        return key in self._by

    def count(self, key: object, now: float) -> int:
        """Count a failure for ``key``; how many it has had lately, this one included."""
        count, last = self._by.pop(key, (0, now))
        if now - last > FAILURE_MEMORY:
            count = 0
        count += 1
        self._by[key] = (count, now)  # re-inserted: dict order is least recent first
        if len(self._by) > MAX_FAILING_PEERS:
            del self._by[next(iter(self._by))]
        return count


class FailedProofs:
    """Recent failed proofs per peer address, per key id and in all, and the delay before
    answering the next one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._peers = _Recent()
        self._keys = _Recent()
        # A leaky bucket: failures in, GLOBAL_FAILURE_RATE a second out. Kept no fuller than
        # twice the burst, so that answers are quick again within seconds of a flood's end.
        self._level = 0.0
        self._level_at = clock()
        self.total = 0

    def failed(self, peer: str, key: bytes | None) -> float:
        """Count a failure from ``peer`` proving the token of key id ``key`` (None: one the
        target does not know); the seconds to wait before telling it."""
        now = self._clock()
        count = max(self._peers.count(peer, now), self._keys.count(key or UNKNOWN_KEY, now))
        drained = (now - self._level_at) * GLOBAL_FAILURE_RATE
        self._level = min(max(0.0, self._level - drained) + 1, 2.0 * GLOBAL_FAILURE_BURST)
        self._level_at = now
        self.total += 1
        if self._level > GLOBAL_FAILURE_BURST:
            return MAX_FAILURE_DELAY
        return float(min(FIRST_FAILURE_DELAY * 2.0 ** (count - 1), MAX_FAILURE_DELAY))


@dataclass(eq=False)
class Handshake:
    """One connection that has not authenticated yet."""

    peer: str  # the peer's address (host only: a port is the peer's to choose)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: float = field(default_factory=time.monotonic)
    dropped: bool = False  # pushed out by a newer connection


def _never() -> bool:
    return False


@dataclass(eq=False)
class Connection:
    """One authenticated connection."""

    token: str  # the name of the token it proved (a lane: its session's)
    admin: bool
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    # Whether it holds nothing now (its session has no pool open, and it waits for a
    # request): then it may be closed to make room. Set by the server once it serves.
    idle_and_empty: Callable[[], bool] = _never
    dropped: bool = False  # pushed out by a newer connection


class Full(Exception):
    """No room for an authenticated connection; the message says which cap and what to do."""


class Admission:
    def __init__(self, max_connections: int, max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
                 max_per_peer: int = DEFAULT_MAX_HANDSHAKES_PER_PEER, *,
                 max_per_token: int = DEFAULT_MAX_PER_TOKEN, admin_reserve: int = 0) -> None:
        if min(max_connections, max_handshakes, max_per_peer, max_per_token) < 1:
            raise ValueError("connection caps must be at least 1")
        if not 0 <= admin_reserve < max_connections:
            raise ValueError("the admin reserve must be below the connection cap")
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.max_per_peer = max_per_peer
        self.max_per_token = max_per_token
        self.admin_reserve = admin_reserve
        self.authenticated = 0
        self._tokens: dict[str, list[Connection]] = {}  # token -> its connections, oldest first
        self.pushed_out = 0  # authenticated connections closed to make room, since start
        self.last_pushed_out = ""  # the token of the latest
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
        cap and none of them holds nothing (then nothing a handshake could win is left)."""
        if self.authenticated >= self.max_connections and self._expendable(self._all()) is None:
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

    def authenticate(self, hs: Handshake, token: str, admin: bool, cap: int | None = None) -> Connection:
        """The handshake of a connection proving ``token`` (an admin token or not) succeeded:
        its slot goes back, and the connection counts as authenticated, pushing out one that
        holds nothing where a cap is reached; Full when none can make room. ``cap``: the
        token's own (None: ``max_per_token`` for a pools token, none for an admin token)."""
        self._forget(hs)
        if cap is None:
            cap = self.max_connections if admin else self.max_per_token
        mine = self._tokens.get(token, [])
        if len(mine) >= cap and not self._push_out(mine):
            raise Full(f"token {token!r} has {len(mine)} connections open, its cap, and none is idle "
                       "without a pool (close some; an administrator may raise it with connections= "
                       "on its --authz line)")
        shared = self.max_connections - (0 if admin else self.admin_reserve)
        if self.authenticated >= shared and not self._push_out(self._biggest_first(admin)):
            if admin:
                raise Full(f"the target serves at most {self.max_connections} connections")
            raise Full(f"the {shared} connections of this target that pools tokens may use are all "
                       f"open (the other {self.admin_reserve} are kept for admin tokens)")
        conn = Connection(token, admin)
        self._tokens.setdefault(token, []).append(conn)
        self.authenticated += 1
        return conn

    def end_handshake(self, hs: Handshake) -> None:
        """The handshake failed, timed out, or its peer left."""
        self._forget(hs)

    def end_authenticated(self, conn: Connection) -> None:
        """The connection closed (nothing, when it was pushed out: counted then)."""
        mine = self._tokens.get(conn.token)
        if mine is None or conn not in mine:
            return
        mine.remove(conn)
        self.authenticated -= 1
        if not mine:
            del self._tokens[conn.token]

    def token_connections(self, token: str) -> int:
        return len(self._tokens.get(token, ()))

    def _all(self) -> Iterable[Connection]:
        return (c for mine in self._tokens.values() for c in mine)

    def _biggest_first(self, admin: bool) -> Iterable[Connection]:
        """Who makes room for a newcomer over the shared caps: pools tokens' connections, the
        token with the most first; for an admin newcomer, admin tokens' after them."""
        ranked = sorted(self._tokens.values(), key=lambda mine: (mine[0].admin, -len(mine)))
        return (c for mine in ranked if admin or not mine[0].admin for c in mine)

    @staticmethod
    def _expendable(conns: Iterable[Connection]) -> Connection | None:
        return next((c for c in conns if c.idle_and_empty()), None)

    def _push_out(self, conns: Iterable[Connection]) -> bool:
        """Close the first of ``conns`` (oldest first within a token) that holds nothing."""
        victim = self._expendable(conns)
        if victim is None:
            return False
        victim.dropped = True
        victim.scope.cancel()
        self.end_authenticated(victim)
        self.pushed_out += 1
        self.last_pushed_out = victim.token
        return True

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
