"""What a workload reports, and how latency samples become numbers."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

T = TypeVar("T", int, float)

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


def percentile(sorted_samples: Sequence[T], pct: float) -> T:
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


def combine_rounds(rounds: list[WorkloadResult]) -> WorkloadResult:
    """The median of each number over repeated rounds.

    On a shared machine a burst of background load can spoil one round; the median
    keeps that round from deciding the result, where a mean or pooled samples would not.
    """
    if len(rounds) == 1:
        return rounds[0]
    first = rounds[0]
    metrics = [
        Metric(m.name, statistics.median(_metric_value(r, m.name) for r in rounds), m.unit,
               m.better)
        for m in first.metrics
    ]
    details = {key: statistics.median(r.details[key] for r in rounds) for key in first.details}
    details["rounds"] = float(len(rounds))
    for m in first.metrics:
        for i, r in enumerate(rounds):
            details[f"{m.name}_round{i + 1}"] = _metric_value(r, m.name)
    return WorkloadResult(metrics=metrics, details=details)


def _metric_value(result: WorkloadResult, name: str) -> float:
    return next(m.value for m in result.metrics if m.name == name)
