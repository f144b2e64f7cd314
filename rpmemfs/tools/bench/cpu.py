"""The whole machine's CPU time (/proc/stat), for what one operation costs all of it.

A replicated fsync costs CPU in the program, the kernel's FUSE and TCP paths, the mount
daemon and every target daemon; on a machine that runs them all (the bench's loopback
targets), the rate a workload can reach is at most the machine's cores divided by that
cost, however the work is spread over threads and processes. The bench reports the cost so
that a goal can be checked against that ceiling in the same run (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    idle: int  # ticks idle or waiting for I/O, all CPUs together
    total: int  # all ticks, all CPUs together


def sample() -> Sample:
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return Sample(ticks[3] + ticks[4], sum(ticks))


def busy_seconds(before: Sample, after: Sample) -> float:
    """CPU seconds the machine spent busy between two samples (all CPUs together)."""
    busy = (after.total - before.total) - (after.idle - before.idle)
    return busy / os.sysconf("SC_CLK_TCK")


def idle_share(before: Sample, after: Sample) -> float:
    """The fraction of the machine's CPU time between two samples that was idle."""
    return (after.idle - before.idle) / max(after.total - before.total, 1)


@dataclass(frozen=True)
class ProcessTimes:
    user: float  # seconds
    kernel: float  # seconds

    @property
    def total(self) -> float:
        return self.user + self.kernel


def process_times(pid: int) -> ProcessTimes:
    """A process's CPU time so far, all its threads (/proc/PID/stat: utime, stime)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        # The command name may hold spaces, parentheses, any byte: fields count from its end.
        fields = f.read().rsplit(b")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return ProcessTimes(int(fields[11]) / tick, int(fields[12]) / tick)


def processes_times(pids: Mapping[str, int]) -> dict[str, ProcessTimes]:
    return {role: process_times(pid) for role, pid in pids.items()}
