"""Pictures of one `rpmemfs bench --json` run's concurrent_fsync: IOPS against the number
of writer processes, one line per target, so the gaps issue 18 asks about show at a glance;
or, with ``--cpu``, each target's CPU per operation split by process (the mount daemon's user
and kernel time, the target daemons', the rest) at each number of writers, as stacked bars:
what replication costs the primary, the measure of issue 31.

    python -m rpmemfs.tools.bench.plot BENCH.json OUT.png
    python -m rpmemfs.tools.bench.plot --cpu BENCH.json OUT.png

matplotlib is an optional extra (`scripts/install.sh --plot`), as for `rpmemfs timeline`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rpmemfs.tools.timeline_plot import available

WORKLOAD = "concurrent_fsync"
_JOBS = re.compile(r"iops_(\d+)j$")


def _values(run: dict[str, Any], pattern: re.Pattern[str]) -> Iterator[tuple[re.Match[str], str, float]]:
    """(the name's match, target, value) of each known value of the run's WORKLOAD metrics
    whose name matches ``pattern`` (the JSON of a bench run: report.as_json)."""
    metrics = run.get("workloads", {}).get(WORKLOAD, {}).get("metrics", {})
    for name, metric in metrics.items():
        m = pattern.match(name)
        if m:
            for target, value in metric.get("values", {}).items():
                if value is not None:
                    yield m, target, float(value)


def series(run: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """target -> [(processes, IOPS)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for m, target, value in _values(run, _JOBS):
        out.setdefault(target, []).append((int(m.group(1)), value))
    return {t: sorted(points) for t, points in out.items()}


# The split's parts, bottom to top, as the bench names them (cpu_<part>_<N>j).
PARTS = (("daemon_user", "mount daemon, user"), ("daemon_kernel", "mount daemon, kernel"),
         ("targets", "target daemons"), ("other", "rest (writers, their kernel work)"))
_SPLIT = re.compile(r"cpu_(daemon_user|daemon_kernel|targets|other)_(\d+)j$")


def cpu_split(run: dict[str, Any]) -> dict[tuple[str, int], dict[str, float]]:
    """(target, processes) -> {part: µs per operation}, for the points with every part."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for m, target, value in _values(run, _SPLIT):
        out.setdefault((target, int(m.group(2))), {})[m.group(1)] = value
    return {k: v for k, v in sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0]))
            if len(v) == len(PARTS)}


def _short(target: str) -> str:
    """A bar's label: rpmemfs-2rep-async -> 2rep-async, rpmemfs -> 0 rep."""
    return "0 rep" if target == "rpmemfs" else target.removeprefix("rpmemfs-")


def draw_cpu(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = cpu_split(run)
    if not data:
        raise ValueError(f"the run has no CPU split of {WORKLOAD}")
    fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
    labels = [f"{_short(t)}\n{j} proc" for t, j in data]
    bottom = [0.0] * len(data)
    for part, label in PARTS:
        heights = [v[part] for v in data.values()]
        ax.bar(range(len(data)), heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(range(len(data)), labels, fontsize="x-small")
    ax.set_ylabel("CPU µs per 4 KiB write + fsync")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"{WORKLOAD}: CPU per operation by process, median of "
                 f"{run.get('config', {}).get('rounds', '?')} rounds")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    data = series(run)
    if not data:
        raise ValueError(f"the run has no {WORKLOAD} results")
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    for target, points in data.items():
        ax.plot([p for p, _ in points], [v for _, v in points], marker="o", label=target)
    jobs = sorted({p for points in data.values() for p, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(jobs, [str(j) for j in jobs])
    ax.set_xlabel("writer processes (each 4 KiB pwrite + fsync on its own file)")
    ax.set_ylabel("IOPS (all processes)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    load = run.get("load_before")
    ax.set_title(f"{WORKLOAD}, median of {run.get('config', {}).get('rounds', '?')} rounds"
                 + (f" (load before {load[0]:.1f})" if load else ""))
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rpmemfs.tools.bench.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="CPU per operation split by process, not IOPS")
    p.add_argument("json", type=Path, help="what `rpmemfs bench --json FILE` wrote")
    p.add_argument("out", type=Path, help="the PNG to write")
    args = p.parse_args(argv)
    if not available():
        print("rpmemfs bench plot: matplotlib is not installed (scripts/install.sh --plot)", file=sys.stderr)
        return 2
    try:
        (draw_cpu if args.cpu else draw)(json.loads(args.json.read_text()), args.out)
    except (OSError, ValueError) as e:
        print(f"rpmemfs bench plot: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
