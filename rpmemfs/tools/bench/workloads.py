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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns

from rpmemfs.tools.bench.cpu import ProcessTimes, busy_seconds, idle_share, processes_times, sample
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
    concurrent_seconds: float = 3.0

    @classmethod
    def quick(cls) -> Scale:
        return cls(ops=200, warmup=10, seq_bytes=32 * MIB, small_files=200, concurrent_seconds=0.5)


# What serves the directory a workload runs in, by role ("daemon", "target0", ...): pid.
Processes = Mapping[str, int]


@dataclass(frozen=True)
class Workload:
    name: str
    summary: str
    run: Callable[[Path, Scale, Processes], WorkloadResult]


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


def overwrite_fsync(directory: Path, scale: Scale, processes: Processes) -> WorkloadResult:
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


def append_fdatasync(directory: Path, scale: Scale, processes: Processes) -> WorkloadResult:
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


def warm_pages(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it again, so that what the next moments
    allocate is memory the guest holds. On VMs with free page reporting (Firecracker's
    page_reporting_order=11) memory that stayed free for a few seconds goes back to the host,
    and its next first touch faults into the host: the pool pages a sequential write fills
    then cost several times what they cost warm, in whichever round comes after a pause
    (docs/benchmarks.md, "Method")."""
    page = mmap.PAGESIZE
    with mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        for off in range(0, nbytes, page):
            m[off] = 1


def seq_write(directory: Path, scale: Scale, processes: Processes) -> WorkloadResult:
    fd = os.open(directory / "seq.dat", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    buf = os.urandom(SEQ_CHUNK)
    # Where the data lands (the pool, or the page cache) and each replica's copy: rounds
    # then compare, whatever ran before them.
    warm_pages(scale.seq_bytes * (1 + sum(role.startswith("target") for role in processes)))
    try:
        served_before, before = processes_times(processes), sample()
        t0 = perf_counter_ns()
        for off in range(0, scale.seq_bytes, SEQ_CHUNK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        elapsed_ns = perf_counter_ns() - t0
        after, served_after = sample(), processes_times(processes)
    finally:
        os.close(fd)
    seconds = elapsed_ns / 1e9
    megabytes = scale.seq_bytes / 1e6
    # CPU per MB, split as concurrent_fsync's per operation: what the goal's budget is
    # checked against (docs/benchmarks.md).
    per_mb = busy_seconds(before, after) * 1e6 / megabytes
    return WorkloadResult(
        metrics=[Metric("throughput", megabytes / seconds, "MB/s", "higher"),
                 Metric("cpu_per_mb", per_mb, "µs", "lower"),
                 *_cpu_split("mb", per_mb, megabytes, served_before, served_after)],
        details={"bytes": float(scale.seq_bytes), "seconds": seconds},
    )


def small_files(directory: Path, scale: Scale, processes: Processes) -> WorkloadResult:
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


def mmap_msync(directory: Path, scale: Scale, processes: Processes) -> WorkloadResult:
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


CONCURRENT_JOBS = (1, 4, 16)
CONCURRENT_FILE_SIZE = 4 * MIB


def _fsync_writer(path: Path, seconds: float, start_fd: int, out_fd: int) -> None:
    """One job of concurrent_fsync: 4 KiB pwrite + fsync at random offsets of its own file
    for ``seconds``, from when ``start_fd`` reads end of file; writes "ops seconds"."""
    fd = _preallocated(path, CONCURRENT_FILE_SIZE)
    offsets = _random_offsets(4096, CONCURRENT_FILE_SIZE)
    buf = os.urandom(BLOCK)
    os.read(start_fd, 1)  # every job starts at once: when the parent closes the pipe
    n = 0
    t0 = now = perf_counter_ns()
    end = t0 + int(seconds * 1e9)
    while now < end:
        os.pwrite(fd, buf, offsets[n % len(offsets)])
        os.fsync(fd)
        n += 1
        now = perf_counter_ns()
    os.close(fd)
    os.write(out_fd, f"{n} {(now - t0) / 1e9}\n".encode())


def fork_fsync_writers(paths: Sequence[Path], seconds: float) -> tuple[list[int], int]:
    """A forked :func:`_fsync_writer` per path, all let go at once; their pids, and the pipe's
    read end where each writes its "ops seconds" line (read to its end once they are done)."""
    start_r, start_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for path in paths:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(start_w)
                os.close(out_r)
                _fsync_writer(path, seconds, start_r, out_w)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(start_r)
    os.close(out_w)
    os.close(start_w)  # go
    return pids, out_r


def concurrent_fsync(directory: Path, scale: Scale, processes: Processes) -> WorkloadResult:
    """1, 4 and 16 processes at once, each doing 4 KiB pwrite + fsync on its own file: IOPS
    (what the daemon's one event loop sustains when durability points come in parallel).
    Plain fork, not multiprocessing: the bench runs each workload in a daemonic process."""
    metrics: list[Metric] = []
    details: dict[str, float] = {}
    cores = os.cpu_count() or 1
    for jobs in CONCURRENT_JOBS:
        served_before = processes_times(processes)
        before = sample()
        pids, out_r = fork_fsync_writers([directory / f"job{jobs}-{i}.dat" for i in range(jobs)],
                                         scale.concurrent_seconds)
        with os.fdopen(out_r) as out:
            lines = out.read().split("\n")
        failed = [pid for pid in pids if os.waitpid(pid, 0)[1]]
        after = sample()
        served_after = processes_times(processes)
        results = [(int(a), float(b)) for a, b in (ln.split() for ln in lines if ln.strip())]
        if failed or len(results) != jobs:
            raise RuntimeError(f"{len(failed)} of {jobs} concurrent_fsync jobs failed")
        ops = sum(n for n, _ in results)
        metrics.append(Metric(f"iops_{jobs}j", sum(n / secs for n, secs in results), "IOPS", "higher"))
        # What one write + fsync cost the whole machine, and the rate its cores would allow at
        # that cost: a goal above that ceiling needs less CPU per operation, not more threads.
        per_op = busy_seconds(before, after) * 1e6 / max(ops, 1)
        metrics.append(Metric(f"cpu_per_op_{jobs}j", per_op, "µs", "lower"))
        metrics.append(Metric(f"ceiling_{jobs}j", cores * 1e6 / per_op if per_op else 0.0, "IOPS", "higher"))
        metrics += _cpu_split(f"{jobs}j", per_op, ops, served_before, served_after)
        details[f"ops_{jobs}j"] = float(ops)
        details[f"busy_{jobs}j"] = 1.0 - idle_share(before, after)
    return WorkloadResult(metrics=metrics, details=details)


def _cpu_split(suffix: str, per_unit: float, units: float, before: dict[str, ProcessTimes],
               after: dict[str, ProcessTimes]) -> list[Metric]:
    """Where the CPU time of one unit of work (an operation, a MB) went, of the machine's
    ``per_unit`` µs: the daemon's Python and C (user) and the kernel's work it asked for
    (FUSE, TCP, waits), the target daemons together, and the rest (the programs and the
    kernel's work for them, anything else running): what a goal's budget is checked against
    (docs/benchmarks.md). Zero for a role the target does not have."""
    def us(seconds: float) -> float:
        return seconds * 1e6 / units if units else 0.0

    daemon_user = daemon_kernel = targets = 0.0
    for role, t in after.items():
        user, kernel = t.user - before[role].user, t.kernel - before[role].kernel
        if role == "daemon":
            daemon_user, daemon_kernel = us(user), us(kernel)
        else:
            targets += us(user + kernel)
    # Per-process and machine times are sampled in ticks apart: the rest can come out a tick
    # below zero on a short run.
    other = max(per_unit - daemon_user - daemon_kernel - targets, 0.0)
    return [Metric(f"cpu_daemon_user_{suffix}", daemon_user, "µs", "lower"),
            Metric(f"cpu_daemon_kernel_{suffix}", daemon_kernel, "µs", "lower"),
            Metric(f"cpu_targets_{suffix}", targets, "µs", "lower"),
            Metric(f"cpu_other_{suffix}", other, "µs", "lower")]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("overwrite_fsync", "4 KiB pwrite + fsync at random offsets of a 16 MiB file",
                 overwrite_fsync),
        Workload("append_fdatasync", "4 KiB O_APPEND write + fdatasync", append_fdatasync),
        Workload("seq_write", "1 MiB pwrite sequential, one fsync at the end", seq_write),
        Workload("small_files", "create + 4 KiB write + fsync + close, one directory",
                 small_files),
        Workload("mmap_msync", "4 KiB store + msync(MS_SYNC), 16 MiB MAP_SHARED file",
                 mmap_msync),
        Workload("concurrent_fsync", "1, 4 and 16 processes, each 4 KiB pwrite + fsync on its own "
                 "file: IOPS", concurrent_fsync),
    )
}
