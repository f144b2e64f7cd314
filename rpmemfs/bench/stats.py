"""What a workload reports, and how latency samples become numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Better = Literal["lower", "higher"]


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    better: Better


@dataclass
class WorkloadResult:
    metrics: list[Metric]
    # Extra numbers for the JSON output only, so the table stays readable.
    details: dict[str, float] = field(default_factory=dict)


def percentile(sorted_samples: list[int], pct: float) -> int:
    """Nearest-rank percentile: always a sample that was actually observed."""
    if not sorted_samples:
        raise ValueError("no samples")
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_samples)))
    return sorted_samples[rank - 1]


def latency_result(samples_ns: list[int]) -> WorkloadResult:
    ordered = sorted(samples_ns)
    to_us = 1e-3
    return WorkloadResult(
        metrics=[
            Metric("p50", percentile(ordered, 50) * to_us, "µs", "lower"),
            Metric("p99", percentile(ordered, 99) * to_us, "µs", "lower"),
        ],
        details={
            "ops": float(len(ordered)),
            "min_us": ordered[0] * to_us,
            "mean_us": sum(ordered) / len(ordered) * to_us,
            "p90_us": percentile(ordered, 90) * to_us,
            "p999_us": percentile(ordered, 99.9) * to_us,
            "max_us": ordered[-1] * to_us,
        },
    )
