"""What a mount's status says at a glance: its health (also `rpmemfs status`'s exit status,
for scripts and monitors) and the table an administrator reads.

The health is decided from the status document alone (what `--json` prints), so a monitor
that keeps the JSON decides the same way.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from rpmemfs.units import count, human


class Health(enum.IntEnum):
    HEALTHY = 0  # every replica in sync
    DEGRADED = 1  # some not in sync, still at least min_replicas: fsync succeeds
    FAILING = 2  # fsync would return EIO
    UNKNOWN = 3  # not an rpmemfs mount, or its daemon does not answer


def health(st: dict[str, Any]) -> tuple[Health, str]:
    """The mount's health and why, in a few words."""
    if "error" in st and "pool" not in st:
        # The daemon answered, but with nothing of the pool (a bug behind its handler, a
        # daemon of another version): that tells nothing of its health.
        return Health.UNKNOWN, f"its daemon answered status with an error: {st['error']}"
    replicas = st.get("replicas") or []
    n = len(replicas)
    in_sync = sum(1 for r in replicas if r.get("state") == "in-sync")
    need = int(st.get("min_replicas") or 0)
    summary = f"{in_sync} of {count(n, 'replica')} in sync, {need} required"
    if st.get("fenced"):
        if need:
            return Health.FAILING, f"fenced: {st['fenced']}"
        return Health.DEGRADED, f"fenced, serving alone (min_replicas=0): {st['fenced']}"
    if in_sync < need:
        return Health.FAILING, summary
    if in_sync < n:
        return Health.DEGRADED, summary
    return Health.HEALTHY, summary if n else "no replicas"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _when(ts: object) -> str:
    if not isinstance(ts, (int, float)) or not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _lag(r: dict[str, Any]) -> str:
    if r.get("state") == "in-sync":
        # replication=async: what it has not acknowledged yet, and the oldest point's age
        lag, age = r.get("lag_bytes"), r.get("lag_seconds")
        if isinstance(lag, int) and lag and isinstance(age, (int, float)):
            return f"{human(lag)}, {age:.2f}s"
        return "0"
    lag = r.get("lag_bytes")
    behind = r.get("behind_since")
    since = f", {_duration(time.time() - behind)}" if isinstance(behind, (int, float)) else ""
    return (human(lag) if isinstance(lag, int) else "all (compare)") + since


def _replication(st: dict[str, Any]) -> list[str]:
    backlog = st.get("backlog")
    if st.get("replication") != "async" or not isinstance(backlog, dict):
        return []
    return [f"  replication async, max_lag {human(int(backlog.get('max_lag', 0)))}; queued "
            f"{human(int(backlog.get('queued_bytes', 0)))} in "
            f"{count(int(backlog.get('queued_batches') or 0), 'batch', 'batches')}"]


def _progress(r: dict[str, Any]) -> str:
    p = r.get("resync")
    if not isinstance(p, dict) or not p.get("total"):
        return ""
    return f" ({p.get('phase')} {100 * p.get('done', 0) // p['total']}%)"


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_status(st: dict[str, Any]) -> str:
    h, why = health(st)
    lat = st.get("fsync_latency_us") or {}
    used, data = int(st.get("used", 0)), int(st.get("data_size", 0)) or 1
    commit = (st.get("commit") or {}).get("seconds", 0)
    every = f"every {commit:g}s" if commit else "off"
    started = st.get("started")
    uptime = _duration(time.time() - started) if isinstance(started, (int, float)) else "?"
    lines = [
        f"{st['mountpoint']}: {h.name.lower()} ({why})",
        f"  pool     {st['pool']} ({st.get('uuid')})",
        f"  size     {human(int(st.get('size', 0)))}, used {human(used)} of {human(data)} "
        f"({100 * used // data}%), {count(int(st.get('inodes') or 0), 'inode')}",
        f"  pmem     {st.get('pmem_mode')} (requested {st.get('pmem_requested')})",
        f"  epoch    {st.get('epoch')}   min_replicas {st.get('min_replicas')}   up {uptime}   "
        f"pid {st.get('pid')}",
        *([f"  messages {st['daemon_log']}"] if st.get("daemon_log") else []),  # the daemon's log
        *_replication(st),
        f"  fsync    {count(int(st.get('fsync_count') or 0), 'call')}, p50 {lat.get('p50', 0):.1f} us, "
        f"p99 {lat.get('p99', 0):.1f} us; commit {every}",
    ]
    log = st.get("log")
    if isinstance(log, dict):
        lines.append(f"  log      area {log.get('area')} gen {log.get('generation')}, "
                     f"{human(int(log.get('used', 0)))} of {human(int(log.get('capacity', 0)))}, "
                     f"{count(int(log.get('checkpoints') or 0), 'checkpoint')}")
    replay = st.get("replay")
    if isinstance(replay, dict) and "tail_records" in replay:
        lines.append(f"  replay   {count(int(replay.get('records') or 0), 'record')} at mount, "
                     f"{replay.get('tail_records')} of them after the snapshot, "
                     f"in {replay.get('seconds')} s")
    waited = st.get("oldest_barrier_s")
    if isinstance(waited, (int, float)) and waited >= 1:
        # A replica that stopped answering is still "in-sync" until replica_timeout.
        lines.append(f"  waiting  a barrier has waited {waited:.1f} s for its replicas")
    replicas = st.get("replicas") or []
    if replicas:
        rows: list[tuple[str, ...]] = [("replica", "state", "lag", "sent", "barriers", "last error")]
        for r in replicas:
            err = r.get("last_error")
            at = r.get("last_error_at") or ""
            rows.append((f"{r.get('address')}/{r.get('name')}", f"{r.get('state')}{_progress(r)}",
                         _lag(r), human(int(r.get("bytes") or 0)), str(r.get("barriers") or 0),
                         "-" if not err else f"{at[:19].replace('T', ' ')} UTC {err}" if at else err))
        lines += _table(rows)
    return "\n".join(lines)
