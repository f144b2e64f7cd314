"""Turns a RunResult into the printed table and the JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rpmemfs.bench.machine import one_line
from rpmemfs.bench.results import Outcome, RunResult
from rpmemfs.bench.stats import Metric
from rpmemfs.bench.targets import TARGET_NAMES

# (label, numerator, denominator); the first two are what the comparison is about,
# the third shows what FUSE itself costs, which is needed to read the other two.
RATIOS = (
    ("rpmemfs/passthrough", "rpmemfs", "passthrough"),
    ("rpmemfs/plain", "rpmemfs", "plain"),
    ("passthrough/plain", "passthrough", "plain"),
)

LEGEND = (
    "ratios are A/B of the metric itself: for 'lower' metrics (latency, time) a ratio "
    "below 1 means A is faster;\nfor 'higher' metrics (throughput, rate) a ratio above 1 "
    "means A is faster. 1 MB = 10^6 bytes."
)


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


def render(run: RunResult) -> str:
    header = ["workload", "metric", "unit", "better", *TARGET_NAMES, *(r[0] for r in RATIOS)]
    rows: list[list[str]] = []
    for wname, row in run.outcomes.items():
        for i, m in enumerate(_metrics_of(row)):
            cells = [wname if i == 0 else "", m.name, m.unit, m.better]
            cells += [_cell(run, row, t, m.name) for t in TARGET_NAMES]
            for _, num, den in RATIOS:
                r = _ratio(_value(row, num, m.name), _value(row, den, m.name))
                cells.append("-" if r is None else f"{r:.2f}x")
            rows.append(cells)
        if not _metrics_of(row):
            cells = [wname, "(no result)", "", ""]
            cells += [_cell(run, row, t, "") for t in TARGET_NAMES]
            rows.append(cells + ["-" for _ in RATIOS])

    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    numeric_from = 4

    def line(cells: list[str]) -> str:
        out = [cell.ljust(widths[c]) if c < numeric_from else cell.rjust(widths[c])
               for c, cell in enumerate(cells)]
        return "  ".join(out).rstrip()

    lines = [one_line(run.machine),
             f"work dir: {run.workdir} ({run.workdir_fs})",
             _scale_line(run),
             "",
             line(header),
             line(["-" * w for w in widths]),
             *(line(r) for r in rows),
             "",
             LEGEND]
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
    workloads: dict[str, object] = {}
    for wname, row in run.outcomes.items():
        metrics: dict[str, object] = {}
        for m in _metrics_of(row):
            values = {t: _value(row, t, m.name) for t in TARGET_NAMES}
            metrics[m.name] = {
                "unit": m.unit,
                "better": m.better,
                "values": values,
                "ratios": {label: _ratio(values[a], values[b]) for label, a, b in RATIOS},
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
        "targets": {name: asdict(s) for name, s in run.targets.items()},
        "workloads": workloads,
    }


def write_json(run: RunResult, path: Path) -> None:
    path.write_text(json.dumps(as_json(run), indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")
