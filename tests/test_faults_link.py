"""Cut links: target daemons on hosts of their own (network namespaces joined by veth pairs),
and a link taken down and up again under a workload of write + fsync.

A cut link is the failure where nothing answers and nothing says no: the barrier waits out
``replica_timeout``, the replica turns stale, the mount goes on (min_replicas=1), and when the
link is back the keeper reconnects it, sends what the sync map recorded, and it rejoins.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import cli, pool_content, replica_file, status_json, wait_until

from rpmemfs.target.spawn import TargetProcess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    netns: str
    veth: str  # the host side of its link
    target: TargetProcess


@pytest.fixture
def hosts(work_dir: Path) -> Iterator[list[Host]]:
    """Two hosts 10.201.N.2, each reached over its own veth link from 10.201.N.1."""
    tag = uuid.uuid4().hex[:6]
    token = work_dir / "token"
    token.write_text(uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    made: list[Host] = []
    try:
        for i in range(2):
            ns, veth, peer = f"rpm-{tag}-{i}", f"vh{tag}{i}", f"vn{tag}{i}"
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot create a network namespace here: {exc.stderr.strip()}")
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("addr", "add", f"10.201.{i}.1/30", "dev", veth)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"10.201.{i}.2/30", "dev", peer)
            _ip("-n", ns, "link", "set", peer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            d = work_dir / f"host{i}"
            d.mkdir()
            t = TargetProcess(d, listen=f"10.201.{i}.2:7420", token_file=token, pmem="force",
                              persist="apm" if i == 0 else None, prefix=["ip", "netns", "exec", ns],
                              log_path=work_dir / f"host{i}.log")
            made.append(Host(ns, veth, t))
            t.start()
        yield made
    finally:
        for h in made:
            h.target.close()
            subprocess.run(["ip", "link", "del", h.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)


def _write_fsync(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _states(mnt: Path) -> list[str]:
    return [r["state"] for r in status_json(mnt)["replicas"]]


def test_a_cut_link_costs_one_timeout_and_the_replica_catches_up_when_it_is_back(
        work_dir: Path, hosts: list[Host], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "128M", "--token-file", work_dir / "token",
              *(a for h in hosts for a in ("--replica", f"{h.target.address}/app")))
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=2")
    acked: dict[str, bytes] = {}

    def write(name: str) -> None:
        data = os.urandom(6000 + len(acked))
        _write_fsync(m.path / name, data)
        acked[name] = data

    for i in range(10):
        write(f"before{i}")
    _ip("link", "set", hosts[1].veth, "down")
    for i in range(30):
        write(f"cut{i}")  # the first one waits out the timeout; all succeed by the policy
    assert _states(m.path) == ["in-sync", "stale"]
    reason = status_json(m.path)["replicas"][1]["last_error"]
    assert hosts[1].target.address in reason, reason
    _ip("link", "set", hosts[1].veth, "up")
    assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=60), status_json(m.path)
    resync = status_json(m.path)["replicas"][1]["last_resync"]
    assert resync["compared_chunks"] == 0 and 0 < resync["bytes_sent"] < 32 << 20, resync
    for i in range(5):
        write(f"after{i}")
    for name, data in acked.items():
        assert (m.path / name).read_bytes() == data, name
    m.unmount()
    local = pool_content(pool)
    for h in hosts:
        assert pool_content(replica_file(h.target)) == local, h.target.address
    assert cli("verify", pool).returncode == 0
    # Each replica, mounted on its own (a copy, targets stopped), holds every acknowledged file.
    for h in hosts:
        h.target.close()
    for i, h in enumerate(hosts):
        copy = work_dir / f"copy{i}.pool"
        shutil.copy(replica_file(h.target), copy)
        alone = mount_pool(copy, name=f"alone{i}", options="pmem=force,min_replicas=0,replica_timeout=1")
        for name, data in acked.items():
            assert (alone.path / name).read_bytes() == data, (h.target.address, name)
        alone.unmount()
