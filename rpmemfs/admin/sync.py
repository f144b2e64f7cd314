"""`rpmemfs sync POOL`: every replica of an unmounted pool verified and repaired.

Every replica is compared with the local pool by chunk checksums (computed by each target over
its own copy) and only the chunks that differ are sent; then the replica table and the sync
map record the replicas as in sync again. A mounted pool is synced by its daemon instead
(replica/live_verify.py); both answer in the same fields, which ``format_sync`` prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rpmemfs.admin.errors import RepairError
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import PoolFormatError
from rpmemfs.pool.syncmap import SyncMap
from rpmemfs.replica.replica import IN_SYNC
from rpmemfs.replica.replica_set import ReplicaSet
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table, write_table
from rpmemfs.replica.verify import chunk_of
from rpmemfs.transport.base import DEFAULT_TIMEOUT
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.units import count


@dataclass
class SyncReport:
    """What `rpmemfs sync` did, in the same fields and units as verify's report (chunks of
    ``chunk`` bytes, verify.pool_chunk); per replica: compared_chunks, differing_chunks,
    chunks_sent, bytes_sent, or an error."""

    pool: str
    size: int
    chunk: int
    seconds: float = 0.0
    replicas: list[dict[str, Any]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return all(r.get("state") == IN_SYNC and "error" not in r for r in self.replicas)

    def as_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "size": self.size, "chunk": self.chunk, "clean": self.clean,
                "seconds": round(self.seconds, 3), "replicas": self.replicas}


def format_sync(report: dict[str, Any]) -> str:
    lines = [f"sync of {report['pool']}: {report['size']} bytes, chunks of {report['chunk']} bytes, "
             f"{count(len(report['replicas']), 'replica')}, {report['seconds']:.2f} s"]
    for r in report["replicas"]:
        if "error" in r:
            lines.append(f"  {r['replica']}: NOT SYNCED: {r['error']}")
        else:
            lines.append(f"  {r['replica']}: {count(r.get('compared_chunks', 0), 'chunk')} compared, "
                         f"{r.get('differing_chunks', 0)} differing, "
                         f"{count(r.get('chunks_sent', 0), 'chunk')} sent ({r.get('bytes_sent', 0)} bytes)")
    lines.append("clean" if report.get("clean") else "NOT CLEAN")
    return "\n".join(lines)


async def sync_pool(pool: str, mapping: PoolMapping, specs: list[ReplicaSpec], token: bytes | None,
                    progress: Callable[[int], None], timeout: float = DEFAULT_TIMEOUT,
                    wire_protection: str = DEFAULT_PROTECTION) -> SyncReport:
    """Verify-and-repair every replica of an unmounted pool."""
    buf = mapping.buf
    try:
        hdr, _ = read_header(buf)
    except PoolFormatError as exc:
        raise RepairError(f"pool {pool}: {exc}") from None
    t0 = time.monotonic()
    syncmap = SyncMap(buf, hdr, mapping.persist)
    for slot in range(len(specs)):
        syncmap.set_full(slot)  # compare everything, whatever the map says
    rs = await ReplicaSet.open(specs, buf, hdr.uuid, token, lanes=1, timeout=timeout, min_replicas=0,
                               syncmap=syncmap, epoch=(hdr.epoch, hdr.epoch), progress=progress,
                               wire_protection=wire_protection)
    try:
        table = inspect_table(buf)
        stale = [str(r.spec) for r in rs.replicas if r.state is not IN_SYNC]
        ranges = write_table(buf, specs, table.token_file, stale)
        mapping.persist(ranges)
        if rs.in_sync:
            await rs.barrier(ranges)  # the table is part of the pool: replicas hold it too
        if not stale:
            syncmap.finish()
    finally:
        await rs.aclose()
    report = SyncReport(pool, len(buf), chunk_of(hdr), time.monotonic() - t0)
    for r in rs.replicas:
        entry: dict[str, Any] = {"replica": str(r.spec), "state": r.state.value, **(r.last_resync or {})}
        if r.state is not IN_SYNC:
            entry["error"] = r.last_error or r.state.value
        report.replicas.append(entry)
    return report
