"""End to end: a pool replicated to two real target daemons, through a real FUSE mount."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import MountPool
from helpers import (
    Mount,
    assert_check_clean,
    cli,
    diff_snapshots,
    fsync_path,
    fsync_tree,
    make_tree,
    pool_content,
    replica_file,
    snapshot,
    status_json,
)

from rpmemfs.tools.processes import TargetProcess


def _mkfs_replicated(pool: Path, targets: list[TargetProcess], name: str = "app",
                     size: str = "64M") -> None:
    args: list[str | os.PathLike[str]] = ["mkfs", pool, "--size", size]
    for t in targets:
        args += ["--replica", f"{t.address}/{name}"]
    res = cli(*args)
    assert res.returncode == 0, res.stderr


def _mount_copy_alone(work_dir: Path, t: TargetProcess, i: int, mount_pool: MountPool) -> Mount:
    """Copy the (stopped) target's replica pool and mount the copy on its own: failover."""
    copy = work_dir / f"copy{i}.pool"
    shutil.copy(replica_file(t, "app"), copy)
    assert_check_clean(copy)
    return mount_pool(copy, name=f"alone{i}", options="pmem=force,min_replicas=0,replica_timeout=2")


def test_fsync_reaches_every_replica(work_dir: Path, targets: list[TargetProcess],
                                     mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets)
    m = mount_pool(pool)
    make_tree(m.path, random.Random(3), nfiles=30, max_size=150_000)
    fsync_tree(m.path)
    st = status_json(m.path)
    assert [r["state"] for r in st["replicas"]] == ["in-sync", "in-sync"]
    assert {r["method"] for r in st["replicas"]} == {"apm", "gpspm"}
    for r in st["replicas"]:
        assert r["barriers"] >= 1
        assert r["flushes"] == r["barriers"], r  # exactly one flush per barrier per replica
    want = snapshot(m.path, meta=False)
    m.unmount()
    local = pool_content(pool)
    for t in targets:
        assert pool_content(replica_file(t, "app")) == local, f"replica on {t.address} differs"
    # a copy of a replica, mounted on its own, is the same filesystem
    for t in targets:
        t.stop()
    for i, t in enumerate(targets):
        alone = _mount_copy_alone(work_dir, t, i, mount_pool)
        got = snapshot(alone.path, meta=False)
        assert got == want, diff_snapshots(want, got)
        alone.unmount()


def test_mount_refuses_unreachable_replicas_unless_allowed(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets)
    targets[1].stop()
    m = mount_pool(pool, options="pmem=force,replica_timeout=2", start=False)
    err = m.start_expect_failure()
    assert "1 of 2 replicas usable" in err and targets[1].address in err
    ok = mount_pool(pool, name="ok", options="pmem=force,min_replicas=1,replica_timeout=2")
    (ok.path / "f").write_bytes(b"one replica is enough here")
    fsync_path(ok.path / "f")
    states = {r["address"]: r["state"] for r in status_json(ok.path)["replicas"]}
    assert states[targets[0].address] == "in-sync" and states[targets[1].address] != "in-sync"


def test_replica_with_another_uuid_is_refused(work_dir: Path, targets: list[TargetProcess],
                                              mount_pool: MountPool) -> None:
    a, b = work_dir / "a.pool", work_dir / "b.pool"
    _mkfs_replicated(a, targets[:1], name="a")
    _mkfs_replicated(b, targets[:1], name="b")
    poolset = work_dir / "b.set"
    host, port = targets[0].address.rsplit(":", 1)
    poolset.write_text(f"PMEMPOOLSET\n64M {b}\nREPLICA {host}:{port} a\n")
    m = mount_pool(poolset, options="pmem=force,replica_timeout=5", start=False)
    err = m.start_expect_failure()
    assert "uuid" in err.lower() and "0 of 1 replicas usable" in err


def test_kill9_initiator_every_replica_holds_acknowledged_fsyncs(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets)
    m = mount_pool(pool)
    journal = work_dir / "acked.txt"
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(m.path), str(journal)])
    time.sleep(random.Random(11).uniform(1.0, 2.5))
    m.kill9()
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    acked = [line.split() for line in journal.read_text().splitlines() if line.strip()]
    assert len(acked) > 5, "the workload acknowledged too little to test anything"
    for t in targets:
        t.stop()
    for i, t in enumerate(targets):
        alone = _mount_copy_alone(work_dir, t, i, mount_pool)
        for name, digest in acked:
            data = (alone.path / name).read_bytes()
            assert _digest(data) == digest, f"replica {i}: acknowledged {name} lost or changed"
        alone.unmount()


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


_WORKER = r"""
import hashlib, os, random, sys
mnt, journal = sys.argv[1], sys.argv[2]
rng = random.Random(7)
j = os.open(journal, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
i = 0
while True:
    name = f"f{i}"
    data = rng.randbytes(rng.choice([100, 4096, 20000, 200000]))
    fd = os.open(os.path.join(mnt, name), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    os.write(j, f"{name} {hashlib.sha256(data).hexdigest()}\n".encode())
    os.fsync(j)
    i += 1
"""


def test_replica_left_behind_gets_only_what_it_missed_at_the_next_mount(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets, size="256M")
    behind = replica_file(targets[1], "app")
    targets[1].stop()
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=2")
    (m.path / "f").write_bytes(b"written while replica 2 was away")
    fsync_path(m.path / "f")
    st = status_json(m.path)
    assert [r["state"] for r in st["replicas"]] == ["in-sync", "stale"], st["replicas"]
    m.unmount()
    assert pool_content(behind) != pool_content(pool)
    # back on its old address, reachable, but it missed the write above
    again = TargetProcess(behind.parent, listen=targets[1].address, pmem="msync",
                          log_path=work_dir / "target1-again.log")
    again.start()
    targets.append(again)  # the fixture stops it
    m = mount_pool(pool, name="again", options="pmem=force,replica_timeout=5")
    st = status_json(m.path)
    assert [r["state"] for r in st["replicas"]] == ["in-sync", "in-sync"], st["replicas"]
    resync = st["replicas"][1]["last_resync"]
    # Only the chunks the sync map recorded crossed the wire, not the 256 MiB pool.
    assert resync["compared_chunks"] == 0, resync
    assert 0 < resync["bytes_sent"] <= 8 << 20, resync
    (m.path / "g").write_bytes(b"more")
    fsync_path(m.path / "g")
    m.unmount()
    assert pool_content(behind) == pool_content(pool)


def test_verify_compares_chunk_checksums_and_finds_a_flipped_byte(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs_replicated(pool, targets)
    m = mount_pool(pool)
    make_tree(m.path, random.Random(5), nfiles=10, max_size=100_000)
    fsync_tree(m.path)
    refused = cli("verify", pool)
    assert refused.returncode != 0 and "is mounted at" in refused.stderr, refused.stderr
    m.unmount()

    res = cli("verify", pool, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["clean"] and len(report["replicas"]) == 2
    # The pool's chunk, the sync map's: 64K for a 64M pool, which has 1024 of them.
    assert report["chunk"] == 64 * 1024
    assert all(r["compared_chunks"] == 1024 and r["differing_chunks"] == 0 for r in report["replicas"])

    # One byte flipped in the middle of the second replica's pool: exactly that chunk differs.
    victim = replica_file(targets[1], "app")
    at = 40 * 1024 * 1024 + 12345
    with open(victim, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0xFF]))
    res = cli("verify", pool, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    first, second = report["replicas"]
    assert first["differing"] == [] and first["error"] is None
    assert second["differing"] == [{"offset": at // 65536 * 65536, "length": 65536}]
    assert second["differing_chunks"] == 1
    text = cli("verify", pool)
    assert text.returncode == 1 and "DIFFERS" in text.stdout and "NOT CLEAN" in text.stdout
    # A chunk of another size, asked for: the same range, counted in its chunks.
    res = cli("verify", pool, "--chunk", "1M", "--json")
    report = json.loads(res.stdout)
    assert report["chunk"] == 1 << 20 and report["replicas"][1]["compared_chunks"] == 64
    assert report["replicas"][1]["differing"] == [{"offset": at >> 20 << 20, "length": 1 << 20}]

    # A stopped target is reported, not skipped.
    targets[0].stop()
    res = cli("verify", pool, "--json")
    assert res.returncode == 1
    assert json.loads(res.stdout)["replicas"][0]["error"]
