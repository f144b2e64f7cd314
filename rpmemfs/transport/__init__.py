"""Transports to rpmemfs targets: one interface (base), the software TCP transport (tcp)."""

from rpmemfs.transport.base import (
    DEFAULT_TIMEOUT,
    Lane,
    LaneStats,
    Method,
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
    "Method",
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
