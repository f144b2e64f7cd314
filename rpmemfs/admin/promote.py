"""`rpmemfs promote NEWPOOL --from REPLICA`: a failover's new primary, made so that the old
primary can never write the replicas again.

1. Read the source replica's header and replica table: the pool's replicas, as its last
   primary recorded them (the table lives in the pool, so every replica holds it). A file
   at NEWPOOL that is no older copy of this pool is refused here, before anything is
   claimed, unless --force.
2. Ask every replica who owns it (replica/fencing.py, probe_replicas) and take an epoch above
   all of them: the next generation after the highest, with a random nonce.
3. Claim every reachable replica with it, as a takeover. Each target records the claim before
   it answers and drops the old primary's registration, so the old primary is fenced from
   here on, before the new one has written anything. A replica that refuses (another
   takeover, with a higher epoch, won) ends the promote with the winner's name.
4. Copy the pool from the source, which cannot change underneath now: only the chunks that
   differ when NEWPOOL already holds an older copy of this pool (a fail-back), all of it
   otherwise; then compare every chunk with the source by checksum.
5. Say how far behind the source was (replication=async): the place in the history each
   replica holds (pool/position.py: the log sequence number and time of its last point),
   compared with the most advanced replica reached. The primary is dead, so nothing knows what
   it held beyond that: only what the replicas reached hold can be compared.
6. Give NEWPOOL the new epoch, the same replica list (or the one the caller gives), and a
   sync map under that epoch in which the source is in sync and every other replica is
   compared in full when NEWPOOL is mounted.

A replica that could not be reached is fenced the first time the new primary reaches it: its
recorded epoch is a generation behind, which a normal claim from the new primary passes and
the old primary's does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
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
from rpmemfs.holders import busy
from rpmemfs.pmem import PmemError, PoolMapping
from rpmemfs.pool import position
from rpmemfs.pool.header import read_header, write_epoch
from rpmemfs.pool.layout import Header, PoolFormatError, show_epoch
from rpmemfs.poolfile import place
from rpmemfs.replica.fencing import Probe, holder, new_epoch, probe_replicas
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import inspect_table, write_table
from rpmemfs.replica.verify import chunk_of, count_chunks, differing_chunks
from rpmemfs.transport.base import DEFAULT_TIMEOUT, RemoteRegion, Session, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION

Progress = Callable[[int, int], None]
Replicas = tuple[list[ReplicaSpec], str | None]  # a replica table and its token file


async def _claim(spec: ReplicaSpec, token: bytes | None, epoch: int, who: dict[str, Any],
                 timeout: float, wire_protection: str, lanes: int = 0) -> tuple[Session, RemoteRegion]:
    tp = transport_for(spec.transport, wire_protection=wire_protection)
    session = await tp.connect(spec.address, token, lanes=lanes, timeout=timeout)
    try:
        region = await session.open_pool(spec.name, (epoch, epoch), holder=who, takeover=True)
    except BaseException:
        await session.aclose()
        raise
    return session, region


def _same_pool(path: str, hdr: Header) -> bool:
    """Whether ``path`` holds an (older) copy of the pool ``hdr`` describes."""
    try:
        with PoolMapping.open(path, "msync", readonly=True, opener=safeopen.opener) as pm:
            mine, _ = read_header(pm.buf)
    except (PmemError, PoolFormatError, OSError):
        return False
    return mine.uuid == hdr.uuid and mine.pool_size == hdr.pool_size


def _refuse_destination(pool: str, hdr: Header, force: bool) -> None:
    """Before anything is claimed: a promote that stops at its own destination must not have
    fenced the primary already."""
    try:
        place.refuse_link(pool)  # --force or not: the pool is written where it is named
        dev = place.device_at(pool)
    except place.PlaceError as exc:
        raise RepairError(f"{exc}; nothing was claimed") from None
    if who := busy(pool):
        raise RepairError(f"{pool} is in use ({who}): stop that process before promoting onto it; "
                          "nothing was claimed")
    if dev is not None and not _same_pool(pool, hdr):
        try:
            place.check_device(dev, hdr.pool_size, force)  # fits, and holds no other pool
        except place.PlaceError as exc:
            raise RepairError(f"{exc}; nothing was claimed") from None
        return
    if force or not os.path.lexists(pool) or _same_pool(pool, hdr):
        return
    raise RepairError(f"{pool} exists and is not an older copy of this pool (another pool, or "
                      "another size: grown since?); nothing was claimed. Name another file, or "
                      "give --force to replace it with a whole copy")


async def promote_pool(pool: str, source: ReplicaSpec, token: bytes | None, *, force: bool = False,
                       unfinished_resync: bool = False, progress: Progress | None = None,
                       timeout: float = DEFAULT_TIMEOUT,
                       wire_protection: str = DEFAULT_PROTECTION,
                       unreached: Mapping[str, str] | None = None,
                       replicas: Replicas | None = None) -> dict[str, Any]:
    """Make ``pool`` the primary of ``source``'s replica set (see the module's text); every
    connection to a target asks for ``wire_protection``. ``unreached`` names replicas (as
    "ADDR/NAME") the caller just failed to reach, and why: they are not waited for again.
    ``replicas``: the new pool's replica table and token file, when they are not the old
    primary's (automatic failover: every node but the new primary; ``source`` among them)."""
    t0 = time.monotonic()
    who = holder(os.path.abspath(pool), command="promote")
    wp = wire_protection
    try:
        src_probe = (await probe_replicas([source], token, timeout, wire_protection=wp))[0]
        if src_probe.error:
            raise RepairError(src_probe.error)
        refuse_unfinished(src_probe, unfinished_resync)
        async with await transport_for(source.transport, wire_protection=wp).connect(
                source.address, token, lanes=1, timeout=timeout) as peek:
            region = await peek.open_pool(source.name)
            hdr, head = await source_header(peek.lanes[0], region, source, timeout)
        table = inspect_table(memoryview(head))
        specs = table.replicas or [source]
        if str(source) not in {str(s) for s in specs}:
            raise RepairError(f"replica {source} is not in its own pool's replica table "
                              f"({', '.join(map(str, specs))}); promote from one of those")
        _refuse_destination(pool, hdr, force)
        others = [s for s in specs if str(s) != str(source)]
        specs_by_name = {str(s): s for s in specs}
        probes = [src_probe, *await _probe_reachable(others, token, timeout, wp, unreached or {})]
        seen = [hdr.epoch, *(p.epoch for p in probes if p.epoch is not None)]
        epoch = new_epoch(seen)
        # Fence first: once a replica recorded this claim, the old primary cannot write it.
        held = {str(source): position.decode(head[position.POSITION_OFF:])}
        try:
            claimed, unreachable = await _claim_others(others, probes[1:], token, epoch, who, timeout, held,
                                                       wp)
            with trio.fail_after(timeout):
                session, region = await _claim(source, token, epoch, who, timeout, wp, lanes=1)
            async with session:
                copied, compared, differing = await _copy(pool, hdr, session, region, force, progress,
                                                          timeout)
                if src_probe.resync is not None:
                    # Taken as it is (--unfinished-resync): the new primary holds the same
                    # bytes, so the source is in sync with it, mixed or not.
                    with trio.fail_after(timeout):
                        await session.mark_resync(region, False)
        except TransportError:
            # Fenced mid-way (the copy's registration taken away) by a takeover that won?
            await _check_still_held(specs, token, epoch, timeout, wp)
            raise
        # A takeover with a higher epoch may have come meanwhile: then it won, and this one
        # says so rather than hand the operator a primary whose mount would be refused.
        await _check_still_held([specs_by_name[s] for s in [str(source), *claimed]], token, epoch, timeout,
                                wp)
    except TransportError as exc:
        raise RepairError(f"promote stopped: {exc}") from None
    except trio.TooSlowError:
        raise RepairError(f"promote stopped: a replica did not answer within {timeout:g}s") from None
    _finish(pool, hdr, epoch, source, replicas)
    return {"pool": pool, "from": str(source), "epoch": show_epoch(epoch),
            "replicas": [str(s) for s in specs], "claimed": [str(source), *claimed],
            "unreachable": unreachable, "bytes_copied": copied, "chunks_compared": compared,
            "chunks_differing": differing, "behind": behind(str(source), held),
            "seconds": round(time.monotonic() - t0, 3)}


def behind(source: str, held: dict[str, position.Position | None]) -> dict[str, Any] | None:
    """How far the source was behind the most advanced replica reached (records and seconds
    of the primary's history), and where each stood; None when none holds a stamp (a pool
    replicated synchronously by a version that stamped no point)."""
    known = {spec: pos for spec, pos in held.items() if pos is not None}
    if not known:
        return None
    ahead_spec, ahead = max(known.items(), key=lambda kv: kv[1].seq)
    mine = known.get(source)
    return {"replicas": {spec: pos.as_dict() if pos else None for spec, pos in held.items()},
            "most_advanced": ahead_spec,
            "records": ahead.seq - mine.seq if mine else None,
            "seconds": round((ahead.time_ns - mine.time_ns) / 1e9, 3) if mine else None}


async def _probe_reachable(specs: list[ReplicaSpec], token: bytes | None, timeout: float,
                           wire_protection: str, unreached: Mapping[str, str]) -> list[Probe]:
    """probe_replicas, without waiting again for the replicas known to be out of reach."""
    asked = [s for s in specs if str(s) not in unreached]
    found = {str(p.spec): p for p in await probe_replicas(asked, token, timeout,
                                                          wire_protection=wire_protection)}
    return [found.get(str(s)) or Probe(s, error=unreached[str(s)]) for s in specs]


async def _check_still_held(specs: list[ReplicaSpec], token: bytes | None, epoch: int,
                            timeout: float, wire_protection: str) -> None:
    for p in await probe_replicas(specs, token, timeout, wire_protection=wire_protection):
        if p.error is None and p.epoch is not None and p.epoch > epoch:
            raise RepairError(f"another takeover won: replica {p.spec} is held by {p.owned_by()}")


async def _claim_others(specs: list[ReplicaSpec], probes: list[Probe], token: bytes | None, epoch: int,
                        who: dict[str, Any], timeout: float, held: dict[str, position.Position | None],
                        wire_protection: str) -> tuple[list[str], dict[str, str]]:
    claimed: list[str] = []
    unreachable: dict[str, str] = {}
    for spec, probe in zip(specs, probes, strict=True):
        if probe.error:
            unreachable[str(spec)] = probe.error
            continue
        try:
            with trio.fail_after(timeout):
                session, region = await _claim(spec, token, epoch, who, timeout, wire_protection, lanes=1)
                async with session:
                    raw = await session.lanes[0].read(region, position.POSITION_OFF, position.SIZE)
                held[str(spec)] = position.decode(raw)
        except trio.TooSlowError:
            unreachable[str(spec)] = f"replica {spec}: no answer within {timeout:g}s"
            continue
        except TransportError as exc:
            if not exc.lane_lost:
                raise  # a clean refusal: another takeover won, and the target says who
            unreachable[str(spec)] = f"replica {spec}: {exc}"
            continue
        claimed.append(str(spec))
    return claimed, unreachable


async def _copy(pool: str, hdr: Header, session: Session, region: RemoteRegion, force: bool,
                progress: Progress | None, timeout: float) -> tuple[int, int, int]:
    """Bring ``pool`` to the source's content: (bytes copied, chunks compared, chunks that
    differed before the copy; 0 for a fresh copy)."""
    incremental = os.path.exists(pool) and _same_pool(pool, hdr)
    if not incremental:
        make_destination(pool, hdr.pool_size, force)
    try:
        return await _copy_into(pool, hdr, session, region, incremental, progress, timeout)
    except BaseException:
        if not incremental:
            place.unmake(pool)  # half a pool is no pool: nothing is left to mistake for one
        raise


async def _copy_into(pool: str, hdr: Header, session: Session, region: RemoteRegion, incremental: bool,
                     progress: Progress | None, timeout: float) -> tuple[int, int, int]:
    limit = hdr.map_off
    chunk = chunk_of(hdr)  # the unit verify and sync count in too
    with PoolMapping.open(pool, "msync", exclusive=True, opener=safeopen.opener,
                          length=hdr.pool_size) as mapping:
        buf = mapping.buf
        if incremental:
            _, runs = await differing_chunks(session, region, buf, [(0, limit)], chunk,
                                             lambda n: None, timeout)
        else:
            runs = [(0, limit)]
        before = count_chunks(runs, chunk) if incremental else 0
        total = await read_runs(session.lanes[0], region, buf, runs, timeout, progress)
        mapping.persist(runs)
        compared, differing = await differing_chunks(session, region, buf, [(0, limit)], chunk,
                                                     lambda n: None, timeout)
        if differing:
            raise RepairError(f"the copy differs from the source in {len(differing)} ranges after "
                              "promote (was the source written meanwhile?)")
    return total, compared, before


def _finish(pool: str, hdr: Header, epoch: int, source: ReplicaSpec | None,
            replicas: Replicas | None = None) -> None:
    """The new epoch in the header, the replica table ``replicas`` when given, and the source
    (if any) in sync in a sync map under that epoch, every other replica compared in full."""
    with PoolMapping.open(pool, "msync", exclusive=True, opener=safeopen.opener) as mapping:
        promoted, _ = write_epoch(mapping.buf, hdr, epoch, mapping.persist)
        if replicas is not None:
            mapping.persist(write_table(mapping.buf, replicas[0], replicas[1]))
        mark_others_full(mapping, promoted, source)
        mapping.persist([(0, promoted.pool_size)])


async def takeover_in_place(pool: str, specs: list[ReplicaSpec], token: bytes | None, *,
                            token_file: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                            wire_protection: str = DEFAULT_PROTECTION,
                            unreached: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Promote the copy ``pool`` already holds (it is the most recent one: automatic failover,
    rpmemfs/ha), with ``specs`` as its replicas from now on: claim every reachable one as a
    takeover under an epoch above all seen, so that the old primary is fenced on each, then
    give the pool that epoch, the table ``specs`` and a sync map in which every replica is
    compared in full at the next mount. Nothing is copied. ``unreached`` as for promote_pool."""
    t0 = time.monotonic()
    who = holder(os.path.abspath(pool), command="promote")
    if who_has := busy(pool):
        raise RepairError(f"{pool} is in use ({who_has}): nothing was claimed")
    try:
        with PoolMapping.open(pool, "msync", readonly=True, opener=safeopen.opener) as pm:
            hdr, _ = read_header(pm.buf)
    except (PmemError, PoolFormatError, OSError) as exc:
        raise RepairError(f"{pool} holds no usable pool: {exc}; nothing was claimed") from None
    try:
        probes = await _probe_reachable(specs, token, timeout, wire_protection, unreached or {})
        epoch = new_epoch([hdr.epoch, *(p.epoch for p in probes if p.epoch is not None)])
        held: dict[str, position.Position | None] = {}
        claimed, unreachable = await _claim_others(specs, probes, token, epoch, who, timeout, held,
                                                   wire_protection)
        specs_by_name = {str(s): s for s in specs}
        await _check_still_held([specs_by_name[s] for s in claimed], token, epoch, timeout,
                                wire_protection)
    except TransportError as exc:
        raise RepairError(f"promote stopped: {exc}") from None
    except trio.TooSlowError:
        raise RepairError(f"promote stopped: a replica did not answer within {timeout:g}s") from None
    _finish(pool, hdr, epoch, None, (specs, token_file))
    return {"pool": pool, "from": pool, "epoch": show_epoch(epoch), "replicas": [str(s) for s in specs],
            "claimed": claimed, "unreachable": unreachable, "bytes_copied": 0,
            "seconds": round(time.monotonic() - t0, 3)}

