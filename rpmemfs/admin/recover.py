"""`rpmemfs recover POOL --from REPLICA`: a lost or damaged local pool rebuilt from one replica.

The pool is read over a lane (source.py) and checked against the target's checksums; the other
replicas are marked for a full comparison, since nothing says how far each of them got. A
recover that stops leaves no pool behind: half a pool is no pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from rpmemfs import safeopen
from rpmemfs.admin.errors import RepairError
from rpmemfs.admin.source import (
    make_destination,
    mark_others_full,
    read_runs,
    refuse_unfinished,
    source_header,
)
from rpmemfs.pmem import PoolMapping
from rpmemfs.poolfile import place
from rpmemfs.replica.fencing import probe_one
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.verify import chunk_of, differing_chunks
from rpmemfs.transport.base import DEFAULT_TIMEOUT, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION


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
