"""Which peers may talk to a target that has no token."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.x.y.z)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def peer_allowed(host: str, token_configured: bool) -> bool:
    """Without a token anyone who can reach the port could write pools, so only this host may."""
    return token_configured or is_loopback(host)
