"""Making a replica pool on a target from a freshly made local pool."""

from __future__ import annotations

import trio

from rpmemfs.pool.layout import AREAS_OFF, BLOCK, Header
from rpmemfs.ranges import Ranges, merge_ranges
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import DEFAULT_TIMEOUT, RemoteRegion, Session, Transport, TransportError, barrier
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION

_SCAN = 1 << 20
_ZERO_SCAN = bytes(_SCAN)
_ZERO_BLOCK = bytes(BLOCK)


def metadata_ranges(buf: memoryview) -> Ranges:
    """The non-zero blocks below the data region of a pool: what a new replica needs.

    mkfs zero-fills the pool and a target creates replica pools zero-filled, so copying the
    non-zero blocks of [0, data_off) (headers, replica table, the log area's header and
    records) reproduces a fresh pool exactly, without parsing the log.
    """
    end = Header.decode(buf).data_off
    found: Ranges = []
    for base in range(0, end, _SCAN):
        n = min(_SCAN, end - base)
        if buf[base : base + n] == _ZERO_SCAN[:n]:
            continue
        for off in range(base, base + n, BLOCK):
            if buf[off : off + BLOCK] != _ZERO_BLOCK:
                found.append((off, BLOCK))
    return merge_ranges(found)


def _split(ranges: list[tuple[int, int]], at: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(parts below ``at``, parts from ``at`` on), each in the given order."""
    low: list[tuple[int, int]] = []
    high: list[tuple[int, int]] = []
    for off, length in ranges:
        end = off + length
        if off < at:
            low.append((off, min(end, at) - off))
        if end > at:
            start = max(off, at)
            high.append((start, end - start))
    return low, high


async def create_remote(
    spec: ReplicaSpec,
    size: int,
    local_buf: memoryview,
    ranges: list[tuple[int, int]],
    *,
    token: bytes | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    transport: Transport | None = None,
    wire_protection: str = DEFAULT_PROTECTION,
) -> RemoteRegion:
    """Create the replica pool ``spec`` of ``size`` bytes and copy ``ranges`` of ``local_buf``.

    The header blocks go last, in a barrier of their own: until they are durable the remote
    pool has no valid header and every open refuses it, so a create cut short never leaves
    something that passes for a replica. If the copy fails, the pool is removed again (best
    effort) so that a retry can create it.
    """
    if size != len(local_buf):
        raise ValueError(f"replica size {size} differs from the local pool's {len(local_buf)} bytes")
    headers, body = _split(ranges, AREAS_OFF)
    tp = transport or transport_for(spec.transport, wire_protection=wire_protection)
    with trio.fail_after(timeout):
        session = await tp.connect(spec.address, token, lanes=1, timeout=timeout)
    async with session:
        with trio.fail_after(timeout):
            region = await session.create_pool(spec.name, size)
        try:
            lane = session.lanes[0]
            for part in (body, headers):
                if part:
                    writes = [(off, local_buf[off : off + n]) for off, n in part if n]
                    try:
                        with trio.fail_after(timeout):
                            await barrier(lane, region, writes)
                    finally:
                        # So that no traceback keeps the caller's mapping exported.
                        for _, view in writes:
                            view.release()
        except (TransportError, trio.TooSlowError):
            await _remove_quietly(session, region, timeout)
            raise
        # Closed here, answered by the target, rather than by leaving the session: a session's
        # end is handled by the target in its own time, and a caller that removes the pool
        # next (a mkfs undoing a half-made set) would find it still open there.
        with trio.fail_after(timeout):
            await session.close_pool(region)
    return region


async def _remove_quietly(session: Session, region: RemoteRegion, timeout: float) -> None:
    with trio.move_on_after(timeout) as scope:
        scope.shield = True
        try:
            # The target refuses to remove a pool any session (this one too) has open.
            await session.close_pool(region)
            await session.remove_pool(region.name)
        except TransportError:
            pass  # the target is unreachable or refuses; the error being raised says why
