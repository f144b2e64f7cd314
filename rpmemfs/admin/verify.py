"""`rpmemfs verify POOL`: every replica of an unmounted pool compared with it, in parallel.

Only checksums cross the wire (replica/verify.py: each target computes them over its own
copy). The pool must not be mounted: a live mount writes into its pool before the fsync that
would make a replica catch up, so the two legitimately differ until then; its daemon verifies
it instead (replica/live_verify.py), in a report of the same form, which ``format_report``
prints for either.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.verify import (
    ReplicaReport,
    VerifyReport,
    content_size,
    count_chunks,
    differing_chunks,
    pool_chunk,
)
from rpmemfs.transport.base import DEFAULT_TIMEOUT, TransportError
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.units import count


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
