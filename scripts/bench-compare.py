#!/usr/bin/env python3
"""Before/after: `rpmemfs bench` of two checkouts, alternated in one run, as medians and ratios.

    scripts/bench-compare.py --base ../base --runs 3 -- --quick
    scripts/bench-compare.py --base ../base --runs 3 -- --quick --replicas

Each checkout needs its own .venv (scripts/install.sh). The runs alternate (base, this,
base, this, ...) so that a drift in the machine's load hits both sides alike. Printed: per
workload, metric and target, the median over the runs of each side and this/base, as a
Markdown table (for docs/benchmarks.md). A ratio says how this checkout compares with the
base in the metric itself: for "lower" metrics below 1 is faster, for "higher" above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run(checkout: Path, args: list[str], out: Path) -> dict:
    cmd = [str(checkout / ".venv/bin/rpmemfs"), "bench", *args, "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=checkout)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (with its .venv)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("bench_args", nargs="*", help="arguments for rpmemfs bench (after --)")
    a = ap.parse_args()
    sides = {"base": a.base.resolve(), "this": HERE}
    results: dict[str, list[dict]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            for side, checkout in sides.items():
                print(f"run {i + 1}/{a.runs}: {side} ({checkout})", file=sys.stderr)
                results[side].append(run(checkout, a.bench_args, Path(tmp) / f"{side}{i}.json"))
    rows = []
    first = results["this"][0]["workloads"]
    for wl, w in first.items():
        for metric, m in w["metrics"].items():
            for target in m["values"]:
                med = {}
                for side in sides:
                    got = [r["workloads"][wl]["metrics"][metric]["values"].get(target) for r in results[side]]
                    vals = [v for v in got if v is not None]
                    med[side] = statistics.median(vals) if vals else None
                if med["base"] and med["this"]:
                    rows.append((wl, metric, m["unit"], m["better"], target, med["base"], med["this"],
                                 med["this"] / med["base"]))
    print(f"`rpmemfs bench {' '.join(a.bench_args)}`, {a.runs} runs of each side alternated, medians; "
          f"load before/after the last run: {os.getloadavg()[0]:.2f}")
    print()
    print("| workload | metric | better | target | base | this | this/base |")
    print("|---|---|---|---|---|---|---|")
    for wl, metric, unit, better, target, b, t, r in rows:
        print(f"| {wl} | {metric} ({unit}) | {better} | {target} | {b:,.1f} | {t:,.1f} | {r:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
