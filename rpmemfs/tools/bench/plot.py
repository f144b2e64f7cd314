"""A picture of one `rpmemfs bench --json` run's concurrent_fsync: IOPS against the number
of writer processes, one line per target, so the gaps issue 18 asks about show at a glance.

    python -m rpmemfs.tools.bench.plot BENCH.json OUT.png

matplotlib is an optional extra (`scripts/install.sh --plot`), as for `rpmemfs timeline`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from rpmemfs.tools.timeline_plot import available

WORKLOAD = "concurrent_fsync"
_JOBS = re.compile(r"iops_(\d+)j$")


def series(run: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """target -> [(processes, IOPS)], from the JSON of a bench run (report.as_json)."""
    metrics = run.get("workloads", {}).get(WORKLOAD, {}).get("metrics", {})
    out: dict[str, list[tuple[int, float]]] = {}
    for name, metric in metrics.items():
        m = _JOBS.match(name)
        if not m:
            continue
        for target, value in metric.get("values", {}).items():
            if value is not None:
                out.setdefault(target, []).append((int(m.group(1)), float(value)))
    return {t: sorted(points) for t, points in out.items()}


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
    p.add_argument("json", type=Path, help="what `rpmemfs bench --json FILE` wrote")
    p.add_argument("out", type=Path, help="the PNG to write")
    args = p.parse_args(argv)
    if not available():
        print("rpmemfs bench plot: matplotlib is not installed (scripts/install.sh --plot)", file=sys.stderr)
        return 2
    try:
        draw(json.loads(args.json.read_text()), args.out)
    except (OSError, ValueError) as e:
        print(f"rpmemfs bench plot: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
