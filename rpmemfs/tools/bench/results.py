"""Everything one benchmark run found out, in a shape both the table and JSON use."""

from __future__ import annotations

from dataclasses import dataclass, field

from rpmemfs.tools.bench.stats import WorkloadResult


@dataclass
class Outcome:
    result: WorkloadResult | None = None
    error: str | None = None


@dataclass
class TargetStatus:
    available: bool
    error: str | None = None


@dataclass
class RunResult:
    machine: dict[str, str | int]
    config: dict[str, object]
    workdir: str
    workdir_fs: str
    targets: dict[str, TargetStatus] = field(default_factory=dict)
    # workload name -> target name -> outcome
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    # One-line description of each workload that ran, for the report.
    summaries: dict[str, str] = field(default_factory=dict)
    # 1/5/15-minute load averages at start and end: on a shared machine they say how
    # far the numbers can be trusted.
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
