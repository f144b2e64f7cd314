"""Replicas added to and removed from a mounted pool (`rpmemfs replica add|remove`), while a
writer goes on; the failover runbook's last steps: the old primary rejoining as a replica of the
new one, and a dead replica replaced. Real targets, real mounts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import Host, MountPool, ip
from helpers import (
    assert_check_clean,
    cli,
    mkfs_replicated,
    pool_content,
    replica_file,
    status_json,
    wait_until,
    write_fsync,
)

from rpmemfs.tools.processes import TargetProcess

OPTS = "pmem=force,replica_timeout=2"


def _states(mnt: Path) -> list[str]:
    return [r["state"] for r in status_json(mnt)["replicas"]]


class Writer:
    """write + fsync in a loop; every acknowledged file is remembered, any failure too."""

    def __init__(self, mnt: Path) -> None:
        self.mnt = mnt
        self.acked: dict[str, bytes] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            data = os.urandom(20_000 + i % 5000)
            name = f"w{i % 300}"  # rewritten in turn: the pool never fills
            try:
                write_fsync(self.mnt / name, data)
                self.acked[name] = data
            except OSError as e:
                self.errors.append(f"{name}: {e}")
            i += 1

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_add_a_replica_while_a_writer_fsyncs_then_remove_it(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets[:1])
    m = mount_pool(pool, options=OPTS)
    for i in range(20):
        write_fsync(m.path / f"before{i}", os.urandom(100_000))
    new = f"{targets[1].address}/app"
    with Writer(m.path) as w:
        time.sleep(0.5)
        res = cli("replica", "add", m.path, new, "--json")
        assert res.returncode == 0, res.stderr
        added = json.loads(res.stdout)
        assert added["added"] == new and added["created"] is True and added["slot"] == 1, added
        time.sleep(0.5)
    assert not w.errors, w.errors[:3]  # adding made no fsync fail
    assert len(w.acked) > 10
    assert _states(m.path) == ["in-sync", "in-sync"]
    # It had no error to clear: no warning with "its last error, at None: None".
    assert "None" not in m.output(), m.output()[-2000:]
    assert [f"{r['address']}/{r['name']}" for r in status_json(m.path)["replicas"]][1] == new
    again = cli("replica", "add", m.path, new)
    assert again.returncode == 1 and "in the set already" in again.stderr, again.stderr
    write_fsync(m.path / "after", b"a" * 9000)
    m.unmount()
    assert cli("verify", pool).returncode == 0  # the table names both: both compared, clean
    assert pool_content(replica_file(targets[1])) == pool_content(pool)
    # The new replica, copied, is the pool: it checks clean and holds every acknowledged write.
    copy = work_dir / "copy.pool"
    shutil.copyfile(replica_file(targets[1]), copy)
    assert_check_clean(copy)

    m = mount_pool(pool, name="again", options=OPTS)
    assert _states(m.path) == ["in-sync", "in-sync"]  # the table kept it
    res = cli("replica", "remove", m.path, new)
    assert res.returncode == 0, res.stderr
    assert [r["address"] for r in status_json(m.path)["replicas"]] == [targets[0].address]
    write_fsync(m.path / "after-remove", b"r" * 9000)
    assert cli("replica", "remove", m.path, new).returncode == 1  # not there any more
    m.unmount()
    res = cli("verify", pool, "--json")
    assert res.returncode == 0 and len(json.loads(res.stdout)["replicas"]) == 1, res.stdout
    m = mount_pool(copy, name="copy", options="pmem=force,min_replicas=0,replica_timeout=1")
    for name, data in w.acked.items():
        assert (m.path / name).read_bytes() == data, name


def test_remove_below_min_replicas_is_refused_unless_forced(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options=OPTS + ",min_replicas=2")
    res = cli("replica", "remove", m.path, f"{targets[1].address}/app")
    assert res.returncode == 1 and "fsync would return EIO" in res.stderr, res.stderr
    assert _states(m.path) == ["in-sync", "in-sync"]  # nothing changed
    res = cli("replica", "remove", m.path, f"{targets[1].address}/app", "--force")
    assert res.returncode == 0, res.stderr
    st = status_json(m.path)
    assert st["min_replicas"] == 1 and len(st["replicas"]) == 1, st
    write_fsync(m.path / "f", b"f" * 9000)  # the policy met by the one left
    bad = cli("replica", "add", m.path, "not-an-address")  # a usage error
    assert bad.returncode == 2 and "rpmemfs:" in bad.stderr and "Traceback" not in bad.stderr


def test_the_old_primary_rejoins_as_a_replica_of_the_new_one(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    acked = {f"a{i}": os.urandom(400_000) for i in range(20)}
    for name, data in acked.items():
        write_fsync(a.path / name, data)
    a.kill9()  # node A dies
    new = work_dir / "new.pool"
    res = cli("promote", new, "--from", f"{targets[0].address}/app")
    assert res.returncode == 0, res.stderr
    q = mount_pool(new, name="q", options=OPTS)
    more = {f"q{i}": os.urandom(50_000) for i in range(5)}
    for name, data in more.items():
        write_fsync(q.path / name, data)
    acked.update(more)
    # Node A is back: its old pool file goes under a target of its own, as a replica.
    a_dir = work_dir / "node-a"
    a_dir.mkdir()
    os.replace(pool, a_dir / "app")
    with TargetProcess(a_dir, pmem="force", log_path=work_dir / "node-a.log") as ta:  # (started)
        res = cli("replica", "add", q.path, f"{ta.address}/app", "--json")
        assert res.returncode == 0, res.stderr
        added = json.loads(res.stdout)
        assert added["created"] is False, added
        # Only what differs moved: far less than the 8 MiB of data the pools hold.
        assert 0 < added["resync"]["bytes_sent"] < 4 << 20, added
        assert _states(q.path) == ["in-sync", "in-sync", "in-sync"]
        write_fsync(q.path / "after-rejoin", b"j" * 9000)
        q.unmount()
        assert cli("verify", new).returncode == 0
        assert pool_content(a_dir / "app") == pool_content(new)


def test_a_dead_replica_is_replaced(work_dir: Path, targets: list[TargetProcess],
                                    mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options=OPTS + ",min_replicas=1")
    write_fsync(m.path / "f", os.urandom(300_000))
    targets[1].kill()  # the node is gone for good
    write_fsync(m.path / "g", os.urandom(300_000))
    assert _states(m.path) == ["in-sync", "stale"]
    assert cli("replica", "remove", m.path, f"{targets[1].address}/app").returncode == 0
    d = work_dir / "node-c"
    d.mkdir()
    with TargetProcess(d, pmem="msync", log_path=work_dir / "node-c.log") as tc:  # (started)
        res = cli("replica", "add", m.path, f"{tc.address}/app")
        assert res.returncode == 0, res.stderr
        assert _states(m.path) == ["in-sync", "in-sync"]
        assert status_json(m.path)["health"] == "healthy"
        m.unmount()
        assert cli("verify", pool).returncode == 0
        assert pool_content(replica_file(tc)) == pool_content(pool)


def test_a_mount_killed_while_it_adds_a_replica_leaves_a_consistent_pool(
        work_dir: Path, hosts: list[Host], mount_pool: MountPool) -> None:
    token = work_dir / "token"
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", "--token-file", token,
              "--replica", f"{hosts[0].target.address}/app")
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force,replica_timeout=2,commit=0")
    acked = {f"f{i}": os.urandom(1 << 20) for i in range(16)}
    for name, data in acked.items():
        write_fsync(m.path / name, data)
    slow = hosts[1]
    subprocess.run(["tc", "qdisc", "add", "dev", slow.veth, "root", "tbf", "rate", "40mbit", "burst",
                    "32kb", "latency", "400ms"], check=True)
    adder = subprocess.Popen([sys.executable, "-m", "rpmemfs.cli", "replica", "add", str(m.path),
                              f"{slow.target.address}/app"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(status_json(m.path)["replicas"]) == 2
                          and status_json(m.path)["replicas"][1]["state"] == "resyncing", timeout=30)
        time.sleep(1.0)
        m.kill9()
    finally:
        adder.wait(timeout=30)
        subprocess.run(["tc", "qdisc", "del", "dev", slow.veth, "root"], check=False)
    assert_check_clean(pool)
    # The table named the new replica before its resync began; its target marks the resync
    # unfinished, so it is never taken as a source; the next mount finishes it.
    res = cli("promote", work_dir / "x.pool", "--from", f"{slow.target.address}/app", "--token-file", token)
    assert res.returncode == 1 and "not a consistent copy" in res.stderr, res.stderr
    m = mount_pool(pool, name="again", options="pmem=force,replica_timeout=2")
    assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=60), _states(m.path)
    for name, data in acked.items():
        assert (m.path / name).read_bytes() == data, name
    m.unmount()
    assert cli("verify", pool, "--token-file", token).returncode == 0
    ip("link", "set", slow.veth, "up")
