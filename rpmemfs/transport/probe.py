"""Whether a target accepts connections now: the probe a replica's keeper runs between
reconnection attempts (rpmemfs/replica/replica_set.py), so that a target that comes back is
tried at once instead of at the end of a backoff.

A TCP connect to the target's address, closed at once without a byte sent. Every transport
reaches its target through that port first (verbs opens its control connection there too),
so one probe serves tcp://, rdma:// and bare addresses alike.
"""

from __future__ import annotations

import time

import trio

from rpmemfs.transport.address import parse_address
from rpmemfs.transport.sockio import AddrInfo, connect_socket, resolve


async def accepts_connections(address: str, timeout: float) -> bool:
    """Whether the target at ``address`` (HOST:PORT) accepts TCP connections now, within
    ``timeout``: whether a full connection attempt could get past "refused" or
    "unreachable", at the cost of one SYN. The target sees a connection that closes before
    its handshake: it holds it for no longer than that, and logs it at debug level only
    (rpmemfs/target/server.py)."""
    try:
        host, port = parse_address(address)
    except ValueError:
        return False
    with trio.move_on_after(timeout):
        try:
            sock = await connect_socket(host, port, await _resolved(host, port))
        except OSError:
            return False
        sock.close()
        return True
    return False  # no answer at all: a cut link, or a host that is down


# Probes come every fraction of a second while a target is away: a name is looked up again
# only after this long, not on each (full connection attempts always look it up).
PROBE_RESOLVE_TTL = 30.0
_probe_names: dict[tuple[str, int], tuple[float, list[AddrInfo]]] = {}


async def _resolved(host: str, port: int) -> list[AddrInfo]:
    now = time.monotonic()
    known = _probe_names.get((host, port))
    if known is not None and known[0] > now:
        return known[1]
    infos = await resolve(host, port)
    _probe_names[(host, port)] = (now + PROBE_RESOLVE_TTL, infos)
    return infos
