"""Asking a target daemon from the command line: which pools it holds, who owns each, and
evicting a writing session (`rpmemfs pools`, `rpmemfs evict`).

What failover needs to see at a glance: per pool, the owner's epoch and who it is (host, pid,
pool, since when), the session writing it now, how many sessions have it open, and when it was
last written.
"""

from __future__ import annotations

import time
from typing import Any

from rpmemfs.latency import BOUNDS_S, bucket_quantile
from rpmemfs.printable import printable
from rpmemfs.transport.address import parse_address
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.transport.tcp import connect
from rpmemfs.units import count, human

SCHEMES = ("tcp://", "rdma://")


def plain_address(address: str) -> str:
    """HOST:PORT of ``[tcp://|rdma://]HOST:PORT``; ValueError with the reason."""
    for scheme in SCHEMES:
        if address.startswith(scheme):
            address = address[len(scheme):]
    parse_address(address)  # ValueError with the reason, for the CLI to show
    return address


async def ask(address: str, token: bytes | None, request: dict[str, Any], timeout: float,
              wire_protection: str = DEFAULT_PROTECTION) -> dict[str, Any]:
    """One control request to the target at ``address`` (its control port is TCP always)."""
    async with await connect(plain_address(address), token, lanes=0, timeout=timeout,
                             wire_protection=wire_protection) as session:
        return await session.control(request)


def _when(ts: object) -> str:
    if not isinstance(ts, (int, float)) or not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _latency(bound: float | None) -> str:
    if bound is None:
        return "-"
    if bound == float("inf"):
        return f"> {BOUNDS_S[-1]:g} s"
    return f"<= {bound * 1e6:g} us" if bound < 1e-3 else f"<= {bound * 1e3:g} ms"


def _quota_line(name: str, q: dict[str, Any]) -> str:
    """A pools token's usage against its limits on this target."""
    used = human(int(q.get("used") or 0))
    space = f"{used} of {human(q['quota'])}" if q.get("quota") else f"{used} (no space quota)"
    n = int(q.get("pools") or 0)
    most = q.get("max_pools")
    pools = f"{n} of {most} pools" if most else f"{count(n, 'pool')} (no pool limit)"
    return f"quota of token {name}: {space}, {pools}"


def format_pools(address: str, pools: dict[str, Any], quotas: dict[str, Any] | None = None) -> str:
    rows = [("pool", "size", "owner epoch", "owner", "since", "writer", "sessions", "last activity",
             "persisted", "persist p99", "resync")]
    for name, p in pools.items():
        owner = p.get("owner") or {}
        holder = owner.get("holder") or {}
        who = holder.get("host", "-")
        if "pid" in holder:
            who += f" pid {holder['pid']}"
        if "pool" in holder:
            who += f" {holder['pool']}"
        rows.append((name, human(int(p.get("size", 0))), owner.get("epoch_shown", "-"), who,
                     _when(owner.get("since")), p.get("writer") or "-", str(len(p.get("sessions", []))),
                     _when(p.get("last_activity")), human(int(p.get("persisted_bytes") or 0)),
                     _latency(bucket_quantile(p.get("persist_buckets") or [], 0.99)),
                     f"UNFINISHED since {_when(owner['resync'].get('since'))}"
                     if owner.get("resync") else "-"))
    # Every cell is the target's text, holders' included: escaped, one line each (printable).
    shown = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in shown) for i in range(len(shown[0]))]
    lines = [f"target {address}: {count(len(pools), 'pool')}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in shown]
    lines += [_quota_line(name, q) for name, q in sorted((quotas or {}).items())]
    return "\n".join(lines)
