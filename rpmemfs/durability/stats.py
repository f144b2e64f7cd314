"""Counters of durability points that `rpmemfs status` shows."""

from __future__ import annotations

import time
from collections import deque


class Stats:
    def __init__(self) -> None:
        self.fsyncs = 0
        self.latencies: deque[int] = deque(maxlen=20000)  # ns, the latest points only
        self.started = time.time()

    def add(self, ns: int) -> None:
        self.fsyncs += 1
        self.latencies.append(ns)

    def percentiles(self) -> dict[str, float]:
        """p50 and p99 in microseconds."""
        if not self.latencies:
            return {"p50": 0.0, "p99": 0.0}
        s = sorted(self.latencies)
        return {"p50": s[len(s) // 2] / 1000, "p99": s[min(len(s) - 1, len(s) * 99 // 100)] / 1000}
