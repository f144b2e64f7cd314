"""What the bench reports of the machine's CPU time (rpmemfs/tools/bench/cpu.py), and
concurrent_fsync's CPU per operation, ceiling and split by process, measured on a plain
directory (stand-in processes play the daemons)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpmemfs.tools.bench import cpu
from rpmemfs.tools.bench.workloads import CONCURRENT_JOBS, Scale, concurrent_fsync, seq_write

TICK = 1 / os.sysconf("SC_CLK_TCK")


def test_the_machine_counts_at_least_the_cpu_time_this_process_spent() -> None:
    before, own = cpu.sample(), time.process_time()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    spent = time.process_time() - own
    after = cpu.sample()
    # Ticks are sampled: allow two of them either side.
    assert cpu.busy_seconds(before, after) >= spent - 2 * TICK
    assert cpu.idle_share(before, after) <= 1 - (spent - 2 * TICK) / (0.3 * (os.cpu_count() or 1) + 4 * TICK)


def test_concurrent_fsync_reports_cpu_per_operation_within_what_the_machine_has(tmp_path: Path) -> None:
    start = time.monotonic()
    result = concurrent_fsync(tmp_path, Scale(concurrent_seconds=0.2), {})
    elapsed = time.monotonic() - start
    metrics = {m.name: m for m in result.metrics}
    cores = os.cpu_count() or 1
    busy = 0.0
    for jobs in CONCURRENT_JOBS:
        iops, per_op = metrics[f"iops_{jobs}j"].value, metrics[f"cpu_per_op_{jobs}j"].value
        assert metrics[f"cpu_per_op_{jobs}j"].better == "lower"
        assert iops > 0 and per_op > 0
        assert 0 < result.details[f"busy_{jobs}j"] <= 1
        assert metrics[f"ceiling_{jobs}j"].value == cores * 1e6 / per_op
        # Nothing serves a plain directory: all of it is the programs' (and the kernel's).
        assert metrics[f"cpu_daemon_user_{jobs}j"].value == 0
        assert metrics[f"cpu_targets_{jobs}j"].value == 0
        assert metrics[f"cpu_other_{jobs}j"].value == per_op
        busy += per_op * result.details[f"ops_{jobs}j"] / 1e6
    # All the CPU time it counted fits in what every core could give while it ran.
    assert busy <= cores * (elapsed + 4 * TICK)


# Stand-ins that burn CPU the whole time: one in user space, one in the kernel (reading
# /dev/zero into a buffer it already has is the kernel clearing memory).
USER_SPIN = "while True: pass"
KERNEL_SPIN = "f = open('/dev/zero', 'rb', buffering=0)\nb = bytearray(1 << 20)\nwhile True: f.readinto(b)"


@pytest.fixture
def spinners() -> Iterator[dict[str, int]]:
    procs = {role: subprocess.Popen([sys.executable, "-c", code])
             for role, code in (("daemon", USER_SPIN), ("target0", KERNEL_SPIN))}
    try:
        yield {role: p.pid for role, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_concurrent_fsync_splits_each_operations_cpu_over_the_processes_that_serve_it(
        tmp_path: Path, spinners: dict[str, int]) -> None:
    before = cpu.processes_times(spinners)
    result = concurrent_fsync(tmp_path, Scale(concurrent_seconds=0.2), spinners)
    after = cpu.processes_times(spinners)
    metrics = {m.name: m.value for m in result.metrics}
    daemon = targets = 0.0
    for jobs in CONCURRENT_JOBS:
        user, kernel = metrics[f"cpu_daemon_user_{jobs}j"], metrics[f"cpu_daemon_kernel_{jobs}j"]
        spent, other = metrics[f"cpu_targets_{jobs}j"], metrics[f"cpu_other_{jobs}j"]
        # The user-space spinner is the "daemon": its time is user time; the other one counts
        # as a target.
        assert user > kernel
        assert spent > 0
        assert other >= 0
        assert user + kernel + spent + other >= metrics[f"cpu_per_op_{jobs}j"] - 1e-6
        ops = result.details[f"ops_{jobs}j"]
        daemon += (user + kernel) * ops / 1e6
        targets += spent * ops / 1e6
    # What the phases counted is (nearly) all the spinners spent during the call, never more.
    for counted, role in ((daemon, "daemon"), (targets, "target0")):
        total = after[role].user + after[role].kernel - before[role].user - before[role].kernel
        assert 0.6 * total - 6 * TICK <= counted <= total + 6 * TICK


def test_seq_write_reports_cpu_per_megabyte_split_the_same_way(
        tmp_path: Path, spinners: dict[str, int]) -> None:
    # 256 MiB here too: 8 MiB once took less than one clock tick of CPU, counted as none.
    alone = {m.name: m.value for m in seq_write(tmp_path, Scale(seq_bytes=256 << 20), {}).metrics}
    assert alone["cpu_per_mb"] > 0
    assert alone["cpu_daemon_user_mb"] == alone["cpu_targets_mb"] == 0
    assert alone["cpu_other_mb"] == alone["cpu_per_mb"]
    # 256 MiB: a few tenths of a second, so that each spinner is counted some ticks.
    served = {m.name: m.value for m in seq_write(tmp_path, Scale(seq_bytes=256 << 20), spinners).metrics}
    assert served["cpu_daemon_user_mb"] > served["cpu_daemon_kernel_mb"]
    assert served["cpu_targets_mb"] > 0
    assert served["cpu_other_mb"] >= 0


def test_warm_pages_touches_all_the_memory_it_is_asked_for() -> None:
    """seq_write warms what its rounds will allocate: every page touched, so the process's
    peak resident size reaches its resident size before plus all of it (in KiB)."""
    code = ("import re, resource; from rpmemfs.tools.bench.workloads import warm_pages; "
            "now = int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1]); "
            "warm_pages(64 << 20); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - now)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= (64 << 20) // 1024 * 0.95
