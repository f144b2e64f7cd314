"""The failover timeline (rpmemfs/tools/timeline.py), short: real targets, a real mount with
min_replicas=1, a target killed with -9 and started again; the recording must show what the
documentation's plot says (docs/operations.md, "Watching a target die and come back")."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rpmemfs.mountinfo import is_mounted
from rpmemfs.tools.processes import child_env
from rpmemfs.tools.timeline import run
from rpmemfs.tools.timeline_record import Sample, Timeline, write_outputs

REPLICA_TIMEOUT = 5.0


def _victim_states(tl: Timeline, start: float, end: float) -> list[Sample]:
    return [s for s in tl.samples if start <= s.t < end and tl.victim in s.replicas]


def test_a_killed_target_falls_behind_gathers_lag_and_resyncs_while_fsync_goes_on(work_dir: Path) -> None:
    out = work_dir / "out"
    tl = run(out, steady=1.0, dead=1.5, after=0.5, replica_timeout=REPLICA_TIMEOUT,
             pool_size="128M", span=64 << 20, work_dir=work_dir / "work")
    kill, restart, back = tl.event("kill"), tl.event("restart"), tl.event("in-sync")
    assert kill is not None and restart is not None, tl.events
    assert back is not None, f"the killed replica was not in sync again: {tl.samples[-5:]}"
    assert len(tl.replicas) == 2 and tl.victim == tl.replicas[1]
    other = tl.replicas[0]

    # min_replicas=1: no fsync failed, and fsyncs went on while the target was dead.
    assert tl.fsyncs, "the writer recorded no fsync"
    assert [f for f in tl.fsyncs if f.errno is not None] == []
    assert any(kill.t < f.t < restart.t for f in tl.fsyncs), "no fsync completed while the target was dead"

    # It left in-sync, within replica_timeout of the kill by the daemon's own clock.
    dead = _victim_states(tl, kill.t, restart.t)
    behind = [s for s in dead if s.replicas[tl.victim].state != "in-sync"]
    assert behind, [s.replicas[tl.victim] for s in dead]
    since = behind[0].replicas[tl.victim].behind_since
    assert since is not None
    assert -0.5 < since - (tl.started_at + kill.t) <= REPLICA_TIMEOUT, since - (tl.started_at + kill.t)
    assert all(s.health == "degraded" for s in behind)

    # Its lag grew while it was dead (the writer moves on through the file), never shrank.
    lags = [s.replicas[tl.victim].lag_bytes for s in behind]
    assert all(x is not None for x in lags), lags
    known = [x for x in lags if x is not None]
    assert known == sorted(known) and known[-1] > known[0], known

    # Back in sync after the restart, lag 0, and so to the end.
    after = _victim_states(tl, back.t, float("inf"))
    assert after and all(s.replicas[tl.victim].state == "in-sync" for s in after), after
    assert all(s.replicas[tl.victim].lag_bytes == 0 for s in after)
    assert after[-1].health == "healthy"
    assert tl.summary()["victim_max_lag_bytes"] >= known[-1]

    # The other replica never left in-sync.
    sampled = [s for s in tl.samples if s.replicas]
    assert sampled and all(s.replicas[other].state == "in-sync" and s.replicas[other].lag_bytes == 0
                           for s in sampled)

    # What the tool leaves behind: the recording and the daemons' logs.
    json_path, fsyncs_csv, samples_csv = write_outputs(tl, out)
    doc = json.loads(json_path.read_text())
    assert doc["victim"] == tl.victim and doc["summary"]["failed_fsyncs"] == 0
    assert len(doc["fsyncs"]) == len(tl.fsyncs)
    with fsyncs_csv.open() as f:
        assert sum(1 for _ in csv.DictReader(f)) == len(tl.fsyncs)
    with samples_csv.open() as f:
        states = {(r["replica"], r["state"]) for r in csv.DictReader(f)}
    assert (tl.victim, "stale") in states and (other, "in-sync") in states
    assert "fell behind" in (out / "mount.log").read_text()
    assert (out / "target1-restarted.log").exists()


def test_a_hung_target_holds_fsync_up_to_replica_timeout_then_resyncs(work_dir: Path) -> None:
    timeout = 2.0
    tl = run(work_dir / "out", fault="hang", steady=1.0, dead=4.0, after=0.5, replica_timeout=timeout,
             pool_size="128M", span=64 << 20, work_dir=work_dir / "work")
    hang, resume, back = tl.event("hang"), tl.event("resume"), tl.event("in-sync")
    assert hang is not None and resume is not None and back is not None, tl.events
    assert tl.fsyncs and [f for f in tl.fsyncs if f.errno is not None] == []

    # SIGSTOP resets no connection: the mount gave up on the replica only when a barrier had
    # waited replica_timeout for it (never sooner), and said so.
    stopped = _victim_states(tl, hang.t, resume.t)
    behind = [s for s in stopped if s.replicas[tl.victim].state != "in-sync"]
    assert behind, [s.replicas[tl.victim] for s in stopped]
    first = behind[0].replicas[tl.victim]
    # (Less a margin: the barrier that timed out may have been posted just before the SIGSTOP.)
    assert first.behind_since is not None and first.behind_since - (tl.started_at + hang.t) >= timeout - 0.5
    assert f"barrier not acknowledged within {timeout:g}s" in (first.last_error or "")
    # Then fsyncs went on without it.
    assert any(f.t > first.behind_since - tl.started_at and f.t + f.seconds < resume.t for f in tl.fsyncs)

    after = _victim_states(tl, back.t, float("inf"))
    assert after and all(s.replicas[tl.victim].state == "in-sync" and s.replicas[tl.victim].lag_bytes == 0
                         for s in after)
    other = tl.replicas[0]
    assert all(s.replicas[other].state == "in-sync" for s in tl.samples if s.replicas)


def _ours(work: Path) -> list[str]:
    """Command lines of live processes that name ``work`` (the targets, the mount, the writer)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(work) in cmdline and proc.name.isdigit():
            found.append(cmdline)
    return found


def test_ctrl_c_stops_and_unmounts_everything_it_started(work_dir: Path) -> None:
    work = work_dir / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rpmemfs.tools.timeline", str(work_dir / "out"), "--work-dir", str(work),
         "--steady", "30", "--pool-size", "64M"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_env(), start_new_session=True,
        # As at a terminal: a shell without job control starts background jobs ignoring SIGINT.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the tool's first note: all is running
        assert "writer and sampler started" in line, line + proc.stderr.read()
        assert is_mounted(work / "mnt") and len(_ours(work)) >= 4
        os.killpg(proc.pid, signal.SIGINT)  # a Ctrl-C reaches the terminal's whole process group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not is_mounted(work / "mnt")
    assert _ours(work) == []
