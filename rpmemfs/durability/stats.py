"""Counters of durability points that `rpmemfs status` and the metrics show."""

from __future__ import annotations

import time
from collections import deque

from rpmemfs.latency import Histogram


class Stats:
    def __init__(self) -> None:
        self.fsyncs = 0
        self.latencies: deque[int] = deque(maxlen=20000)  # ns, the latest points only
        self.started = time.time()
        self.histogram = Histogram()  # every point since the mount, for the metrics

    def add(self, ns: int) -> None:
        self.fsyncs += 1
        self.latencies.append(ns)
        self.histogram.observe_ns(ns)

    def percentiles(self) -> dict[str, float]:
        """p50 and p99 in microseconds."""
        if not self.latencies:
            return {"p50": 0.0, "p99": 0.0}
        s = sorted(self.latencies)
        return {"p50": s[len(s) // 2] / 1000, "p99": s[min(len(s) - 1, len(s) * 99 // 100)] / 1000}
