"""The timeline's plot: three panels on one time axis (fsync latency, replica state, lag).

matplotlib is an optional extra (`scripts/install.sh --plot`, or `pip install 'rpmemfs[plot]'`):
nothing else in rpmemfs, and no test, needs it.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rpmemfs.tools.timeline_record import Timeline

STATE_COLORS = {"in-sync": "#2ca02c", "connecting": "#7f7f7f", "stale": "#d62728",
                "resyncing": "#ff7f0e", "unknown": "#ffffff"}
EVENT_STYLES = {"kill": ("#d62728", "kill -9"), "restart": ("#1f77b4", "restarted"),
                "hang": ("#d62728", "SIGSTOP"), "resume": ("#1f77b4", "SIGCONT"),
                "in-sync": ("#2ca02c", "in sync")}
TITLES = {"kill": "a target's kill -9 and restart", "hang": "a target's hang (SIGSTOP) and SIGCONT"}
BIN_SECONDS = 0.25  # the worst fsync of each bin is drawn as a line over the points
HELD_SECONDS = 1.0  # an fsync longer than this is drawn as a bar along its whole length


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw(timeline: Timeline, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, (ax_lat, ax_state, ax_lag) = plt.subplots(
        3, 1, sharex=True, figsize=(9, 6.5), height_ratios=[3, 1.2, 2], layout="constrained")
    st = timeline.settings
    fig.suptitle(f"fsync through {TITLES[st.get('fault', 'kill')]} (min_replicas={st['min_replicas']}, "
                 f"replica_timeout={st['replica_timeout_s']:g} s, {st['write_size'] // 1024} KiB "
                 "writes)", fontsize=10)
    end = max([e.t for e in timeline.events] + [s.t for s in timeline.samples] + [0.0])

    ok = [f for f in timeline.fsyncs if f.errno is None]
    failed = [f for f in timeline.fsyncs if f.errno is not None]
    # Rasterized: tens of thousands of points would make a vector file huge.
    ax_lat.scatter([f.t for f in ok], [f.seconds * 1e3 for f in ok], s=1, c="#1f77b4", alpha=0.25,
                   linewidths=0, rasterized=True, label="each fsync")
    if failed:
        ax_lat.scatter([f.t for f in failed], [f.seconds * 1e3 for f in failed], s=12, c="#d62728",
                       marker="x", label=f"failed ({len(failed)})")
    worst: dict[int, float] = {}
    for f in timeline.fsyncs:
        b = int(f.t / BIN_SECONDS)
        worst[b] = max(worst.get(b, 0.0), f.seconds * 1e3)
    # Every bin up to the last, empty ones NaN: a line across a gap would show fsyncs where
    # there were none (the writer was waiting in one).
    bins = range(max(worst, default=-1) + 1)
    ax_lat.step([(b + 1) * BIN_SECONDS for b in bins], [worst.get(b, math.nan) for b in bins],
                where="pre", color="#444444", linewidth=0.8, label=f"slowest per {BIN_SECONDS:g} s")
    # An fsync held up much longer than a bin also as a bar from its call to its return: a
    # point where it began says little about the seconds it took.
    held = [f for f in timeline.fsyncs if f.seconds > HELD_SECONDS]
    for f in held:
        ax_lat.hlines(f.seconds * 1e3, f.t, f.t + f.seconds, color="#d62728", linewidth=2)
        ax_lat.annotate(f"one fsync held {f.seconds:.2f} s", (f.t + f.seconds / 2, f.seconds * 1e3),
                        xytext=(0, -12), textcoords="offset points", ha="center", fontsize=8,
                        color="#d62728")
    ax_lat.set_yscale("log")
    low, high = ax_lat.get_ylim()
    ax_lat.set_ylim(low, high * 20)  # headroom for the legend and the events' labels
    ax_lat.set_ylabel("fsync latency (ms)")
    ax_lat.legend(loc="upper left", fontsize=8, markerscale=4)

    victim = "killed" if st.get("fault", "kill") == "kill" else "stopped"
    lanes = list(reversed(timeline.replicas))
    for row, addr in enumerate(lanes):
        spans: dict[str, list[tuple[float, float]]] = {}
        samples = timeline.samples
        for i, s in enumerate(samples):
            r = s.replicas.get(addr)
            state = r.state if r is not None else "unknown"
            until = samples[i + 1].t if i + 1 < len(samples) else s.t + st["interval_s"]
            spans.setdefault(state, []).append((s.t, until - s.t))
        for state, bars in spans.items():
            ax_state.broken_barh(bars, (row - 0.35, 0.7), facecolors=STATE_COLORS.get(state, "#000000"),
                                 edgecolor="none")
    ax_state.set_yticks(range(len(lanes)))
    ax_state.set_yticklabels([a + (f" ({victim})" if a == timeline.victim else "") for a in lanes],
                             fontsize=8)
    ax_state.set_ylim(-0.6, len(lanes) - 0.4)
    seen = {r.state for s in timeline.samples for r in s.replicas.values()}
    handles = [Rectangle((0, 0), 1, 1, color=c) for k, c in STATE_COLORS.items() if k in seen]
    ax_state.legend(handles, [k for k in STATE_COLORS if k in seen], loc="upper right", fontsize=8,
                    ncol=len(handles))
    ax_state.set_ylabel("state")

    for addr in timeline.replicas:
        ts = [s.t for s in timeline.samples if addr in s.replicas]
        lag = [_mib(s.replicas[addr].lag_bytes) for s in timeline.samples if addr in s.replicas]
        ax_lag.step(ts, lag, where="post", label=addr + (f" ({victim})" if addr == timeline.victim else ""))
    ax_lag.set_ylabel("lag (MiB)")
    ax_lag.set_xlabel("seconds")
    ax_lag.legend(loc="upper right", fontsize=8)

    marked = [e for e in timeline.events if e.what in EVENT_STYLES]
    for i, e in enumerate(marked):
        color, label = EVENT_STYLES[e.what]
        for ax in (ax_lat, ax_state, ax_lag):
            ax.axvline(e.t, color=color, linestyle="--", linewidth=1)
        # One below the other (a quick resync puts its marks close together), on the side of
        # the line toward the middle of the plot.
        right = e.t < end / 2
        ax_lat.annotate(f"{label} {e.t:.1f} s", (e.t, 1), xycoords=("data", "axes fraction"),
                        xytext=(3 if right else -3, -11 - 11 * i), textcoords="offset points",
                        ha="left" if right else "right", fontsize=8, color=color,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1, "alpha": 0.8})
    ax_lag.set_xlim(0, end)
    for ax in (ax_lat, ax_state, ax_lag):
        ax.grid(True, axis="x", alpha=0.3)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mib(n: int | None) -> float:
    return math.nan if n is None else n / (1 << 20)
