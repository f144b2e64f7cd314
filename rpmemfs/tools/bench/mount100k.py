"""mount100k: how long `rpmemfs mount` takes on a pool holding many small files.

Mount time is the one cost that grows with the number of files rather than with the
I/O being done, so it gets its own (slow, opt-in) measurement.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
from pathlib import Path

from rpmemfs.tools.bench import note
from rpmemfs.tools.bench.isolate import Timeout
from rpmemfs.tools.bench.stats import Metric, WorkloadResult
from rpmemfs.tools.bench.targets import mkfs, rpmemfs_daemon
from rpmemfs.tools.processes import SpawnError, child_env, log_tail, rpmemfs_command, unmount

FILES_PER_DIR = 100
FILL_WORKERS = 3
# Creating files through a Python FUSE daemon costs around a millisecond each; this
# allows several times that before deciding the filesystem is stuck.
FILL_SECONDS_PER_FILE = 0.005


def _dir_name(index: int) -> str:
    return f"d{index:04d}"


def _file_name(index: int) -> str:
    return f"f{index:03d}"


def _fill_one_dir(job: tuple[str, int, int]) -> int:
    root, index, count = job
    directory = os.path.join(root, _dir_name(index))
    os.mkdir(directory)
    for i in range(count):
        fd = os.open(os.path.join(directory, _file_name(i)),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"%d/%d\n" % (index, i))
        finally:
            os.close(fd)
    return count


def _fill(mountpoint: Path, n_files: int, limit: float) -> float:
    jobs = [(str(mountpoint), d, min(FILES_PER_DIR, n_files - d * FILES_PER_DIR))
            for d in range((n_files + FILES_PER_DIR - 1) // FILES_PER_DIR)]
    start = time.perf_counter()
    deadline = start + limit
    done, next_report = 0, n_files // 10
    # A few processes, because the daemon can work while a client is in a syscall.
    with multiprocessing.get_context("fork").Pool(FILL_WORKERS) as pool:
        # chunksize 1: larger chunks return a plain generator without next(timeout).
        results = pool.imap_unordered(_fill_one_dir, jobs, chunksize=1)
        for _ in jobs:
            try:
                done += results.next(timeout=max(0.0, deadline - time.perf_counter()))
            except multiprocessing.TimeoutError:
                raise Timeout(f"creating {n_files:,} files took over {limit:.0f} s") from None
            if done >= next_report:
                note(f"mount100k: {done:,}/{n_files:,} files created")
                next_report += max(1, n_files // 10)
    return time.perf_counter() - start


def _wait_for_stat(path: Path, deadline: float) -> None:
    while True:
        try:
            os.stat(path)
            return
        except OSError:
            if time.perf_counter() >= deadline:
                raise
        time.sleep(0.001)


def measure_mount_time(workdir: Path, pool_size: str, n_files: int,
                       timeout: float) -> WorkloadResult:
    pool = workdir / "mount100k.pool"
    mountpoint = workdir / "mnt-mount100k"
    note(f"mount100k: mkfs {pool} --size {pool_size}")
    mkfs(pool, pool_size)
    fill_log = workdir / "mount100k-fill.log"
    with rpmemfs_daemon(pool, mountpoint, fill_log):
        try:
            create_seconds = _fill(mountpoint, n_files, 60.0 + n_files * FILL_SECONDS_PER_FILE)
        except (OSError, Timeout) as exc:
            raise SpawnError(f"creating the files failed: {exc}" + log_tail(fill_log)) from None
    note(f"mount100k: {n_files:,} files in {create_seconds:.1f} s; unmounted, now timing mount")

    probe = mountpoint / _dir_name(0) / _file_name(0)
    log = workdir / "mount100k-mount.log"
    with open(log, "wb") as log_file:
        start = time.perf_counter()
        # Background mode: the command itself returns once the mount is up.
        proc = subprocess.Popen(
            rpmemfs_command("mount", pool, mountpoint, "-o", "pmem=force"),
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=child_env(),
        )
    try:
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SpawnError(f"rpmemfs mount did not return within {timeout:.0f} s") from None
        returned = time.perf_counter()
        if status != 0:
            output = log.read_text(errors="replace").strip()
            raise SpawnError(f"rpmemfs mount exited with status {status}:\n  {output}")
        try:
            _wait_for_stat(probe, returned + timeout)
        except OSError as exc:
            raise SpawnError(f"mounted, but stat failed: {exc}" + log_tail(log)) from None
        answered = time.perf_counter()
    finally:
        unmount(mountpoint)

    note(f"mount100k: mounted and answering after {answered - start:.2f} s")
    return WorkloadResult(
        metrics=[Metric("mount", answered - start, "s", "lower")],
        details={
            "files": float(n_files),
            "create_seconds": create_seconds,
            "command_return_seconds": returned - start,
            "first_stat_seconds": answered - start,
        },
    )
