"""The workloads: each one runs in a directory and uses only ordinary syscalls.

Nothing here knows which filesystem it is on, so the same code measures rpmemfs, the
pass-through baseline and the plain directory. Setup (preallocation, page pre-faulting)
is kept out of the timed region; the durability call (fsync, fdatasync, msync) is always
inside it, because making data durable is what is being compared.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns

from rpmemfs.tools.bench.stats import Metric, WorkloadResult, latency_result

KIB = 1024
MIB = 1024 * KIB
BLOCK = 4 * KIB
MAPPED_FILE_SIZE = 16 * MIB
SEQ_CHUNK = MIB
# A fixed seed makes every target see the same offset sequence.
SEED = 20240601


@dataclass(frozen=True)
class Scale:
    ops: int = 2000
    warmup: int = 100
    seq_bytes: int = 256 * MIB
    small_files: int = 2000

    @classmethod
    def quick(cls) -> Scale:
        return cls(ops=200, warmup=10, seq_bytes=32 * MIB, small_files=200)


@dataclass(frozen=True)
class Workload:
    name: str
    summary: str
    run: Callable[[Path, Scale], WorkloadResult]


def _preallocated(path: Path, size: int) -> int:
    """An O_RDWR fd on a file whose blocks are all written and synced."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    chunk = b"\0" * SEQ_CHUNK
    for off in range(0, size, SEQ_CHUNK):
        os.pwrite(fd, chunk[: min(SEQ_CHUNK, size - off)], off)
    os.fsync(fd)
    return fd


def _random_offsets(count: int, size: int) -> list[int]:
    rng = random.Random(SEED)
    pages = size // BLOCK
    return [rng.randrange(pages) * BLOCK for _ in range(count)]


def overwrite_fsync(directory: Path, scale: Scale) -> WorkloadResult:
    fd = _preallocated(directory / "overwrite.dat", MAPPED_FILE_SIZE)
    buf = os.urandom(BLOCK)
    samples: list[int] = []
    try:
        for i, off in enumerate(_random_offsets(scale.warmup + scale.ops, MAPPED_FILE_SIZE)):
            t0 = perf_counter_ns()
            os.pwrite(fd, buf, off)
            os.fsync(fd)
            t1 = perf_counter_ns()
            if i >= scale.warmup:
                samples.append(t1 - t0)
    finally:
        os.close(fd)
    return latency_result(samples)


def append_fdatasync(directory: Path, scale: Scale) -> WorkloadResult:
    # O_APPEND as a log writer would do it: the filesystem picks the offset.
    fd = os.open(directory / "append.log",
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    buf = os.urandom(BLOCK)
    samples: list[int] = []
    try:
        for i in range(scale.warmup + scale.ops):
            t0 = perf_counter_ns()
            os.write(fd, buf)
            os.fdatasync(fd)
            t1 = perf_counter_ns()
            if i >= scale.warmup:
                samples.append(t1 - t0)
    finally:
        os.close(fd)
    return latency_result(samples)


def seq_write(directory: Path, scale: Scale) -> WorkloadResult:
    fd = os.open(directory / "seq.dat", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    buf = os.urandom(SEQ_CHUNK)
    try:
        t0 = perf_counter_ns()
        for off in range(0, scale.seq_bytes, SEQ_CHUNK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        elapsed_ns = perf_counter_ns() - t0
    finally:
        os.close(fd)
    seconds = elapsed_ns / 1e9
    return WorkloadResult(
        metrics=[Metric("throughput", scale.seq_bytes / 1e6 / seconds, "MB/s", "higher")],
        details={"bytes": float(scale.seq_bytes), "seconds": seconds},
    )


CONCURRENT_JOBS = 4


def concurrent_fsync(directory: Path, scale: Scale) -> WorkloadResult:
    """overwrite_fsync in CONCURRENT_JOBS threads at once, each on a file of its own: the
    rate they reach together (os.pwrite and os.fsync release the GIL)."""
    fds = [_preallocated(directory / f"job{j}.dat", MAPPED_FILE_SIZE // CONCURRENT_JOBS)
           for j in range(CONCURRENT_JOBS)]
    buf = os.urandom(BLOCK)
    offsets = _random_offsets(scale.warmup + scale.ops, MAPPED_FILE_SIZE // CONCURRENT_JOBS)
    errors: list[BaseException] = []

    def job(fd: int, part: list[int]) -> None:
        try:
            for off in part:
                os.pwrite(fd, buf, off)
                os.fsync(fd)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    def run_all(part: list[int]) -> int:
        threads = [threading.Thread(target=job, args=(fd, part)) for fd in fds]
        t0 = perf_counter_ns()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return perf_counter_ns() - t0

    try:
        run_all(offsets[: scale.warmup])
        elapsed_ns = run_all(offsets[scale.warmup :])
    finally:
        for fd in fds:
            os.close(fd)
    ops = CONCURRENT_JOBS * scale.ops
    seconds = elapsed_ns / 1e9
    return WorkloadResult(
        metrics=[Metric("iops", ops / seconds, "ops/s", "higher")],
        details={"ops": float(ops), "jobs": float(CONCURRENT_JOBS), "seconds": seconds},
    )


def small_files(directory: Path, scale: Scale) -> WorkloadResult:
    target = directory / "small"
    target.mkdir()
    buf = os.urandom(BLOCK)
    per_file: list[int] = []
    t_start = perf_counter_ns()
    for i in range(scale.small_files):
        t0 = perf_counter_ns()
        fd = os.open(target / f"f{i:06d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        per_file.append(perf_counter_ns() - t0)
    seconds = (perf_counter_ns() - t_start) / 1e9
    lat = latency_result(per_file)
    return WorkloadResult(
        metrics=[Metric("rate", scale.small_files / seconds, "files/s", "higher")],
        details={"files": float(scale.small_files), "seconds": seconds,
                 "p50_us": lat.metrics[0].value, "p99_us": lat.metrics[1].value},
    )


def mmap_msync(directory: Path, scale: Scale) -> WorkloadResult:
    fd = _preallocated(directory / "mapped.dat", MAPPED_FILE_SIZE)
    buf = os.urandom(BLOCK)
    samples: list[int] = []
    try:
        with mmap.mmap(fd, MAPPED_FILE_SIZE, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE) as mem:
            # Fault every page in first, so the timed stores measure the
            # store-and-sync path rather than first-touch reads of the file.
            for off in range(0, MAPPED_FILE_SIZE, BLOCK):
                mem[off]  # noqa: B018
            for i, off in enumerate(_random_offsets(scale.warmup + scale.ops, MAPPED_FILE_SIZE)):
                t0 = perf_counter_ns()
                mem[off:off + BLOCK] = buf
                mem.flush(off, BLOCK)  # msync(MS_SYNC)
                t1 = perf_counter_ns()
                if i >= scale.warmup:
                    samples.append(t1 - t0)
    finally:
        os.close(fd)
    return latency_result(samples)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("overwrite_fsync", "4 KiB pwrite + fsync at random offsets of a 16 MiB file",
                 overwrite_fsync),
        Workload("append_fdatasync", "4 KiB O_APPEND write + fdatasync", append_fdatasync),
        Workload("seq_write", "1 MiB pwrite sequential, one fsync at the end", seq_write),
        Workload("concurrent_fsync", f"overwrite_fsync in {CONCURRENT_JOBS} threads, a file each: "
                 "the rate together", concurrent_fsync),
        Workload("small_files", "create + 4 KiB write + fsync + close, one directory",
                 small_files),
        Workload("mmap_msync", "4 KiB store + msync(MS_SYNC), 16 MiB MAP_SHARED file",
                 mmap_msync),
    )
}
