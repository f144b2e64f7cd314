"""The timeline's recording (rpmemfs/tools/timeline.py makes it): every fsync, every status
sample, the scenario's events; what to read from them (summary), and the files they are kept
in (timeline.json, which :meth:`Timeline.from_json` reads back, fsyncs.csv, samples.csv).

Both the tool and its plot (timeline_plot.py) read it; it imports neither.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rpmemfs import safeopen

FAULTS = {"kill": "kill -9", "hang": "SIGSTOP"}  # what --fault does to the target
FAULT_ENDS = {"kill": "restarted", "hang": "continued (SIGCONT)"}


@dataclass
class Fsync:
    t: float  # seconds since the clock started, when the fsync was called
    seconds: float  # how long it took
    errno: int | None = None  # None: it succeeded


@dataclass
class ReplicaSample:
    state: str
    lag_bytes: int | None  # None: unknown, the replica must be compared in full
    behind_since: float | None  # wall clock, when it last left in-sync (the daemon's record)
    resync: str | None = None  # "phase percent%" while a resync runs
    last_error: str | None = None  # what keeps it out of sync


@dataclass
class Sample:
    t: float
    health: str  # healthy, degraded, failing; "unknown" when the query failed
    replicas: dict[str, ReplicaSample] = field(default_factory=dict)  # by address
    error: str | None = None  # why the query failed


@dataclass
class Event:
    t: float
    # The fault: kill, then dead (reaped), restart, listening (the new daemon); or hang, then
    # resume. Then in-sync (the victim, first seen in sync again), end.
    what: str
    replica: str


@dataclass
class Timeline:
    settings: dict[str, Any]
    started_at: float  # wall clock at t = 0
    replicas: list[str] = field(default_factory=list)  # addresses, in the pool's order
    victim: str = ""  # the address of the target killed and restarted
    events: list[Event] = field(default_factory=list)
    fsyncs: list[Fsync] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def event(self, *what: str) -> Event | None:
        """The first event that is one of ``what``."""
        return next((e for e in self.events if e.what in what), None)

    @property
    def fault(self) -> Event | None:
        return self.event("kill", "hang")

    @property
    def recovery(self) -> Event | None:
        return self.event("restart", "resume")

    def summary(self) -> dict[str, Any]:
        """What to read from the run, in numbers (also printed, and kept in timeline.json)."""
        lat = sorted(f.seconds for f in self.fsyncs)
        out: dict[str, Any] = {
            "fsyncs": len(self.fsyncs),
            "failed_fsyncs": sum(1 for f in self.fsyncs if f.errno is not None),
            "fsync_p50_s": _quantile(lat, 0.5),
            "fsync_p99_s": _quantile(lat, 0.99),
            "fsync_max_s": lat[-1] if lat else None,
        }
        fault, recovery, back = self.fault, self.recovery, self.event("in-sync")
        if fault is not None:
            out["fault"] = fault.what
            # (By when they began: the fsync a fault holds up began about when it struck.)
            window = [f for f in self.fsyncs if fault.t - 0.5 <= f.t <= fault.t + 2.0]
            if window:
                worst = max(window, key=lambda f: f.seconds)
                out["fsync_max_at_fault_s"] = worst.seconds
                out["fsync_max_at_fault_t"] = worst.t
            left = [s for s in self.samples if s.t >= fault.t and self._state(s) not in (None, "in-sync")]
            if left:
                r = left[0].replicas[self.victim]
                if r.behind_since is not None:
                    # The daemon's own clock for when it failed the replica, not the sampler's.
                    out["left_in_sync_after_s"] = r.behind_since - (self.started_at + fault.t)
                out["left_in_sync_because"] = r.last_error
            if recovery is not None:
                down = [f for f in self.fsyncs if fault.t <= f.t < recovery.t]
                out["fsyncs_while_down"] = len(down)
                out["fsyncs_per_s_while_down"] = len(down) / max(recovery.t - fault.t, 1e-9)
        steady = [f for f in self.fsyncs if fault is None or f.t < fault.t]
        if steady:
            out["fsyncs_per_s_steady"] = len(steady) / max(steady[-1].t, 1e-9)
        lags = [s.replicas[self.victim].lag_bytes for s in self.samples if self.victim in s.replicas]
        out["victim_max_lag_bytes"] = max((x for x in lags if x is not None), default=None)
        if recovery is not None and back is not None:
            out["in_sync_after_recovery_s"] = back.t - recovery.t
            resyncing = [s.t for s in self.samples
                         if s.t >= recovery.t and self._state(s) == "resyncing"]
            if resyncing:
                out["resyncing_seen_s"] = resyncing[-1] - resyncing[0]
        reaped = self.event("dead")
        if fault is not None and reaped is not None:
            out["kill_reaped_after_s"] = reaped.t - fault.t
        listening = self.event("listening")
        if recovery is not None and listening is not None:
            out["target_start_s"] = listening.t - recovery.t
        return out

    def _state(self, s: Sample) -> str | None:
        r = s.replicas.get(self.victim)
        return None if r is None else r.state

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "started_at": self.started_at,
            "replicas": self.replicas,
            "victim": self.victim,
            "summary": self.summary(),
            "events": [asdict(e) for e in self.events],
            "samples": [asdict(s) for s in self.samples],
            # Rows, not objects: a run has tens of thousands of them.
            "fsync_columns": ["t", "seconds", "errno"],
            "fsyncs": [[round(f.t, 6), round(f.seconds, 7), f.errno] for f in self.fsyncs],
        }


    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Timeline:
        """The timeline :meth:`to_json` wrote (timeline.json), to draw its plot again."""
        tl = cls(settings=doc["settings"], started_at=doc["started_at"], replicas=doc["replicas"],
                 victim=doc["victim"])
        tl.events = [Event(**e) for e in doc["events"]]
        tl.samples = [Sample(s["t"], s["health"], {a: ReplicaSample(**r) for a, r in s["replicas"].items()},
                             s.get("error")) for s in doc["samples"]]
        tl.fsyncs = [Fsync(t, seconds, errno) for t, seconds, errno in doc["fsyncs"]]
        return tl


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def write_outputs(timeline: Timeline, out_dir: Path) -> list[Path]:
    """timeline.json, fsyncs.csv and samples.csv in ``out_dir``; the paths written."""
    paths = [out_dir / "timeline.json", out_dir / "fsyncs.csv", out_dir / "samples.csv"]
    safeopen.write_text(paths[0], json.dumps(timeline.to_json(), indent=1) + "\n")
    with os.fdopen(safeopen.overwrite(str(paths[1])), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "seconds", "errno"])
        w.writerows([f"{x.t:.6f}", f"{x.seconds:.7f}", "" if x.errno is None else x.errno]
                    for x in timeline.fsyncs)
    with os.fdopen(safeopen.overwrite(str(paths[2])), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "health", "replica", "state", "lag_bytes", "resync", "error"])
        for s in timeline.samples:
            if not s.replicas:
                w.writerow([f"{s.t:.3f}", s.health, "", "", "", "", s.error or ""])
            for addr, r in s.replicas.items():
                w.writerow([f"{s.t:.3f}", s.health, addr, r.state,
                            "" if r.lag_bytes is None else r.lag_bytes, r.resync or "",
                            r.last_error or ""])
    return paths


def report_lines(timeline: Timeline) -> list[str]:
    s = timeline.summary()

    def ms(key: str) -> str:
        v = s.get(key)
        return "-" if v is None else f"{v * 1e3:.2f} ms"

    lines = [f"{s['fsyncs']} fsyncs, {s['failed_fsyncs']} failed; p50 {ms('fsync_p50_s')}, "
             f"p99 {ms('fsync_p99_s')}, max {ms('fsync_max_s')}"]
    fault = FAULTS.get(str(s.get("fault")), "the fault")
    ends = FAULT_ENDS.get(str(s.get("fault")), "recovered")
    if "fsync_max_at_fault_s" in s:
        lines.append(f"slowest fsync around the {fault}: {ms('fsync_max_at_fault_s')}")
    if "left_in_sync_after_s" in s:
        lines.append(f"{timeline.victim} left in-sync {s['left_in_sync_after_s']:.3f} s after the "
                     f"{fault}: {s.get('left_in_sync_because')}")
    else:
        lines.append(f"{timeline.victim} never left in-sync")
    if s.get("victim_max_lag_bytes") is not None:
        lines.append(f"its lag grew to {s['victim_max_lag_bytes'] / (1 << 20):.1f} MiB")
    if "fsyncs_per_s_steady" in s and "fsyncs_per_s_while_down" in s:
        lines.append(f"fsyncs per second: {s['fsyncs_per_s_steady']:.0f} steady, "
                     f"{s['fsyncs_per_s_while_down']:.0f} with one target down")
    if "in_sync_after_recovery_s" in s:
        start = (f" (the daemon took {s['target_start_s']:.2f} s to listen)"
                 if "target_start_s" in s else "")
        lines.append(f"in sync again {s['in_sync_after_recovery_s']:.2f} s after it {ends}{start}")
    else:
        lines.append(f"{timeline.victim} was NOT in sync again after it {ends}")
    return lines
