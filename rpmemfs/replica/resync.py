"""Resync: send a replica that missed barriers what it misses, then let it join them.

What it misses comes from the pool's sync map; with nothing known (no sync map, or its slot
FULL) every chunk is compared by checksum first, and the blocks of a differing chunk next, so
that only the blocks that differ are sent. The copies go on the replica's bulk lane in
barriers of COPY_BATCH bytes, beside the barriers of the in-sync replicas. The comparison and
the copy also serve the live verify-and-repair (live_verify.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from rpmemfs.pool.layout import BLOCK
from rpmemfs.replica.barriers import Barriers
from rpmemfs.replica.replica import IN_SYNC, RESYNCING, Replica
from rpmemfs.replica.verify import chunks_touched, content_size, count_chunks, differing_chunks, pool_chunk
from rpmemfs.transport.base import TransportError, barrier
from rpmemfs.units import count, human

log = logging.getLogger(__name__)

COPY_BATCH = 8 << 20  # bytes per barrier while resyncing
MAX_PASSES = 8  # resync passes outside the barrier lock before the last one under it...
LAST_PASS_BYTES = 4 << 20  # ...or fewer bytes left than this (64 chunks of 64 KiB, as before)


async def resync(rs: Barriers, replica: Replica, progress: Callable[[int], None]) -> bool:
    """Send the replica what it misses, then let it join the barriers; False when it fell
    stale meanwhile and did not join.

    Passes run while barriers go on without the replica (marking what they write as
    missing, so the next pass sends it again); the last pass runs under the barrier
    lock, and the replica joins before the lock is released. ``progress`` counts the bytes
    compared and copied.
    """
    syncmap = rs.syncmap
    slot = replica.slot
    replica.move(RESYNCING)
    replica.resyncs += 1
    t0 = time.monotonic()
    if syncmap is None or syncmap.full(slot) or syncmap.count(slot):
        await _mark(rs, replica, True)
    totals = {"compared_chunks": 0, "differing_chunks": 0, "chunks_sent": 0, "bytes_sent": 0,
              "passes": 0}
    missed: int | None = None
    if syncmap is None or syncmap.full(slot):
        if syncmap is not None:
            syncmap.take(slot)  # the comparison covers what the map held until now
        totals["bytes_sent"] += await compare_and_repair(rs, replica, totals, locked=False,
                                                         compared=progress, copied=progress)
    if syncmap is not None:
        for _ in range(MAX_PASSES):
            if syncmap.count(slot) * syncmap.chunk <= LAST_PASS_BYTES:
                break
            totals["bytes_sent"] += await _send_missing(rs, replica, totals, progress)
    async with rs.lock:
        if syncmap is not None:
            try:
                # Every fsync waits while this lock is held: never longer than a barrier
                # may take. What is not sent in time stays marked for the next attempt.
                with trio.fail_after(rs.timeout):
                    totals["bytes_sent"] += await _send_missing(rs, replica, totals, progress)
            except trio.TooSlowError:
                raise TransportError(str(replica.spec), f"the last resync pass did not end within "
                                     f"{rs.timeout:g}s (fsyncs wait for it)", lane_lost=True) from None
        if replica.state is not RESYNCING:
            # A barrier posted on its previous session failed meanwhile, and may have marked
            # what it missed after the last pass took the map: its keeper tries again.
            return False
        if syncmap is not None:
            # What the barriers it missed carried, to hold bytes_sent against (None when
            # the map's bits came from an earlier mount, or it was compared in full).
            missed = syncmap.missed[slot]
            syncmap.settle(slot)
        replica.joined()
    # After it joined, outside the lock (no fsync waits for this round trip). Should it be
    # lost (the target gone, this mount killed), the mark stays and the replica is only
    # refused as a source until its next resync ends: never the other way round.
    await _mark(rs, replica, False)
    replica.resync = None
    replica.last_resync = {**totals, "missed_bytes": missed, "seconds": round(time.monotonic() - t0, 3)}
    if totals["bytes_sent"] or totals["compared_chunks"]:
        # Info: a replica catching up is routine; one that fell behind says at warning
        # when it is in sync again (replica_set), with the error it had.
        log.info("replica %s resynced: %s", replica.spec, _summary(replica.last_resync))
    return True


def _summary(done: dict[str, Any]) -> str:
    """A resync's last_resync as a sentence (status --json has the same numbers)."""
    said = []
    if done["compared_chunks"]:
        said.append(f"{count(done['compared_chunks'], 'chunk')} compared, "
                    f"{done['differing_chunks']} differing")
    sent = human(done["bytes_sent"])
    if done["missed_bytes"]:
        sent += f", {done['bytes_sent'] / done['missed_bytes']:.2f}x the bytes it missed"
    said.append(f"{count(done['chunks_sent'], 'chunk')} sent ({sent}) in "
                f"{count(done['passes'], 'pass', 'passes')}, {done['seconds']:.3f} s")
    return "; ".join(said)


async def _mark(rs: Barriers, replica: Replica, active: bool) -> None:
    """Record on the replica's target that its resync begins (before any resync write lands
    there) or ended; see target/owners.py. Only the pool's claimant may, and only a change is
    sent. Failing to clear it is logged, not fatal (the replica is in sync)."""
    if not replica.claimed or replica.resync_marked is active:
        return
    assert replica.session is not None and replica.region is not None
    try:
        with trio.fail_after(rs.timeout):
            await replica.session.mark_resync(replica.region, active)
    except (TransportError, trio.TooSlowError) as exc:
        if active:
            raise
        log.warning("replica %s: in sync, but its target still marks a resync under way: %s",
                    replica.spec, exc)
        return
    replica.resync_marked = active


async def _send_missing(rs: Barriers, replica: Replica, totals: dict[str, int],
                        progress: Callable[[int], None]) -> int:
    """One pass: the chunks the sync map has for the replica, in barriers."""
    assert rs.syncmap is not None
    runs = rs.syncmap.take(replica.slot)
    totals["passes"] += 1
    if not runs:
        return 0
    # Counted in verify's chunk, as the comparison counts them (the map's may be finer).
    totals["chunks_sent"] += chunks_touched(runs, pool_chunk(rs.local_buf))
    try:
        return await copy(rs, replica, runs, "resync", progress)
    except BaseException:
        # Not sent after all: still missing (the durable bits never went away).
        rs.syncmap.mark([replica.slot], runs, again=True)
        raise


async def compare_and_repair(rs: Barriers, replica: Replica, totals: dict[str, int], *, locked: bool,
                             compared: Callable[[int], None], copied: Callable[[int], None]) -> int:
    """Compare every chunk by checksum, then the blocks of those that differ, and copy the
    blocks that differ (under the barrier lock when ``locked``, for a replica that takes
    barriers meanwhile); bytes sent. ``compared`` and ``copied`` count the bytes compared and
    copied; the totals count chunks in verify's chunk (verify.pool_chunk)."""
    assert replica.session is not None and replica.region is not None
    limit = content_size(rs.local_buf)
    chunk = pool_chunk(rs.local_buf)
    replica.resync = {"phase": "compare", "done": 0, "total": limit}

    def compared_some(n: int) -> None:
        assert replica.resync is not None
        replica.resync["done"] += n
        compared(n)

    n_compared, runs = await differing_chunks(replica.session, replica.region, rs.local_buf,
                                              [(0, limit)], chunk, compared_some, rs.timeout)
    differing = count_chunks(runs, chunk)
    totals["compared_chunks"] += n_compared
    totals["differing_chunks"] += differing
    totals["chunks_sent"] += differing
    if runs and chunk > BLOCK:
        # A write changes a few blocks of a chunk, not all 16 of 64 KiB: one more round of
        # checksums (a request per 4 MiB that differs) instead of sending the rest again.
        _, runs = await differing_chunks(replica.session, replica.region, rs.local_buf, runs, BLOCK,
                                         lambda n: None, rs.timeout)
    log.info("replica %s: %d of %d chunks differ (%d bytes in blocks that differ)", replica.spec,
             differing, n_compared, sum(n for _, n in runs))
    return await copy(rs, replica, runs, "repair", copied, locked=locked)


async def copy(rs: Barriers, replica: Replica, runs: list[tuple[int, int]], phase: str,
               progress: Callable[[int], None], *, locked: bool = False) -> int:
    """Write ``runs`` of the local pool to the replica in barriers of COPY_BATCH bytes.

    ``locked``, for a replica that takes barriers meanwhile: each batch under the barrier
    lock, with no barrier in flight, so that it places current content and no barrier
    overtakes it (anything written since the comparison is newer still). The lock is taken
    per batch and held for at most ``rs.timeout``: fsyncs wait for one batch, never for the
    whole repair, nor past the replica timeout when a link is cut."""
    assert replica.region is not None and replica.lanes
    total = sum(n for _, n in runs)
    replica.resync = {"phase": phase, "done": 0, "total": total}
    lane = replica.bulk_lane
    batch: list[tuple[int, int]] = []
    size = 0
    last_log = time.monotonic()

    async def send() -> None:
        writes = [(off, rs.local_buf[off : off + n]) for off, n in batch]
        try:
            await barrier(lane, replica.region, writes)  # type: ignore[arg-type]
        finally:
            for _, view in writes:
                view.release()

    async def flush() -> None:
        nonlocal size, last_log
        if locked:
            async with rs.lock:
                with trio.fail_after(rs.timeout):
                    await rs.drain()
                    if replica.state is not IN_SYNC:
                        # A barrier failed on it meanwhile: its lanes are as good as gone.
                        raise TransportError(str(replica.spec), f"fell out of sync during the {phase}")
                    await send()
        else:
            with trio.fail_after(rs.timeout):
                await send()
        assert replica.resync is not None
        replica.resync["done"] += size
        progress(size)
        batch.clear()
        size = 0
        if time.monotonic() - last_log > 1:
            last_log = time.monotonic()
            log.info("replica %s: %s %d of %d bytes", replica.spec, phase,
                     replica.resync["done"], total)

    for off, length in runs:
        pos, end = off, off + length
        while pos < end:
            n = min(end - pos, COPY_BATCH - size)
            batch.append((pos, n))
            size += n
            pos += n
            if size >= COPY_BATCH:
                await flush()
    if batch:
        await flush()
    return total
