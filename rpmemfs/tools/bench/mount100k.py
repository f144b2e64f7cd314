"""mount100k: how long `rpmemfs mount` and `rpmemfs umount` take on a pool holding many
small files, after a clean unmount and after kill -9.

Mount time is the one cost that grows with the number of files rather than with the I/O
being done, so it gets its own (slow, opt-in) measurement. The files are made in-process
(populate.py), leaving the log as a daemon killed right after making them would; then, each
a real `rpmemfs mount` process serving a real FUSE mount, timed until a stat of a file in
it answers:

1. the mount after that kill (it replays the whole log tail, and checkpoints);
2. kill -9 of that idle daemon, and the mount after it (the tail is gone now);
3. `rpmemfs umount` of it, timed until the command returns (the pool is closed then);
4. the mount after that clean unmount (the "mount" metric, as before);
5. a thousand files created through it with an fsync each, then `rpmemfs umount` again.

Each also as the daemon's CPU time (``*_cpu``): until the stat answered, or from the umount
until the daemon exited.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from rpmemfs.tools.bench.cpu import process_times
from rpmemfs.tools.bench.notes import note
from rpmemfs.tools.bench.populate import dir_name, file_name, populate
from rpmemfs.tools.bench.stats import Metric, WorkloadResult
from rpmemfs.tools.bench.targets import mkfs
from rpmemfs.tools.processes import MountProcess, SpawnError, detach, log_tail, run_rpmemfs

# What a pool needs per small file: its data block, and room for its share of the snapshot
# (about 130 bytes) in a log area (1/32 of the pool) that a snapshot may fill to 60%.
POOL_BYTES_PER_FILE = 4096 + 130 * 32 * 10 // 6
WRITES_BEFORE_UMOUNT = 1000


def pool_size_for(n_files: int, asked: str) -> str:
    """``asked`` (an mkfs size), or a size in MiB big enough for n_files small files."""
    need = (64 << 20) + n_files * POOL_BYTES_PER_FILE
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(asked[-1:].upper(), 1)
    try:
        given = int(float(asked.rstrip("kKmMgGtT")) * scale)
    except ValueError:
        return asked  # mkfs says what is wrong with it
    return asked if given >= need else f"{(need + (1 << 20) - 1) >> 20}M"


class Timed:
    """One mount of the pool, timed from the daemon's start until a stat answers. Beside
    the wall time it takes the daemon's CPU time (``cpu``), which a busy machine stretches
    far less: the wall times of these runs swing by 2x on a shared 2-core machine."""

    cpu = 0.0  # CPU seconds of the daemon for the last mount or umount

    def __init__(self, pool: Path, mountpoint: Path, log: Path, timeout: float) -> None:
        self.daemon = MountProcess.rpmemfs(pool, mountpoint, "pmem=force", log_path=log)
        self.probe = mountpoint / dir_name(0) / file_name(0)
        self.timeout = timeout

    def mount(self) -> float:
        start = time.perf_counter()
        proc = self.daemon.spawn()
        deadline = start + self.timeout
        while True:
            try:
                os.stat(self.probe)
                took = time.perf_counter() - start
                self.cpu = process_times(proc.pid).total
                return took
            except OSError:
                pass
            if proc.poll() is not None:
                raise SpawnError(f"rpmemfs mount exited with status {proc.returncode}"
                                 + log_tail(self.daemon.log_path))
            if time.perf_counter() > deadline:
                self.daemon.stop()
                raise SpawnError(f"no stat answered {self.timeout:.0f} s after starting "
                                 "rpmemfs mount" + log_tail(self.daemon.log_path))
            time.sleep(0.002)

    def status(self) -> dict[str, Any]:
        done = run_rpmemfs("status", "--json", self.daemon.mountpoint)
        st: dict[str, Any] = json.loads(done.stdout)
        return st

    def kill9(self) -> None:
        self.daemon.kill()
        detach(self.daemon.mountpoint)

    def umount(self) -> float:
        assert self.daemon.proc is not None
        pid = self.daemon.proc.pid
        before = process_times(pid).total
        start = time.perf_counter()
        run_rpmemfs("umount", self.daemon.mountpoint, timeout=self.timeout)
        took = time.perf_counter() - start
        # Reaped here for its rusage (Popen takes a vanished child as exited with status 0).
        _pid, _status, usage = os.wait4(pid, 0)
        self.cpu = usage.ru_utime + usage.ru_stime - before
        self.daemon.wait(self.timeout)
        return took


def _write_files(mountpoint: Path, n: int) -> None:
    directory = mountpoint / "written"
    directory.mkdir()
    for i in range(n):
        fd = os.open(directory / f"w{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"%d\n" % i)
            os.fsync(fd)
        finally:
            os.close(fd)


def measure_mount_time(workdir: Path, pool_size: str, n_files: int,
                       timeout: float) -> WorkloadResult:
    pool = workdir / "mount100k.pool"
    size = pool_size_for(n_files, pool_size)
    note(f"mount100k: mkfs {pool} --size {size}")
    mkfs(pool, size)
    create_seconds = populate(pool, n_files)
    note(f"mount100k: {n_files:,} files made in-process in {create_seconds:.1f} s; timing mounts")
    timed = Timed(pool, workdir / "mnt-mount100k", workdir / "mount100k-mount.log", timeout)
    details: dict[str, float] = {"files": float(n_files), "create_seconds": create_seconds}
    cpu: dict[str, float] = {}
    try:
        after_kill = timed.mount()
        cpu["mount_after_kill"] = timed.cpu
        replay = timed.status()["replay"]
        # (.get: a tree from before status showed the tail is measured by this tool too)
        details |= {"replayed_records_after_kill": replay["records"],
                    "tail_records_after_kill": replay.get("tail_records", -1)}
        timed.kill9()
        after_second_kill = timed.mount()
        cpu["mount_after_second_kill"] = timed.cpu
        details["tail_records_after_second_kill"] = timed.status()["replay"].get("tail_records", -1)
        umount_idle = timed.umount()
        cpu["umount"] = timed.cpu
        clean = timed.mount()
        cpu["mount"] = timed.cpu
        _write_files(timed.daemon.mountpoint, WRITES_BEFORE_UMOUNT)
        umount_written = timed.umount()
        cpu["umount_after_writes"] = timed.cpu
    except (OSError, subprocess.SubprocessError, KeyError, ValueError) as exc:
        raise SpawnError(f"mount100k: {exc}" + log_tail(timed.daemon.log_path)) from None
    finally:
        timed.daemon.stop()
    note(f"mount100k: mount {clean:.2f} s after a clean unmount, {after_kill:.2f} s after "
         f"kill -9 (tail of {details['tail_records_after_kill']:.0f} records), "
         f"{after_second_kill:.2f} s after a second one; umount {umount_idle:.2f} s idle, "
         f"{umount_written:.2f} s after {WRITES_BEFORE_UMOUNT} fsynced files; daemon CPU: "
         + ", ".join(f"{k} {v:.2f} s" for k, v in cpu.items()))
    return WorkloadResult(
        metrics=[Metric("mount", clean, "s", "lower"),
                 Metric("mount_after_kill", after_kill, "s", "lower"),
                 Metric("mount_after_second_kill", after_second_kill, "s", "lower"),
                 Metric("umount", umount_idle, "s", "lower"),
                 Metric("umount_after_writes", umount_written, "s", "lower"),
                 *(Metric(f"{name}_cpu", seconds, "s", "lower") for name, seconds in cpu.items())],
        details=details,
    )
