"""A mount killed with -9 while it resyncs a replica: the replica then holds parts of two
points in time. Every replica must stay either consistent (a copy checks clean and mounts
alone with every acknowledged write) or marked on its target as an unfinished resync, which
promote and recover refuse as a source; the next mount of the pool finishes the resync and
clears the mark.

The resync is made slow enough to be cut at random moments by a rate limit (tc tbf) on the
link of the replica being resynced; its target runs on a host of its own (a network
namespace behind a veth pair).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

from conftest import Host, MountPool, ip
from helpers import assert_check_clean, cli, pool_content, replica_file, status_json, wait_until, write_fsync

from rpmemfs.pool.layout import BLOCK

OPTS = "pmem=force,min_replicas=1,replica_timeout=2,commit=0"


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


def _states(mnt: Path) -> list[str]:
    return [r["state"] for r in status_json(mnt)["replicas"]]


def _pool_entry(host: Host, token: Path) -> dict[str, object]:
    res = cli("pools", host.target.address, "--token-file", token, "--json")
    entry: dict[str, object] = json.loads(res.stdout)["app"]
    # The exit status says whether some pool is marked (1) or none (0).
    owner = entry.get("owner")
    marked = isinstance(owner, dict) and bool(owner.get("resync"))
    assert res.returncode == (1 if marked else 0), res.stderr
    return entry


def _marked(host: Host, token: Path) -> bool:
    owner = _pool_entry(host, token)["owner"]
    assert isinstance(owner, dict)
    return owner.get("resync") is not None


def _alone(source: Path, copy: Path, hosts: list[Host], mount_pool: MountPool,
           acked: dict[str, bytes]) -> None:
    """A copy of a replica's pool checks clean and, mounted alone, holds every acknowledged
    write. Its replicas are out of its reach meanwhile (links down): a copy that claimed them
    would fence the pool this test goes on with."""
    shutil.copyfile(source, copy)
    assert_check_clean(copy)
    for h in hosts:
        ip("link", "set", h.veth, "down")
    try:
        m = mount_pool(copy, name=copy.stem, options="pmem=force,min_replicas=0,replica_timeout=1")
        for name, data in acked.items():
            assert (m.path / name).read_bytes() == data, (source, name)
        m.unmount()
    finally:
        for h in hosts:
            ip("link", "set", h.veth, "up")


def test_a_mount_killed_during_resync_leaves_the_replica_marked_and_refused_as_a_source(
        work_dir: Path, hosts: list[Host], mount_pool: MountPool) -> None:
    token = work_dir / "token"
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "128M", "--token-file", token,
              *(a for h in hosts for a in ("--replica", f"{h.target.address}/app")))
    assert res.returncode == 0, res.stderr
    slow = hosts[1]
    rng = random.Random(1414)
    acked: dict[str, bytes] = {}
    marked_seen = 0
    m = mount_pool(pool, options=OPTS)
    for round_ in range(3):
        for i in range(3):
            data = os.urandom(5000 + i)
            write_fsync(m.path / f"r{round_}-in-sync-{i}", data)
            acked[f"r{round_}-in-sync-{i}"] = data
        # The replica misses a lot while its link is down...
        ip("link", "set", slow.veth, "down")
        for i in range(24):
            data = os.urandom(1 << 20)
            write_fsync(m.path / f"r{round_}-missed-{i}", data)
            acked[f"r{round_}-missed-{i}"] = data
        # ...and gets it back over a slow link (24 MiB at 40 Mbit/s: about 5 s)...
        _tc("qdisc", "add", "dev", slow.veth, "root", "tbf", "rate", "40mbit", "burst", "32kb",
            "latency", "400ms")
        ip("link", "set", slow.veth, "up")
        assert wait_until(lambda: _states(m.path)[1] == "resyncing", timeout=30), _states(m.path)  # noqa: B023
        # ...until the mount is killed somewhere in the middle.
        time.sleep(rng.uniform(0.3, 3.0))
        m.kill9()
        _tc("qdisc", "del", "dev", slow.veth, "root")

        marked = _marked(slow, token)
        marked_seen += marked
        if not marked:
            # The resync ended before the kill: then the replica is the pool, byte for byte.
            assert pool_content(replica_file(slow.target)) == pool_content(pool)
        else:
            # Refused as a source, and refusing changed nothing: no pool made, no epoch moved.
            epoch = _pool_entry(slow, token)["owner"]
            for command in ("promote", "recover"):
                new = work_dir / f"{command}{round_}.pool"
                res = cli(command, new, "--from", f"{slow.target.address}/app", "--token-file", token)
                assert res.returncode == 1, res.stdout + res.stderr
                assert "not a consistent copy" in res.stderr, res.stderr
                assert "--unfinished-resync" in res.stderr, res.stderr
                assert not new.exists()
            assert _pool_entry(slow, token)["owner"] == epoch
        # The replica that stayed in sync is the pool as every fsync left it.
        _alone(replica_file(hosts[0].target), work_dir / f"copy{round_}.pool", hosts, mount_pool, acked)
        # The pool's next mount finishes the resync and clears the mark.
        m = mount_pool(pool, name=f"again{round_}", options=OPTS)
        assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=60), _states(m.path)  # noqa: B023
        assert wait_until(lambda: not _marked(slow, token), timeout=10)
    assert marked_seen >= 2, "the kill came after the resync ended too often to test anything"
    m.unmount()
    assert cli("verify", pool, "--token-file", token).returncode == 0
    for h in hosts:
        assert pool_content(replica_file(h.target)) == pool_content(pool), h.target.address
    _alone(replica_file(slow.target), work_dir / "resynced.pool", hosts, mount_pool, acked)


def test_promote_takes_an_unfinished_copy_only_when_told_and_then_clears_the_mark(
        work_dir: Path, hosts: list[Host], mount_pool: MountPool) -> None:
    token = work_dir / "token"
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", "--token-file", token,
              *(a for h in hosts for a in ("--replica", f"{h.target.address}/app")))
    assert res.returncode == 0, res.stderr
    slow = hosts[1]
    m = mount_pool(pool, options=OPTS)
    ip("link", "set", slow.veth, "down")
    for i in range(16):
        write_fsync(m.path / f"f{i}", os.urandom(1 << 20))
    _tc("qdisc", "add", "dev", slow.veth, "root", "tbf", "rate", "40mbit", "burst", "32kb",
        "latency", "400ms")
    ip("link", "set", slow.veth, "up")
    assert wait_until(lambda: (status_json(m.path)["replicas"][1].get("resync") or {}).get("done", 0) > 0,
                      timeout=30), status_json(m.path)["replicas"]
    m.kill9()
    _tc("qdisc", "del", "dev", slow.veth, "root")
    assert _marked(slow, token)
    table = cli("pools", slow.target.address, "--token-file", token)
    assert "UNFINISHED" in table.stdout and table.returncode == 1, table.stdout
    new = work_dir / "new.pool"
    res = cli("promote", new, "--from", f"{slow.target.address}/app", "--token-file", token,
              "--unfinished-resync")
    assert res.returncode == 0, res.stderr
    # The new primary holds the source's bytes as they are, so the source is in sync with it.
    assert not _marked(slow, token)
    # (Past the header blocks, where the new primary's epoch already stands.)
    assert pool_content(new)[2 * BLOCK:] == pool_content(replica_file(slow.target))[2 * BLOCK:]
