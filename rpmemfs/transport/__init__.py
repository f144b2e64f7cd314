"""Transports to rpmemfs targets.

This namespace offers the interface (base.py) and the software transport on TCP (tcp.py):
what most callers need. Beside them: choosing a transport for a replica address (choose.py),
verbs (verbs.py and rdma.py over pyverbs, verbs_config.py without it), the wire format
(wire.py, the one source of native/rpmem_wire.h), the connection and handshake under TCP
(conn.py, stream.py, sockio.py), tokens (tokens.py), the handshake's cryptography (auth.py),
wire protection (protection.py), addresses (address.py) and the reconnect probe (probe.py).

Modules of this package import each other by their own names (``from rpmemfs.transport.tokens
import key_id``), never from this namespace, which imports tcp.py: that would be a cycle.
"""

from rpmemfs.transport.base import (
    DEFAULT_TIMEOUT,
    Lane,
    LaneStats,
    LocalRanges,
    Method,
    PackedRanges,
    RemoteRegion,
    Session,
    Transport,
    TransportError,
    barrier,
)
from rpmemfs.transport.tcp import TcpLane, TcpSession, TcpTransport, connect

__all__ = [
    "DEFAULT_TIMEOUT",
    "Lane",
    "LaneStats",
    "LocalRanges",
    "Method",
    "PackedRanges",
    "RemoteRegion",
    "Session",
    "TcpLane",
    "TcpSession",
    "TcpTransport",
    "Transport",
    "TransportError",
    "barrier",
    "connect",
]
