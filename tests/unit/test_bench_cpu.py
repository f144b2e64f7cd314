"""What the bench reports of the machine's CPU time (rpmemfs/tools/bench/cpu.py), and
concurrent_fsync's CPU per operation and ceiling, measured on a plain directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rpmemfs.tools.bench import cpu
from rpmemfs.tools.bench.workloads import CONCURRENT_JOBS, Scale, concurrent_fsync

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
    result = concurrent_fsync(tmp_path, Scale(concurrent_seconds=0.2))
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
        busy += per_op * result.details[f"ops_{jobs}j"] / 1e6
    # All the CPU time it counted fits in what every core could give while it ran.
    assert busy <= cores * (elapsed + 4 * TICK)
