"""Turns a RunResult into the printed table and the JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rpmemfs import safeopen
from rpmemfs.tools.bench.machine import one_line
from rpmemfs.tools.bench.results import Outcome, RunResult
from rpmemfs.tools.bench.stats import Metric
from rpmemfs.tools.bench.targets import (
    PASSTHROUGH,
    PASSTHROUGH_XATTR,
    PLAIN,
    RPMEMFS,
    RPMEMFS_1REP,
    RPMEMFS_1REP_PLAIN,
    RPMEMFS_2REP,
    RPMEMFS_2REP_ASYNC,
    RPMEMFS_NOPOLL,
    RPMEMFS_NOXATTR,
    RPMEMFS_WBCACHE,
    TARGET_NAMES,
    TARGET_SUMMARIES,
)


@dataclass(frozen=True)
class Ratio:
    numerator: str
    denominator: str
    meaning: str

    @property
    def label(self) -> str:
        return f"{self.numerator}/{self.denominator}"


# The first two are the like-for-like comparisons: the kernel sends the same requests
# to both sides, so what is left is rpmemfs's own work. The plain ratios show how much
# of everything FUSE and Python take, which is needed to read the other two.
RATIOS = (
    Ratio(RPMEMFS, PASSTHROUGH_XATTR, "both offer xattrs (GETXATTR before every write)"),
    Ratio(RPMEMFS_NOXATTR, PASSTHROUGH, "neither offers xattrs (no GETXATTR)"),
    Ratio(RPMEMFS_WBCACHE, RPMEMFS, "what the kernel writeback cache changes"),
    Ratio(RPMEMFS_NOXATTR, RPMEMFS_NOPOLL, "what polling /dev/fuse after each request changes"),
    Ratio(RPMEMFS_1REP, RPMEMFS, "what 1 replica costs (rpmemfs alone has 0)"),
    Ratio(RPMEMFS_2REP, RPMEMFS, "what 2 replicas cost (rpmemfs alone has 0)"),
    Ratio(RPMEMFS_2REP_ASYNC, RPMEMFS, "what 2 replicas cost with replication=async (issue 18: >= 0.95 "
          "in IOPS at 4 and 16 jobs)"),
    Ratio(RPMEMFS_1REP, RPMEMFS_1REP_PLAIN, "what wire protection costs (1 replica, sealed over plaintext)"),
    Ratio(RPMEMFS, PLAIN, "rpmemfs against the bare backing directory"),
    Ratio(PASSTHROUGH, PLAIN, "what FUSE + Python cost by themselves"),
)

LEGEND = (
    "ratios are A/B of the metric itself: for 'lower' metrics (latency, time) a ratio "
    "below 1 means A is faster;\nfor 'higher' metrics (throughput, rate) a ratio above 1 "
    "means A is faster. 1 MB = 10^6 bytes."
)


def _columns(run: RunResult) -> list[str]:
    """The targets that were brought up (or tried to be), plus any that reported
    without that: mount100k measures rpmemfs on its own."""
    wanted = set(run.targets)
    wanted.update(t for row in run.outcomes.values() for t in row)
    return [t for t in TARGET_NAMES if t in wanted]


def _ratios_for(columns: list[str]) -> list[Ratio]:
    return [r for r in RATIOS if r.numerator in columns and r.denominator in columns]


def _metrics_of(row: dict[str, Outcome]) -> list[Metric]:
    for outcome in row.values():
        if outcome.result is not None:
            return outcome.result.metrics
    return []


def _value(row: dict[str, Outcome], target: str, metric: str) -> float | None:
    outcome = row.get(target)
    if outcome is None or outcome.result is None:
        return None
    for m in outcome.result.metrics:
        if m.name == metric:
            return m.value
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _cell(run: RunResult, row: dict[str, Outcome], target: str, metric: str) -> str:
    value = _value(row, target, metric)
    if value is not None:
        return _number(value)
    if target in row:
        return "error"
    status = run.targets.get(target)
    return "n/a" if status is not None and not status.available else "-"


def _scale_line(run: RunResult) -> str:
    scale = run.config["scale"]
    assert isinstance(scale, dict)
    kind = "quick run" if run.config["quick"] else "full run"
    rounds = run.config["rounds"]
    return (f"{kind}: {scale['ops']} ops after {scale['warmup']} warm-up, "
            f"{scale['seq_bytes'] // 2**20} MiB sequential, {scale['small_files']} small files; "
            f"median of {rounds} round{'s' if rounds != 1 else ''}; "
            f"rpmemfs pool {run.config['pool_size']}")


def _load_line(run: RunResult) -> str:
    def shown(load: tuple[float, float, float] | None) -> str:
        return "?" if load is None else " ".join(f"{x:.2f}" for x in load)

    return (f"load average (1/5/15 min): {shown(run.load_before)} before, "
            f"{shown(run.load_after)} after, on {run.machine['cores']} cores")


def _table(header: list[str], rows: list[list[str]], numeric_from: int) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        out = [cell.ljust(widths[c]) if c < numeric_from else cell.rjust(widths[c])
               for c, cell in enumerate(cells)]
        return "  ".join(out).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def render(run: RunResult) -> str:
    columns = _columns(run)
    ratios = _ratios_for(columns)
    value_rows: list[list[str]] = []
    ratio_rows: list[list[str]] = []
    for wname, row in run.outcomes.items():
        metrics = _metrics_of(row)
        for i, m in enumerate(metrics):
            label = [wname if i == 0 else "", m.name]
            value_rows.append([*label, m.unit, m.better,
                               *(_cell(run, row, t, m.name) for t in columns)])
            cells = [*label, m.better]
            for r in ratios:
                q = _ratio(_value(row, r.numerator, m.name), _value(row, r.denominator, m.name))
                cells.append("-" if q is None else f"{q:.2f}x")
            if any(c != "-" for c in cells[3:]):
                ratio_rows.append(cells)
        if not metrics:
            value_rows.append([wname, "(no result)", "", "",
                               *(_cell(run, row, t, "") for t in columns)])

    lines = [one_line(run.machine),
             f"work dir: {run.workdir} ({run.workdir_fs})",
             _scale_line(run),
             _load_line(run),
             "",
             *_table(["workload", "metric", "unit", "better", *columns], value_rows, 4)]
    if ratios and ratio_rows:
        lines += ["",
                  *_table(["workload", "metric", "better", *(r.label for r in ratios)],
                          ratio_rows, 3),
                  "",
                  LEGEND]
        lines += [f"  {r.label}: {r.meaning}" for r in ratios]
    lines.append("targets:")
    lines += [f"  {t}: {TARGET_SUMMARIES[t]}" for t in columns]
    lines.append("workloads:")
    for wname in run.outcomes:
        lines.append(f"  {wname}: {run.summaries.get(wname, '')}")
    for name, status in run.targets.items():
        if not status.available:
            lines.append(f"{name} unavailable: {status.error}")
    for wname, row in run.outcomes.items():
        for target, outcome in row.items():
            if outcome.error:
                lines.append(f"{wname} on {target} failed: {outcome.error}")
    return "\n".join(lines)


def as_json(run: RunResult) -> dict[str, object]:
    columns = _columns(run)
    ratios = _ratios_for(columns)
    workloads: dict[str, object] = {}
    for wname, row in run.outcomes.items():
        metrics: dict[str, object] = {}
        for m in _metrics_of(row):
            values = {t: _value(row, t, m.name) for t in columns}
            metrics[m.name] = {
                "unit": m.unit,
                "better": m.better,
                "values": values,
                "ratios": {r.label: _ratio(values[r.numerator], values[r.denominator])
                           for r in ratios},
            }
        workloads[wname] = {
            "summary": run.summaries.get(wname, ""),
            "metrics": metrics,
            "details": {t: o.result.details for t, o in row.items() if o.result is not None},
            "errors": {t: o.error for t, o in row.items() if o.error},
        }
    return {
        "machine": run.machine,
        "config": run.config,
        "workdir": run.workdir,
        "workdir_fs": run.workdir_fs,
        "load_before": run.load_before,
        "load_after": run.load_after,
        "targets": {name: {**asdict(s), "what": TARGET_SUMMARIES[name]}
                    for name, s in run.targets.items()},
        "ratios": {r.label: r.meaning for r in ratios},
        "workloads": workloads,
    }


def write_json(run: RunResult, path: Path) -> None:
    safeopen.write_text(path, json.dumps(as_json(run), indent=2, ensure_ascii=False) + "\n")
