"""The Pacemaker resource agent (mount/ocf/rpmemfs) driven action by action, as Pacemaker
would, on three "nodes" of this machine: each its own target daemon on loopback, pool
directory, mount point and agent state; real mounts, real daemons, real kill -9. What only a
real cluster shows (Pacemaker choosing, fencing, partitions) is scripts/test-ha.sh's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cli, status_json, wait_until, write_fsync

from rpmemfs.ha.ocf import Ocf
from rpmemfs.tools.processes import child_env

AGENT = Path(__file__).resolve().parents[2] / "mount" / "ocf" / "rpmemfs"
RPMEMFS = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "rpmemfs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """Three nodes' worth of agent parameters on one machine."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.names = ["n1", "n2", "n3"]
        self.nodes = " ".join(f"{n}=127.0.0.1:{_free_port()}" for n in self.names)
        self.token = root / "token"
        assert cli("token", "new", self.token).returncode == 0

    def mnt(self, node: str) -> Path:
        return self.root / node / "mnt"

    def pool(self, node: str) -> Path:
        return self.root / node / "pools" / "app"

    def env(self, node: str) -> dict[str, str]:
        return {**child_env(), "OCF_RESKEY_CRM_meta_on_node": node, "OCF_RESKEY_pool": "app",
                "OCF_RESKEY_directory": str(self.mnt(node)), "OCF_RESKEY_nodes": self.nodes,
                "OCF_RESKEY_pool_dir": str(self.root / node / "pools"), "OCF_RESKEY_size": "32M",
                "OCF_RESKEY_token_file": str(self.token), "OCF_RESKEY_mount_options": "pmem=msync",
                "OCF_RESKEY_replica_timeout": "3", "OCF_RESKEY_rpmemfs": str(RPMEMFS),
                "OCF_RESOURCE_INSTANCE": "app-clone:0", "HA_STATE_DIR": str(self.root / node / "run")}

    def ra(self, node: str, action: str) -> tuple[int, str]:
        done = subprocess.run([str(AGENT), action], env=self.env(node), capture_output=True, text=True,
                              timeout=120, check=False)
        return done.returncode, done.stderr

    def ok(self, node: str, action: str, want: Ocf = Ocf.SUCCESS) -> str:
        code, err = self.ra(node, action)
        assert code == want, f"{node} {action}: {code}, not {want.name}: {err}"
        return err

    def started(self, primary: str) -> None:
        """Every node started (serving its copy), then ``primary`` promoted."""
        for n in self.names:
            self.ok(n, "start")
        self.ok(primary, "promote")

    def mount_pid(self, node: str) -> int:
        return int(status_json(self.mnt(node))["pid"])


@pytest.fixture
def cluster(work_dir: Path) -> Iterator[Cluster]:
    c = Cluster(work_dir)
    try:
        yield c
    finally:
        for n in c.names:
            c.ra(n, "stop")


def _records(mnt: Path, first: int, n: int) -> None:
    for i in range(first, first + n):
        write_fsync(mnt / f"r{i}", f"record {i}\n".encode() * 50)


def _append(mnt: Path, first: int, n: int) -> None:
    """Records ``first`` .. ``first + n - 1``, 64 bytes each at their index in one file, each
    fsynced: a long log without filling the pool."""
    fd = os.open(mnt / "log", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for i in range(first, first + n):
            os.pwrite(fd, f"{i:063d}\n".encode(), i * 64)
            os.fsync(fd)
    finally:
        os.close(fd)


def _missing(mnt: Path, upto: int) -> list[int]:
    data = (mnt / "log").read_bytes() if upto else b""
    return [i for i in range(upto) if data[i * 64:(i + 1) * 64] != f"{i:063d}\n".encode()]


def _assert_records(mnt: Path, upto: int) -> None:
    for i in range(upto):
        assert (mnt / f"r{i}").read_bytes() == f"record {i}\n".encode() * 50, f"record {i}"


def _all_in_sync(mnt: Path) -> bool:
    doc = status_json(mnt)
    return all(r["state"] == "in-sync" for r in doc["replicas"]) and len(doc["replicas"]) == 2


def test_first_promote_makes_the_pool_and_a_failover_loses_nothing_acknowledged(cluster: Cluster) -> None:
    c = cluster
    for n in c.names:
        c.ok(n, "monitor", Ocf.NOT_RUNNING)
        c.ok(n, "start")
        c.ok(n, "monitor")
    assert "made the pool" in c.ok("n1", "promote")
    c.ok("n1", "monitor", Ocf.RUNNING_PROMOTED)
    others = [f"{a}/app" for a in c.nodes.split() if not a.startswith("n1=")]
    assert [f"{r['address']}/{r['name']}" for r in status_json(c.mnt("n1"))["replicas"]] == [
        o.split("=")[1] for o in others]
    _records(c.mnt("n1"), 0, 40)

    os.kill(c.mount_pid("n1"), signal.SIGKILL)  # the primary dies
    code, err = c.ra("n1", "monitor")
    assert code == Ocf.ERR_GENERIC, err
    said = c.ok("n2", "promote")
    assert "this node's copy, the most recent" in said, said
    c.ok("n2", "monitor", Ocf.RUNNING_PROMOTED)
    _assert_records(c.mnt("n2"), 40)
    _records(c.mnt("n2"), 40, 10)  # and it serves

    # Pacemaker recovers the dead node: stop (the dead mount detached), start as a replica.
    c.ok("n1", "stop")
    c.ok("n1", "monitor", Ocf.NOT_RUNNING)
    c.ok("n1", "start")
    assert wait_until(lambda: _all_in_sync(c.mnt("n2")), timeout=30), status_json(c.mnt("n2"))
    res = cli("verify", c.mnt("n2"))
    assert res.returncode == 0 and res.stdout.count("identical") == 2, res.stdout + res.stderr


def test_promote_takes_the_most_recent_copy_and_refuses_without_a_majority(cluster: Cluster) -> None:
    c = cluster
    c.started("n1")
    _records(c.mnt("n1"), 0, 10)
    c.ok("n3", "stop")  # n3 misses what follows; min_replicas=1 lets n1 go on with n2
    _records(c.mnt("n1"), 10, 20)
    os.kill(c.mount_pid("n1"), signal.SIGKILL)
    c.ok("n3", "start")
    said = c.ok("n3", "promote")
    assert "n2's copy, the most recent" in said, said
    _assert_records(c.mnt("n3"), 30)

    # Now n3 dies too, and n2 is down: n1 alone may not promote (n3's copy, not reached,
    # holds acknowledged writes n1's does not).
    os.kill(c.mount_pid("n3"), signal.SIGKILL)
    c.ok("n2", "stop")
    c.ok("n1", "stop")
    c.ok("n1", "start")
    code, err = c.ra("n1", "promote")
    assert code == Ocf.ERR_GENERIC and "only 1 of 3 copies reached, 2 needed" in err, err
    c.ok("n1", "monitor")  # left as it was: serving its copy, not promoted
    assert not os.path.ismount(c.mnt("n1"))


def test_a_running_old_primary_is_fenced_by_the_promote_and_demotes_to_a_replica(cluster: Cluster) -> None:
    c = cluster
    c.started("n1")
    _records(c.mnt("n1"), 0, 5)
    # Pacemaker promotes n2 while n1 still runs (a partition, before fencing): n1 must never
    # acknowledge again.
    c.ok("n2", "promote")
    fd = os.open(c.mnt("n1") / "late", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x")
        with pytest.raises(OSError) as e:
            os.fsync(fd)
        assert e.value.errno == 5  # EIO: its replicas are claimed by n2
    finally:
        os.close(fd)
    c.ok("n1", "monitor", Ocf.FAILED_PROMOTED)
    c.ok("n1", "demote")
    c.ok("n1", "monitor")
    assert wait_until(lambda: _all_in_sync(c.mnt("n2")), timeout=30), status_json(c.mnt("n2"))
    _assert_records(c.mnt("n2"), 5)
    assert not (c.mnt("n2") / "late").exists()  # made on n1 after the promote: never acknowledged


def test_failovers_back_and_forth_with_writes_during_each_rejoin_lose_nothing(cluster: Cluster) -> None:
    """Each failover's new primary writes while the old one rejoins (its copy is compared in
    full and resynced under the writes); the next failover promotes that copy. A compare by
    CRC-32C once called such a copy equal while its log area header was a generation behind
    (rpmemfs/chunksum.py), and the third failover here lost the second primary's writes."""
    c = cluster
    c.started("n1")
    # Each mount after a failover checkpoints the log it replays into the other log area,
    # under the next generation: n2's mount into area 1, n1's into area 0 while n2 is down,
    # so that n2's area 0 holds a valid header of an older generation when it rejoins.
    _append(c.mnt("n1"), 0, 1000)
    written = 1000
    for old, new in [("n1", "n2"), ("n2", "n1"), ("n1", "n2")]:
        os.kill(c.mount_pid(old), signal.SIGKILL)
        c.ok(new, "promote")  # its mount checkpoints a long log: a new log area generation
        c.ok(old, "stop")
        c.ok(old, "start")  # it rejoins while the new primary writes
        assert _missing(c.mnt(new), written) == []
        # Enough for the next mount of this copy to checkpoint its log.
        _append(c.mnt(new), written, 3000)
        written += 3000
        assert wait_until(lambda new=new: _all_in_sync(c.mnt(new)), timeout=30), status_json(c.mnt(new))
    os.kill(c.mount_pid("n2"), signal.SIGKILL)
    c.ok("n1", "promote")
    assert _missing(c.mnt("n1"), written) == []
    c.ok("n2", "stop")
    c.ok("n2", "start")
    assert wait_until(lambda: _all_in_sync(c.mnt("n1")), timeout=30), status_json(c.mnt("n1"))
    res = cli("verify", c.mnt("n1"))
    assert res.returncode == 0 and res.stdout.count("identical") == 2, res.stdout + res.stderr


def test_ocf_tester_passes(work_dir: Path) -> None:
    tester = shutil.which("ocf-tester")
    assert tester, "ocf-tester (Debian's resource-agents) is installed by scripts/install.sh --test"
    token = work_dir / "token"
    assert cli("token", "new", token).returncode == 0
    args = [tester, "-n", "rpmemfs-test"]
    for k, v in {"pool": "app", "directory": work_dir / "mnt", "pool_dir": work_dir / "pools",
                 "nodes": f"{socket.gethostname()}=127.0.0.1:{_free_port()}", "size": "32M",
                 "token_file": token, "mount_options": "pmem=msync", "rpmemfs": RPMEMFS}.items():
        args += ["-o", f"{k}={v}"]
    env = {**child_env(), "HA_STATE_DIR": str(work_dir / "run")}
    done = subprocess.run([*args, str(AGENT)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "passed all tests" in out, out
