"""Comparing a pool with a replica by chunk checksums: only checksums cross the wire.

Each target computes a checksum (rpmemfs/chunksum.py: CRC-32, not the CRC-32C the pool's
structures carry) of consecutive chunks of its own copy (a control request; the
software form of the RDMA Verify operation the seeds describe) while the same is computed
here over the local pool, and the lists are compared (``differing_chunks``). A mounted pool's
verify and repair (live_verify.py) and resync (resync.py) compare this way, and so do the
offline commands (rpmemfs/admin/: verify, sync, recover, promote).

verify and sync count in one unit, the pool's chunk (:func:`pool_chunk`): 64 KiB, or the
sync map's chunk where that is larger, so "3 chunks differ" from verify and "3 chunks sent"
from sync speak of the same chunks (sync then sends only the blocks in them that differ, and
says how many bytes). Both reports name their counts alike (compared_chunks,
differing_chunks) and give the chunk size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rpmemfs.chunksum import chunk_sums
from rpmemfs.pool.header import read_header
from rpmemfs.pool.layout import Header, PoolFormatError
from rpmemfs.transport.base import DEFAULT_TIMEOUT, RemoteRegion, Session

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
            ours = await trio.to_thread.run_sync(chunk_sums, buf, off, length, chunk)
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
