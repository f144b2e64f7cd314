"""`rpmemfs timeline OUT_DIR` (or `python -m rpmemfs.tools.timeline OUT_DIR`): what fsync,
the replicas' states and their lag do through a target's death and resync, recorded from a
real run and plotted.

Two target daemons on loopback, a fresh pool replicated to both and mounted with
min_replicas=1 (so fsync goes on while one target is dead). A writer does 4 KiB pwrite +
fsync in a loop, at offsets that move on through a file (so the dead replica's lag grows),
timing every fsync; a sampler asks the mount's control socket for its status (what
`rpmemfs status --json` prints) every --interval. The scenario: --steady seconds as they are,
`kill -9` of the second target, --dead seconds later the same daemon again (same address, same
pool directory), then on until that replica is in sync again, plus --after seconds. With
--fault hang the target is stopped (SIGSTOP) instead, and continued (SIGCONT) --dead seconds
later: a daemon that stops answering without its connections being reset, as a hung process
or a host gone from the network would (the mount waits replica_timeout for it).

OUT_DIR gets timeline.json (everything), fsyncs.csv, samples.csv, the daemons' logs, and,
when matplotlib is importable, timeline.png (or --plot FILE: .png or .svg): fsync latency,
replica state and lag, on one time axis. Everything started is stopped at the end, also on
Ctrl-C or an error.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace, RawDescriptionHelpFormatter
from pathlib import Path

from rpmemfs.cliparse import ArgumentParser
from rpmemfs.mountd.control import query
from rpmemfs.mountd.status import health
from rpmemfs.mountinfo import fs_type
from rpmemfs.progress import Notes
from rpmemfs.tools.fsync_writer import WRITE_SIZE, read_records
from rpmemfs.tools.processes import (
    MountProcess,
    SpawnError,
    TargetProcess,
    child_env,
    python_module,
    run_rpmemfs,
)
from rpmemfs.tools.timeline_record import (
    FAULT_ENDS,
    FAULTS,
    Event,
    Fsync,
    ReplicaSample,
    Sample,
    Timeline,
    report_lines,
    write_outputs,
)
from rpmemfs.units import parse_size

POOL_NAME = "timeline"
MOUNT_TIMEOUT = 60.0
SETTLE_TIMEOUT = 60.0  # for both replicas to be in sync before the clock starts
STATUS_TIMEOUT = 2.0  # one status query; a sample that takes longer records the failure
JOIN_TIMEOUT = 30.0  # the writer may be in an fsync held up to replica_timeout

_log = Notes("timeline")


class TimelineError(SpawnError):
    """The run could not be made or did not go as the scenario says (a writer's write failed,
    the mount did not answer, the replicas were never in sync)."""


def _sample(mountpoint: Path, t: float) -> Sample:
    try:
        st = query(str(mountpoint), "status", timeout=STATUS_TIMEOUT)
    except (OSError, ValueError) as e:  # (ValueError: a garbled answer)
        return Sample(t, "unknown", error=str(e) or type(e).__name__)
    if "error" in st:
        return Sample(t, "unknown", error=str(st["error"]))
    replicas = {}
    for r in st.get("replicas") or []:
        p = r.get("resync")
        progress = None
        if isinstance(p, dict) and p.get("total"):
            progress = f"{p.get('phase')} {100 * p.get('done', 0) // p['total']}%"
        lag = r.get("lag_bytes")
        since = r.get("behind_since")
        replicas[str(r["address"])] = ReplicaSample(
            str(r["state"]), lag if isinstance(lag, int) else None,
            since if isinstance(since, (int, float)) else None, progress,
            str(r["last_error"]) if r.get("last_error") else None)
    return Sample(t, health(st)[0].name.lower(), replicas)


class _Recorder:
    """The writer (a process of its own: fsync_writer.py) and the sampler (a thread), on one
    clock: the system's monotonic clock, from t0."""

    def __init__(self, timeline: Timeline, mountpoint: Path, records: Path, interval: float,
                 span: int) -> None:
        self.timeline = timeline
        self.mountpoint = mountpoint
        self.records = records
        self.interval = interval
        self.span = span
        self.t0 = time.monotonic()
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self.writer: subprocess.Popen[bytes] | None = None
        self.sampler = threading.Thread(target=self._watch, daemon=True, name="sampler")

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self.timeline.started_at = time.time()
        self.t0 = time.monotonic()
        self.writer = subprocess.Popen(
            python_module("rpmemfs.tools.fsync_writer", self.mountpoint / "timeline.dat",
                          self.records, str(self.span)),
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
        self.sampler.start()

    def check(self) -> None:
        """TimelineError if the writer or the sampler failed."""
        if self.failure is not None:
            raise TimelineError(f"the status sampler failed: {self.failure}") from self.failure
        if self.writer is not None and self.writer.poll() is not None:
            raise TimelineError(f"the writer exited with status {self.writer.returncode}: "
                                + self._writer_error())

    def stop(self) -> None:
        """Stop both and take the writer's records into the timeline."""
        self.stopping.set()
        if self.writer is not None:
            if self.writer.poll() is None:
                self.writer.terminate()
            try:
                self.writer.wait(JOIN_TIMEOUT)
            except subprocess.TimeoutExpired:
                # In an fsync that never returns: the mount is stopped after this anyway.
                self.writer.kill()
                self.writer.wait()
            if self.writer.stderr is not None:
                self.writer.stderr.close()
        if self.sampler.is_alive():
            self.sampler.join(JOIN_TIMEOUT)
        if self.records.exists():
            self.timeline.fsyncs = [Fsync(start - self.t0, seconds, errno or None)
                                    for start, seconds, errno in read_records(str(self.records))]

    def _writer_error(self) -> str:
        assert self.writer is not None and self.writer.stderr is not None
        return self.writer.stderr.read().decode(errors="replace").strip()[-2000:] or "(no message)"

    def latest(self) -> Sample | None:
        return self.timeline.samples[-1] if self.timeline.samples else None

    def _watch(self) -> None:
        try:
            tick = 0
            while not self.stopping.is_set():
                self.timeline.samples.append(_sample(self.mountpoint, self.now()))
                # On a fixed schedule: a slow answer shortens the next wait rather than shifting
                # it, and ticks missed meanwhile are skipped rather than made up in a burst.
                tick = max(tick + 1, int(self.now() / self.interval))
                self.stopping.wait(max(0.0, self.t0 + tick * self.interval - time.monotonic()))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by check()
            self.failure = e


def _wait(rec: _Recorder, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rec.check()
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def _all_in_sync(mountpoint: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = _sample(mountpoint, 0.0)
        if s.replicas and all(r.state == "in-sync" for r in s.replicas.values()):
            return
        if time.monotonic() > deadline:
            raise TimelineError(f"the replicas were not in sync {timeout:g} s after mounting: "
                                f"{s.error or {a: r.state for a, r in s.replicas.items()}}")
        time.sleep(0.1)


def run(out_dir: Path, *, steady: float = 5.0, dead: float = 5.0, after: float = 5.0,
        interval: float = 0.1, replica_timeout: float = 10.0, resync_timeout: float = 120.0,
        fault: str = "kill",
        pool_size: str = "512M", span: int = 256 << 20, work_dir: Path | None = None) -> Timeline:
    """Run the scenario (see the module's text) and return what was recorded; the daemons'
    logs are left in ``out_dir``. The pools live in ``work_dir`` (default: a new directory
    under /dev/shm, removed at the end). The writer's file wraps at ``span`` bytes, at most
    half the pool (the rest holds the logs and metadata)."""
    span = max(WRITE_SIZE, min(span, parse_size(pool_size) // 2 // WRITE_SIZE * WRITE_SIZE))
    out_dir.mkdir(parents=True, exist_ok=True)
    own_work = work_dir is None
    work = work_dir if work_dir is not None else Path(tempfile.mkdtemp(prefix="rpmemfs-timeline-",
                                                                          dir="/dev/shm"))
    work.mkdir(parents=True, exist_ok=True)
    mode = "force" if fs_type(str(work)) == "tmpfs" else "auto"
    timeline = Timeline(settings={
        "steady_s": steady, "dead_s": dead, "after_s": after, "interval_s": interval,
        "replica_timeout_s": replica_timeout, "min_replicas": 1, "pool_size": pool_size,
        "write_size": WRITE_SIZE, "span_bytes": span, "pmem": mode, "fault": fault,
    }, started_at=time.time())
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r}: one of {', '.join(FAULTS)}")
    targets: list[TargetProcess] = []
    mount: MountProcess | None = None
    rec: _Recorder | None = None
    hung: TargetProcess | None = None
    try:
        # A token of the run's own: the machine's default one (and its state directory) is
        # neither used nor made.
        token = work / "token"
        run_rpmemfs("token", "new", token)
        for i in range(2):
            d = work / f"target{i}"
            d.mkdir(mode=0o700, exist_ok=True)  # a target refuses a directory others may change
            t = TargetProcess(d, token_file=token, log_path=out_dir / f"target{i}.log")
            targets.append(t)
            t.start()
        timeline.replicas = [t.address for t in targets]
        timeline.victim = targets[1].address
        pool = work / "timeline.pool"
        run_rpmemfs("mkfs", pool, "--size", pool_size, "--force", "--token-file", token,
                    *(a for t in targets for a in ("--replica", f"{t.address}/{POOL_NAME}")))
        mount = MountProcess.rpmemfs(
            pool, work / "mnt",
            f"pmem={mode},min_replicas=1,replica_timeout={replica_timeout:g},token_file={token},"
            "log_level=info",
            log_path=out_dir / "mount.log")
        mount.start(MOUNT_TIMEOUT)
        _all_in_sync(mount.mountpoint, SETTLE_TIMEOUT)

        rec = _Recorder(timeline, mount.mountpoint, work / "fsyncs.bin", interval, span)
        rec.start()
        _log(f"writer and sampler started; {steady:g} s steady, then "
             f"{FAULTS[fault]} of {timeline.victim}")
        _wait(rec, steady)
        victim = targets[1]
        assert victim.proc is not None
        if fault == "kill":
            timeline.events.append(Event(rec.now(), "kill", timeline.victim))
            victim.kill()
            # (When the kernel has torn it down and closed its sockets; SIGKILL is not instant.)
            timeline.events.append(Event(rec.now(), "dead", timeline.victim))
            _wait(rec, dead)
            again = victim.respawn(log_path=out_dir / "target1-restarted.log")
            recovered = rec.now()
            timeline.events.append(Event(recovered, "restart", timeline.victim))
            victim.close()
            targets[1] = again
            again.start()
            timeline.events.append(Event(rec.now(), "listening", timeline.victim))
        else:
            timeline.events.append(Event(rec.now(), "hang", timeline.victim))
            hung = victim
            victim.proc.send_signal(signal.SIGSTOP)
            _wait(rec, dead)
            recovered = rec.now()
            timeline.events.append(Event(recovered, "resume", timeline.victim))
            victim.proc.send_signal(signal.SIGCONT)
            hung = None
        _log(f"{timeline.victim} {FAULT_ENDS[fault]}; waiting for it to be in sync again")
        deadline = time.monotonic() + resync_timeout
        while True:
            rec.check()
            s = rec.latest()
            if s is not None and s.t > recovered:
                r = s.replicas.get(timeline.victim)
                if r is not None and r.state == "in-sync":
                    timeline.events.append(Event(s.t, "in-sync", timeline.victim))
                    break
            if time.monotonic() > deadline:
                _log(f"{timeline.victim} not in sync {resync_timeout:g} s after it {FAULT_ENDS[fault]}")
                break
            time.sleep(interval / 2)
        _wait(rec, after)
        timeline.events.append(Event(rec.now(), "end", timeline.victim))
        rec.check()
        rec.stop()
        rec = None
        return timeline
    finally:
        if hung is not None and hung.proc is not None:
            hung.proc.send_signal(signal.SIGCONT)  # (so that it can stop as asked)
        if rec is not None:
            rec.stop()
        if mount is not None:
            mount.stop(MOUNT_TIMEOUT)
        for t in targets:
            t.stop()
            t.close()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


PLOT_HINT = ("matplotlib is not installed, so no plot was drawn; install it with "
             "`scripts/install.sh --plot` (or `pip install 'rpmemfs[plot]'`) and run again")


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="rpmemfs timeline", description=__doc__,
                       formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the recording, logs and plot go")
    p.add_argument("--fault", choices=tuple(FAULTS), default="kill",
                   help="kill: kill -9 and start it again; hang: SIGSTOP and SIGCONT (default kill)")
    p.add_argument("--steady", type=float, default=5.0, help="seconds before the fault (default 5)")
    p.add_argument("--dead", type=float, default=5.0,
                   help="seconds the target stays dead or stopped (default 5)")
    p.add_argument("--after", type=float, default=5.0,
                   help="seconds recorded once it is in sync again (default 5)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between status samples "
                   "(default 0.1)")
    p.add_argument("--replica-timeout", type=float, default=10.0,
                   help="the mount's replica_timeout (default 10, the mount's own default)")
    p.add_argument("--resync-timeout", type=float, default=120.0,
                   help="give up waiting for the resync after this many seconds (default 120)")
    p.add_argument("--pool-size", default="512M")
    p.add_argument("--work-dir", metavar="DIR", help="where the pools and the mount go, kept "
                   "afterwards (default: a new directory under /dev/shm, removed at the end)")
    p.add_argument("--plot", metavar="FILE", help="the plot's file, .png or .svg "
                   "(default OUT_DIR/timeline.png)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: draw the plot again from OUT_DIR/timeline.json")
    args: Namespace = p.parse_args(argv)
    if min(args.steady, args.dead, args.after, args.interval, args.replica_timeout) <= 0:
        p.error("--steady, --dead, --after, --interval and --replica-timeout must be positive")
    try:
        parse_size(args.pool_size)
    except ValueError as e:
        p.error(f"--pool-size: {e}")
    plot = Path(args.plot) if args.plot else Path(args.out_dir) / "timeline.png"
    if plot.suffix not in (".png", ".svg"):
        p.error(f"--plot {plot}: the file must end in .png or .svg")
    out = Path(args.out_dir)
    if args.replot:
        from rpmemfs.tools import timeline_plot

        if not timeline_plot.available():
            print(f"rpmemfs timeline: {PLOT_HINT}", file=sys.stderr)
            return 1
        try:
            doc = json.loads((out / "timeline.json").read_text())
            timeline_plot.draw(Timeline.from_json(doc), plot)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"rpmemfs timeline: cannot draw from {out / 'timeline.json'}: {e!r}", file=sys.stderr)
            return 1
        print(f"wrote {plot}")
        return 0

    def _terminate(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt  # stopped as by Ctrl-C: everything started is stopped

    signal.signal(signal.SIGTERM, _terminate)
    try:
        timeline = run(out, steady=args.steady, dead=args.dead, after=args.after,
                       interval=args.interval, replica_timeout=args.replica_timeout,
                       resync_timeout=args.resync_timeout, pool_size=args.pool_size, fault=args.fault,
                       work_dir=Path(args.work_dir) if args.work_dir else None)
    except KeyboardInterrupt:
        print("rpmemfs timeline: interrupted; everything it started is stopped, nothing written",
              file=sys.stderr)
        return 130
    except SpawnError as e:
        print(f"rpmemfs timeline: {e}", file=sys.stderr)
        return 1
    written = write_outputs(timeline, out)
    from rpmemfs.tools import timeline_plot

    if timeline_plot.available():
        timeline_plot.draw(timeline, plot)
        written.append(plot)
    else:
        print(f"rpmemfs timeline: {PLOT_HINT}", file=sys.stderr)
    for line in report_lines(timeline):
        print(line)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0 if timeline.event("in-sync") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
