"""Reading a whole pool from one replica: what recover and promote share.

The source's owner record is checked first (a resync cut short leaves no consistent copy),
its header read and checked, the destination made ready for a whole pool (a file, or a device
DAX: poolfile/place.py), the pool read over a lane in steps, and a fresh sync map written in
which the source holds all of the pool and the other replicas are compared in full.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from rpmemfs.admin.errors import RepairError
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import BLOCK, Header, PoolFormatError
from rpmemfs.pool.syncmap import SyncMap, format_map
from rpmemfs.poolfile import place
from rpmemfs.replica.fencing import Probe
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table
from rpmemfs.transport.base import Lane, RemoteRegion

READ_STEP = 4 << 20  # bytes per read while copying


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


def mark_others_full(mapping: PoolMapping, hdr: Header, source: ReplicaSpec | None) -> None:
    """A fresh sync map: the source replica (if any) holds all of the pool, the others are
    unknown."""
    buf = mapping.buf
    mapping.persist(format_map(buf, hdr))
    syncmap = SyncMap(buf, hdr, mapping.persist)
    specs = inspect_table(buf).replicas
    for slot, spec in enumerate(specs):
        if str(spec) != str(source):
            syncmap.set_full(slot)
