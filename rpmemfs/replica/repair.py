"""Repairs of an unmounted pool: `rpmemfs sync POOL` and `rpmemfs recover POOL --from`.

sync: every replica is compared with the local pool by chunk checksums (computed by each
target over its own copy) and only the chunks that differ are sent; then the replica table
and the sync map record the replicas as in sync again.

recover: a lost or damaged local pool is rebuilt from one replica, read over a lane and
checked against the target's checksums; the other replicas are marked for a full comparison,
since nothing says how far each of them got.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rpmemfs import safeopen
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK, Header, PoolFormatError
from rpmemfs.pool.syncmap import SyncMap, format_map
from rpmemfs.poolfile import place
from rpmemfs.replica.errors import ReplicationError
from rpmemfs.replica.fencing import Probe, probe_one
from rpmemfs.replica.replica import IN_SYNC
from rpmemfs.replica.replica_set import ReplicaSet
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table, write_table
from rpmemfs.replica.verify import chunk_of, differing_chunks
from rpmemfs.transport.base import DEFAULT_TIMEOUT, Lane, RemoteRegion, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.units import count

READ_STEP = 4 << 20  # bytes per read while recovering


class RepairError(ReplicationError):
    """The repair could not be done; the message says why. The local pool is untouched, or,
    for recover, not created."""


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


def refuse_unfinished(probe: Probe, allowed: bool) -> None:
    """A source whose resync was cut short holds parts of two points in time: copied, it makes
    a pool whose log may point at data that never arrived. Refused unless ``allowed``."""
    if probe.resync is None or allowed:
        return
    raise RepairError(f"replica {probe.spec} is not a consistent copy: {probe.resync} (its primary "
                      "stopped while sending it what it missed). Use a replica that is in sync, "
                      "or mount the pool that was resyncing it to finish the resync; "
                      "--unfinished-resync takes this copy anyway (run `rpmemfs check` on the result)")


def make_destination(path: str, size: int, force: bool) -> None:
    """Ready ``path`` to take a whole pool of ``size`` bytes: a new pool file (with ``force``
    in place of the file there), or a device DAX the pool fits on (poolfile/place.py)."""
    try:
        place.prepare(path, size, force)
    except place.PlaceError as exc:
        raise RepairError(str(exc)) from None


async def source_header(lane: Lane, region: RemoteRegion, source: ReplicaSpec,
                        timeout: float) -> tuple[Header, bytes]:
    """The header of the pool a replica holds (and both header blocks, which carry the replica
    table too); RepairError when it holds no usable pool."""
    with trio.fail_after(timeout):
        head = await lane.read(region, 0, 2 * BLOCK)
    try:
        hdr, _ = read_header(memoryview(head))
    except PoolFormatError as exc:
        raise RepairError(f"replica {source} holds no usable pool: {exc}") from None
    if hdr.pool_size != region.size:
        raise RepairError(f"replica {source}: header says {hdr.pool_size} bytes, the pool "
                          f"file is {region.size}")
    return hdr, head


async def read_runs(lane: Lane, region: RemoteRegion, buf: memoryview, runs: list[tuple[int, int]],
                    timeout: float, progress: Callable[[int, int], None] | None) -> int:
    """Copy ``runs`` of the remote pool into ``buf`` at the same offsets, READ_STEP bytes per
    read, each within ``timeout``; the bytes copied."""
    total = sum(n for _, n in runs)
    done = 0
    for first, n in runs:
        for off in range(first, first + n, READ_STEP):
            k = min(READ_STEP, first + n - off)
            with trio.fail_after(timeout):
                buf[off: off + k] = await lane.read(region, off, k)
            done += k
            if progress:
                progress(done, total)
    return total


async def recover_pool(pool: str, source: ReplicaSpec, token: bytes | None, *, force: bool = False,
                       unfinished_resync: bool = False,
                       progress: Callable[[int, int], None] | None = None,
                       timeout: float = DEFAULT_TIMEOUT,
                       wire_protection: str = DEFAULT_PROTECTION) -> dict[str, Any]:
    """Rebuild the local pool at ``pool`` from the replica ``source``."""
    t0 = time.monotonic()
    probe = await probe_one(source, token, timeout, wire_protection=wire_protection)
    if probe.error:
        raise RepairError(probe.error)
    refuse_unfinished(probe, unfinished_resync)
    try:
        async with await transport_for(source.transport, wire_protection=wire_protection).connect(
                source.address, token, lanes=1, timeout=timeout) as session:
            region = await session.open_pool(source.name)
            lane = session.lanes[0]
            hdr, _ = await source_header(lane, region, source, timeout)
            make_destination(pool, hdr.pool_size, force)
            done = False
            try:
                with PoolMapping.open(pool, "msync", exclusive=True, opener=safeopen.opener,
                                      length=hdr.pool_size) as mapping:
                    buf = mapping.buf
                    limit = await read_runs(lane, region, buf, [(0, hdr.map_off)], timeout, progress)
                    mark_others_full(mapping, hdr, source)
                    mapping.persist([(0, hdr.pool_size)])
                    compared, differing = await differing_chunks(
                        session, region, buf, [(0, limit)], chunk_of(hdr), lambda n: None, timeout)
                    if differing:
                        raise RepairError(f"the copy differs from replica {source} in {len(differing)} "
                                          "ranges after recovery (was it being written meanwhile?)")
                done = True
            finally:
                if not done:
                    place.unmake(pool)
    except TransportError as exc:
        raise RepairError(f"replica {source}: {exc}") from None
    except trio.TooSlowError:
        raise RepairError(f"replica {source}: no answer within {timeout:g}s") from None
    return {"pool": pool, "from": str(source), "bytes": limit, "chunks_verified": compared,
            "seconds": round(time.monotonic() - t0, 3)}


def mark_others_full(mapping: PoolMapping, hdr: Header, source: ReplicaSpec) -> None:
    """A fresh sync map: the source replica holds all of the pool, the others are unknown."""
    buf = mapping.buf
    mapping.persist(format_map(buf, hdr))
    syncmap = SyncMap(buf, hdr, mapping.persist)
    specs = inspect_table(buf).replicas
    for slot, spec in enumerate(specs):
        if str(spec) != str(source):
            syncmap.set_full(slot)
