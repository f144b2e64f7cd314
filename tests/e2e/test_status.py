"""`rpmemfs status` for administrators and monitors: a readable table, the same data in
--json, and an exit status that says the mount's health (0 healthy, 1 degraded, 2 failing: fsync
returns EIO, 3 unknown: not a mount, or a daemon that does not answer)."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
from pathlib import Path

from conftest import MountPool
from helpers import cli, stop_process, wait_until, write_fsync

from rpmemfs.tools.processes import TargetProcess


def _status(mnt: Path, *extra: str) -> tuple[int, dict[str, object]]:
    res = cli("status", mnt, "--json", *extra)
    return res.returncode, json.loads(res.stdout) if res.stdout else {}


def test_status_exit_says_healthy_degraded_failing_and_the_table_says_why(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=2")
    write_fsync(m.path / "a", b"a" * 9000)
    code, st = _status(m.path)
    assert code == 0 and st["health"] == "healthy", st
    assert st["min_replicas"] == 1 and st["epoch"] and isinstance(st["started"], float)
    table = cli("status", m.path)
    assert table.returncode == 0
    head = table.stdout.splitlines()[0]
    assert head.startswith(f"{m.path}: healthy (2 of 2 replicas in sync, 1 required)"), table.stdout
    for word in ("epoch", "min_replicas", "up ", "lag", "barriers", "last error", "in-sync"):
        assert word in table.stdout, (word, table.stdout)
    assert "{" not in table.stdout  # no raw dicts

    targets[1].kill()
    write_fsync(m.path / "b", b"b" * 9000)  # still succeeds (min_replicas=1), leaves it behind
    code, st = _status(m.path)
    assert code == 1 and st["health"] == "degraded", st
    behind = st["replicas"][1]  # type: ignore[index]
    assert behind["state"] == "stale" and behind["last_error"] and behind["lag_bytes"] > 0, behind
    table = cli("status", m.path)
    assert table.returncode == 1 and "degraded (1 of 2 replicas in sync" in table.stdout, table.stdout
    assert targets[1].address in table.stdout and "UTC" in table.stdout, table.stdout

    targets[0].kill()
    fd = os.open(m.path / "c", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"c" * 9000)
        try:
            os.fsync(fd)
        except OSError as e:
            assert e.errno == errno.EIO
        else:
            raise AssertionError("fsync with no replica in sync returned 0 (min_replicas=1)")
    finally:
        os.close(fd)
    code, st = _status(m.path)
    assert code == 2 and st["health"] == "failing", st

    # A daemon that does not answer: unknown, within the timeout, without hanging on the mount.
    assert m.proc is not None
    os.kill(m.proc.pid, signal.SIGSTOP)
    try:
        res = cli("status", m.path, "--timeout", "1", timeout=30)
        assert res.returncode == 3 and "no rpmemfs daemon answers" in res.stderr, res
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: _status(m.path)[0] == 2, timeout=10)


def test_status_of_what_is_not_an_rpmemfs_mount_is_unknown(work_dir: Path) -> None:
    res = cli("status", work_dir)
    assert res.returncode == 3 and "not a mount point" in res.stderr, res
    res = cli("status", "/proc")
    assert res.returncode == 3 and "is not an rpmemfs mount (it is proc)" in res.stderr, res


def test_a_replica_that_stops_answering_shows_at_once_as_a_waiting_barrier(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """A hung target is still "in-sync" until replica_timeout; the age of the barrier that
    waits for it says so meanwhile (status, its table, and rpmemfs_oldest_barrier_seconds)."""
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force,replica_timeout=30")
    write_fsync(m.path / "a", b"a" * 9000)
    assert _status(m.path)[1]["oldest_barrier_s"] == 0
    hung = targets[1]
    assert hung.proc is not None
    stop_process(hung.proc.pid)
    done = threading.Event()
    writer = threading.Thread(target=lambda: (write_fsync(m.path / "b", b"b" * 9000), done.set()))
    try:
        writer.start()
        assert wait_until(lambda: float(_status(m.path)[1]["oldest_barrier_s"]) >= 1.0, timeout=20)  # type: ignore[arg-type]
        assert not done.is_set()  # the fsync waits for the hung replica (policy all)
        table = cli("status", m.path)
        assert "a barrier has waited" in table.stdout, table.stdout
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    writer.join(60)
    assert done.is_set()
    assert wait_until(lambda: _status(m.path)[1]["oldest_barrier_s"] == 0)
