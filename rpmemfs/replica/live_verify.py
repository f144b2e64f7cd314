"""Verify and verify-and-repair of a mounted pool (`rpmemfs verify|sync MOUNTPOINT`).

The pool changes while it is compared: a verify compares again after a durability point
before it calls a difference real, and a repair copies under the barrier lock. Unmounted
pools are verified and repaired by the offline commands (rpmemfs/admin/: verify.py, sync.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from rpmemfs.replica.barriers import Barriers
from rpmemfs.replica.replica import IN_SYNC, Replica
from rpmemfs.replica.resync import compare_and_repair
from rpmemfs.replica.verify import ReplicaReport, content_size, count_chunks, differing_chunks
from rpmemfs.transport.base import TransportError

VERIFY_ROUNDS = 3  # durability points a live verify waits for before a difference is real


async def verify_live(rs: Barriers, chunk: int, durable: Callable[[], Awaitable[None]],
                      progress: Callable[[int], None]) -> list[ReplicaReport]:
    """Compare the live pool with every replica by chunk checksums.

    A live pool runs ahead of its replicas until the next durability point, so chunks
    that differ are compared again after one (up to VERIFY_ROUNDS times): what still
    differs then is a real difference.
    """
    reports = [ReplicaReport(str(r.spec)) for r in rs.replicas]
    limit = content_size(rs.local_buf)
    for replica, report in zip(rs.replicas, reports, strict=True):
        if replica.state is not IN_SYNC or replica.session is None or replica.region is None:
            report.error = f"not in sync ({replica.state}): {replica.last_error}"
            continue
        try:
            report.compared_chunks, runs = await differing_chunks(
                replica.session, replica.region, rs.local_buf, [(0, limit)], chunk,
                progress, rs.timeout)
            for _ in range(VERIFY_ROUNDS):
                if not runs or replica.session is None or replica.region is None:
                    break
                await durable()
                _, runs = await differing_chunks(replica.session, replica.region, rs.local_buf,
                                                 runs, chunk, lambda n: None, rs.timeout)
            report.differing = runs
            report.differing_chunks = count_chunks(runs, chunk)
        except TransportError as exc:
            report.error = str(exc)
        except trio.TooSlowError:
            report.error = f"no checksum reply within {rs.timeout:g}s"
        except Exception as exc:  # the durability point failed: EIO from the filesystem
            report.error = f"could not make the pool durable to compare again: {exc!r}"
    return reports


async def repair_live(rs: Barriers, replica: Replica, compared: Callable[[int], None],
                      copied: Callable[[int], None]) -> dict[str, Any]:
    """Verify-and-repair of an in-sync replica while the mount serves (rpmemfs sync)."""
    totals = {"compared_chunks": 0, "differing_chunks": 0, "chunks_sent": 0, "bytes_sent": 0}
    t0 = time.monotonic()
    try:
        totals["bytes_sent"] = await compare_and_repair(rs, replica, totals, locked=True,
                                                        compared=compared, copied=copied)
    except (TransportError, trio.TooSlowError) as exc:
        replica.fail(f"repair failed: {exc}")
        if rs.syncmap is not None:
            # What it found to differ and did not send is known nowhere else.
            rs.syncmap.set_full(replica.slot)
        raise
    finally:
        replica.resync = None
    return {**totals, "seconds": round(time.monotonic() - t0, 3)}
