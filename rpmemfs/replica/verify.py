"""Compare a pool with its replicas by chunk checksums: only checksums cross the wire.

Each target computes CRC-32C of consecutive chunks of its own copy (a control request; the
software form of the RDMA Verify operation the seeds describe) while the same is computed
here over the local pool, and the lists are compared. The pool must not be mounted: a live
mount writes into its pool before the fsync that would make a replica catch up, so the two
legitimately differ until then (live_verify.py compares a mounted pool).

verify and sync count in one unit, the pool's chunk (:func:`pool_chunk`): 64 KiB, or the
sync map's chunk where that is larger, so "3 chunks differ" from verify and "3 chunks sent"
from sync speak of the same chunks (sync then sends only the blocks in them that differ, and
says how many bytes). Both reports name their counts alike (compared_chunks,
differing_chunks) and give the chunk size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rpmemfs.native import crc32c
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import Header, PoolFormatError
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.transport.base import DEFAULT_TIMEOUT, RemoteRegion, Session, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.units import count

# The chunk pools are compared in, at least: a checksum per 64 KiB keeps a whole-pool compare
# cheap (a 2 GiB pool in under a second) where the sync map has a bit per 4 KiB block.
COMPARE_CHUNK = 64 << 10
# Chunks asked for per request (the target answers at most MAX_CHUNKS, 4096): 64 MiB of a
# pool of up to 4 GiB per round trip, a reply of ~11 KB, and progress that still moves.
CHUNKS_PER_REQUEST = 1024


def chunk_of(hdr: Header) -> int:
    """The chunk verify and sync count in: COMPARE_CHUNK, or the sync map's where it is
    larger (pools above 1 TiB; pools made before blocks were the map's chunk, above 4 GiB)."""
    return max(hdr.map_chunk, COMPARE_CHUNK)


def pool_chunk(buf: memoryview) -> int:
    """:func:`chunk_of` the pool in ``buf`` (COMPARE_CHUNK when its header is unreadable)."""
    try:
        return chunk_of(read_header(buf)[0])
    except PoolFormatError:
        return COMPARE_CHUNK


def count_chunks(runs: list[tuple[int, int]], chunk: int) -> int:
    """Chunks in merged runs of whole chunks (the pool's last chunk may be short)."""
    return sum(-(-n // chunk) for _, n in runs)


def chunks_touched(runs: list[tuple[int, int]], chunk: int) -> int:
    """Chunks that sorted, merged runs of any length have bytes in."""
    count, last = 0, -1
    for off, n in runs:
        first, end = off // chunk, (off + n - 1) // chunk
        count += end - max(first, last + 1) + 1 if end > last else 0
        last = max(last, end)
    return count


@dataclass
class ReplicaReport:
    replica: str
    error: str | None = None
    compared_chunks: int = 0
    differing_chunks: int = 0
    differing: list[tuple[int, int]] = field(default_factory=list)  # (offset, length)

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "error": self.error,
            "compared_chunks": self.compared_chunks,
            "differing_chunks": self.differing_chunks,
            "differing": [{"offset": o, "length": n} for o, n in self.differing],
        }


@dataclass
class VerifyReport:
    pool: str
    size: int
    chunk: int
    seconds: float = 0.0
    replicas: list[ReplicaReport] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return all(r.error is None and not r.differing for r in self.replicas)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool, "size": self.size, "chunk": self.chunk, "clean": self.clean,
            "seconds": round(self.seconds, 3), "replicas": [r.as_dict() for r in self.replicas],
        }


def report_from_dict(doc: dict[str, Any]) -> VerifyReport:
    """A report as a mount's daemon sent it over its control socket."""
    report = VerifyReport(doc["pool"], doc["size"], doc["chunk"], doc["seconds"])
    for r in doc["replicas"]:
        report.replicas.append(ReplicaReport(r["replica"], r["error"], r["compared_chunks"],
                                             r["differing_chunks"],
                                             [(d["offset"], d["length"]) for d in r["differing"]]))
    return report


def local_crcs(buf: memoryview, offset: int, length: int, chunk: int) -> list[int]:
    return [crc32c(buf[p : min(p + chunk, offset + length)]) for p in range(offset, offset + length, chunk)]


async def differing_chunks(
    session: Session, region: RemoteRegion, buf: memoryview, spans: list[tuple[int, int]], chunk: int,
    progress: Callable[[int], None], timeout: float = DEFAULT_TIMEOUT,
) -> tuple[int, list[tuple[int, int]]]:
    """(chunks compared, merged (offset, length) runs that differ) within ``spans``."""
    runs: list[tuple[int, int]] = []
    count = 0
    step = chunk * CHUNKS_PER_REQUEST
    for first, span in spans:
        end = first + span
        for off in range(first, end, step):
            length = min(step, end - off)
            with trio.fail_after(timeout):
                theirs = await session.checksum(region, off, length, chunk)
            ours = await trio.to_thread.run_sync(local_crcs, buf, off, length, chunk)
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                if a != b:
                    start = off + i * chunk
                    n = min(chunk, end - start)
                    if runs and runs[-1][0] + runs[-1][1] == start:
                        runs[-1] = (runs[-1][0], runs[-1][1] + n)
                    else:
                        runs.append((start, n))
            count += len(ours)
            progress(length)
    return count, runs


def content_size(buf: memoryview) -> int:
    """What replicas hold of a pool: all of it but the node-local sync map."""
    try:
        return read_header(buf)[0].map_off
    except PoolFormatError:
        return len(buf)


async def verify_replica(
    spec: ReplicaSpec, buf: memoryview, token: bytes | None, chunk: int,
    progress: Callable[[int], None], timeout: float = DEFAULT_TIMEOUT,
    wire_protection: str = DEFAULT_PROTECTION,
) -> ReplicaReport:
    report = ReplicaReport(str(spec))
    size = len(buf)
    try:
        async with await transport_for("tcp", wire_protection=wire_protection).connect(
                spec.address, token, lanes=0, timeout=timeout) as session:
            region = await session.open_pool(spec.name)
            if region.size != size:
                report.error = f"remote pool is {region.size} bytes, the local pool {size}"
                return report
            report.compared_chunks, report.differing = await differing_chunks(
                session, region, buf, [(0, content_size(buf))], chunk, progress, timeout)
            report.differing_chunks = count_chunks(report.differing, chunk)
    except TransportError as exc:
        report.error = str(exc)
    except trio.TooSlowError:
        report.error = f"no checksum reply within {timeout:g}s"
    return report


async def verify(pool: str, buf: memoryview, specs: list[ReplicaSpec], token: bytes | None,
                 chunk: int | None = None, progress: Callable[[int], None] = lambda _n: None,
                 wire_protection: str = DEFAULT_PROTECTION) -> VerifyReport:
    """Every replica compared with the local pool, in parallel, by chunks of ``chunk`` bytes
    (default: the pool's chunk, the one sync counts in); ``progress`` is told the bytes
    compared as they are, content_size(buf) per replica in all."""
    chunk = chunk or pool_chunk(buf)
    report = VerifyReport(pool, len(buf), chunk)
    t0 = time.monotonic()
    results: dict[int, ReplicaReport] = {}

    async def one(i: int, spec: ReplicaSpec) -> None:
        results[i] = await verify_replica(spec, buf, token, chunk, progress,
                                          wire_protection=wire_protection)

    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(specs):
            nursery.start_soon(one, i, spec)
    report.replicas = [results[i] for i in range(len(specs))]
    report.seconds = time.monotonic() - t0
    return report


def format_report(report: VerifyReport) -> str:
    lines = [f"verify of {report.pool}: {report.size} bytes, chunks of {report.chunk} bytes, "
             f"{count(len(report.replicas), 'replica')}, {report.seconds:.2f} s"]
    for r in report.replicas:
        if r.error:
            lines.append(f"  {r.replica}: NOT VERIFIED: {r.error}")
        elif not r.differing:
            lines.append(f"  {r.replica}: identical, {count(r.compared_chunks, 'chunk')} compared")
        else:
            total = sum(n for _, n in r.differing)
            lines.append(f"  {r.replica}: DIFFERS: {count(r.compared_chunks, 'chunk')} compared, "
                         f"{r.differing_chunks} differing ({count(len(r.differing), 'range')}, "
                         f"{total} bytes):")
            lines += [f"    offset {o} length {n}" for o, n in r.differing[:50]]
            if len(r.differing) > 50:
                lines.append(f"    ... {len(r.differing) - 50} more")
    lines.append("clean" if report.clean else "NOT CLEAN")
    return "\n".join(lines)
