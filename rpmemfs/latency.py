"""A latency histogram cheap enough for the fsync path: fixed buckets, integer counts.

`rpmemfs status` shows percentiles and Prometheus wants cumulative buckets; both read these
counts. Observing is one bisect and two additions (no lock: it is only ever observed and
read on the daemon's own trio thread; the metrics server asks that thread for a copy).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Upper bounds in seconds: 10 us to 10 s, about three per decade (what an fsync on pmem, on a
# loopback replica, a distant one, and one that waits out a replica timeout take).
BOUNDS_S = (10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3,
            50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_BOUNDS_NS = tuple(round(b * 1e9) for b in BOUNDS_S)


@dataclass(frozen=True)
class Snapshot:
    buckets: tuple[int, ...]  # cumulative counts, one per bound in BOUNDS_S, then +Inf
    sum_s: float
    count: int


class Histogram:
    def __init__(self) -> None:
        self._counts = [0] * (len(_BOUNDS_NS) + 1)
        self._sum_ns = 0
        self.count = 0

    def observe_ns(self, ns: int) -> None:
        self._counts[bisect.bisect_left(_BOUNDS_NS, ns)] += 1
        self._sum_ns += ns
        self.count += 1

    def snapshot(self) -> Snapshot:
        cumulative: list[int] = []
        total = 0
        for c in self._counts:
            total += c
            cumulative.append(total)
        return Snapshot(tuple(cumulative), self._sum_ns / 1e9, self.count)


def bucket_quantile(buckets: tuple[int, ...] | list[int], q: float) -> float | None:
    """The upper bound in seconds of the bucket holding the ``q`` quantile (inf past the last
    bound), from cumulative counts as in Snapshot; None when nothing was observed."""
    if not buckets or not buckets[-1]:
        return None
    rank = q * buckets[-1]
    for bound, count in zip((*BOUNDS_S, float("inf")), buckets, strict=False):
        if count >= rank:
            return bound
    return float("inf")
