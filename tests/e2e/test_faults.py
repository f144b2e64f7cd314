"""Failures of replicas while a mount serves: kill -9, SIGSTOP past the timeout, return, rejoin.

Each test runs real target daemons, each on a host of its own (a network namespace the test
creates, behind a veth link), and a real FUSE mount; the faults are real (signals to the
target processes). What they assert: no fsync acknowledged under the policy is missing on a
replica counted in sync, the mount keeps serving (or says EIO) as ``min_replicas`` says, and a
replica that comes back receives what it missed and rejoins.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Host, MountPool
from helpers import (
    cli,
    fsync_path,
    pool_content,
    replica_file,
    status_json,
    stop_process,
    wait_until,
    write_fsync,
)

from rpmemfs.tools.processes import TargetProcess

POOL_SIZE = "128M"


@pytest.fixture
def targets(hosts: list[Host]) -> Iterator[list[TargetProcess]]:
    """The two targets, each on a host of its own (a network namespace behind a veth link).
    Tests append the daemons they restart; teardown kills those too (they outlive the
    namespace's name otherwise)."""
    procs = [h.target for h in hosts]
    yield procs
    for t in procs:
        t.close()


def _mkfs(pool: Path, targets: list[TargetProcess]) -> None:
    args: list[str | os.PathLike[str]] = ["mkfs", pool, "--size", POOL_SIZE]
    token = pool.parent / "token"
    if token.exists():
        args += ["--token-file", token]
    for t in targets:
        args += ["--replica", f"{t.address}/app"]
    res = cli(*args)
    assert res.returncode == 0, res.stderr


def _states(mnt: Path) -> list[str]:
    return [r["state"] for r in status_json(mnt)["replicas"]]


def _restart(t: TargetProcess, work_dir: Path, n: int) -> TargetProcess:
    """The same daemon (host, pool dir, options) again, on the address it had."""
    again = t.respawn(log_path=work_dir / f"restarted{n}.log")
    again.start()
    return again



def test_kill9_of_a_target_keeps_serving_within_policy_and_the_replica_rejoins(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=2")
    acked: dict[str, bytes] = {}
    for i in range(20):
        data = os.urandom(5000 + i)
        write_fsync(m.path / f"before{i}", data)
        acked[f"before{i}"] = data
    targets[1].kill()
    # Every fsync still succeeds: one in-sync replica is what the policy asks.
    for i in range(40):
        data = os.urandom(3000 + 7 * i)
        write_fsync(m.path / f"during{i}", data)
        acked[f"during{i}"] = data
    assert _states(m.path) == ["in-sync", "stale"]
    again = _restart(targets[1], work_dir, 1)
    targets.append(again)
    assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=30), status_json(m.path)
    status = status_json(m.path)["replicas"][1]
    resync = status["last_resync"]
    # The map told it what it missed: no full comparison, a few chunks, not the pool.
    assert resync["compared_chunks"] == 0 and 0 < resync["bytes_sent"] < 16 << 20, resync
    for i in range(10):
        data = os.urandom(1000 + i)
        write_fsync(m.path / f"after{i}", data)
        acked[f"after{i}"] = data
    for name, data in acked.items():
        assert (m.path / name).read_bytes() == data, name
    m.unmount()
    local = pool_content(pool)
    for t in targets[:1] + [again]:
        assert pool_content(replica_file(t)) == local, t.address
    res = cli("verify", pool)
    assert res.returncode == 0, res.stdout + res.stderr


def test_fsync_says_eio_below_min_replicas_and_works_again_when_the_replica_is_back(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,replica_timeout=2")  # min_replicas: all
    write_fsync(m.path / "first", b"both replicas have this")
    targets[0].kill()
    with pytest.raises(OSError) as err:
        write_fsync(m.path / "second", b"only local and one replica")
    assert err.value.errno == errno.EIO
    # Nothing local is lost: the data is there, and reads keep working.
    assert (m.path / "second").read_bytes() == b"only local and one replica"
    with pytest.raises(OSError) as err:
        fsync_path(m.path / "second")
    assert err.value.errno == errno.EIO
    again = _restart(targets[0], work_dir, 1)
    targets.append(again)
    assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=30), status_json(m.path)
    fsync_path(m.path / "second")
    write_fsync(m.path / "third", b"and this")
    m.unmount()
    local = pool_content(pool)
    assert pool_content(replica_file(again)) == local
    assert pool_content(replica_file(targets[1])) == local
    # The log names the replica that was missing.
    assert f"{targets[0].address}/app" in m.output(), m.output()[-3000:]


def test_a_target_stopped_past_the_timeout_costs_one_timeout_not_a_hung_fsync(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=1")
    write_fsync(m.path / "a", b"a" * 10000)
    assert targets[1].proc is not None
    stop_process(targets[1].proc.pid)
    # The first fsync waits out the timeout on the stopped replica, then succeeds (policy 1).
    write_fsync(m.path / "b", b"b" * 10000)
    assert _states(m.path) == ["in-sync", "stale"]
    for i in range(20):
        write_fsync(m.path / f"c{i}", bytes([i]) * 9000)
    os.kill(targets[1].proc.pid, signal.SIGCONT)
    assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=40), status_json(m.path)
    write_fsync(m.path / "d", b"d" * 10000)
    m.unmount()
    local = pool_content(pool)
    for t in targets:
        assert pool_content(replica_file(t)) == local, t.address


def test_a_mount_waits_once_for_a_replica_that_answers_nothing(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """A stopped target (a dead node's address is the same: nothing answers) is asked who owns
    its pool, and not waited for a second time to connect: the mount goes on without it, and
    the background retry brings it in once it answers (what an automatic failover's new
    primary, docs/ha.md, needs of a mount while the old primary's node is dead)."""
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    assert targets[1].proc is not None
    stop_process(targets[1].proc.pid)
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=1")
    doc = status_json(m.path)
    assert [r["state"] for r in doc["replicas"]] == ["in-sync", "stale"], doc
    why = doc["replicas"][1]["last_error"]
    # The probe's words ("who owns it"), not a connection's ("cannot open"): connecting was
    # not tried again at mount.
    assert "no answer within 1s" in why or "cannot ask who owns it" in why, why
    assert "cannot open" not in why, why
    write_fsync(m.path / "a", b"a" * 10000)
    os.kill(targets[1].proc.pid, signal.SIGCONT)
    assert wait_until(lambda: _states(m.path) == ["in-sync", "in-sync"], timeout=40), status_json(m.path)
    m.unmount()
    assert pool_content(replica_file(targets[1])) == pool_content(pool)


def _epoch(path: Path) -> str:
    from rpmemfs.pool.layout import Header, show_epoch

    return show_epoch(Header.decode(path.read_bytes()[:4096]).epoch)


def test_an_old_initiator_is_fenced_off_a_replica_that_was_mounted_on_its_own(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,replica_timeout=2")
    write_fsync(m.path / "before", b"written by the first primary")
    m.unmount()
    old_epoch = _epoch(pool)
    # Failover: the replica pool on target 1's node is mounted there on its own. It cannot
    # replicate to itself (its target daemon would have to open the pool the mount holds)
    # but it takes target 0 over as its replica.
    promoted = replica_file(targets[1])
    p = mount_pool(promoted, name="promoted", options="pmem=force,min_replicas=0,replica_timeout=2")
    assert _states(p.path) == ["in-sync", "stale"], status_json(p.path)["replicas"]
    in_use = status_json(p.path)["replicas"][1]["last_error"] or ""
    # "in use" says who holds it: this very mount (the pool is the replica's own file)
    assert p.proc is not None and "in use" in in_use and f"pid {p.proc.pid} " in in_use, in_use
    write_fsync(p.path / "after", b"written by the new primary")
    p.unmount()
    new_epoch = _epoch(promoted)
    assert new_epoch != old_epoch
    # The old primary comes back: both replicas moved on past what it knows.
    # However often it is retried (as a service manager would), it is refused, and a refused
    # mount changes no epoch: the old pool can never come to outrank the new primary.
    for attempt in range(3):
        again = mount_pool(pool, name=f"old{attempt}", options="pmem=force,replica_timeout=2", start=False)
        err = again.start_expect_failure()
        assert "epoch" in err and new_epoch in err and old_epoch in err, err
        assert "taken over" in err and "nothing was changed" in err, err
        assert _epoch(pool) == old_epoch
    # Nothing was written over: target 0 still holds the new primary's file.
    res = cli("verify", promoted, "--json")
    report = json.loads(res.stdout)
    assert report["replicas"][0]["error"] is None and not report["replicas"][0]["differing"], report


def test_flipped_bytes_in_a_replica_are_found_by_verify_and_repaired_by_sync(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,replica_timeout=5")
    for i in range(8):
        write_fsync(m.path / f"f{i}", os.urandom(70000))
    # A replica damaged under a live mount: a byte flipped in its file on the target node.
    victim = replica_file(targets[0])
    data_at = 48 << 20
    with open(victim, "r+b") as f:
        f.seek(data_at)
        old = f.read(1)
        f.seek(data_at)
        f.write(bytes([old[0] ^ 0xFF]))
    res = cli("verify", m.path, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    bad = report["replicas"][0]["differing"]
    assert len(bad) == 1 and bad[0]["offset"] <= data_at < bad[0]["offset"] + bad[0]["length"], report
    assert report["replicas"][1]["differing"] == [], report
    res = cli("sync", m.path, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)
    # verify and sync count in the same chunks, and report them alike.
    assert summary["chunk"] == report["chunk"] == 64 << 10, (summary, report)
    for counted in (report, summary):
        assert [r["differing_chunks"] for r in counted["replicas"]] == [1, 0], counted
        assert counted["replicas"][0]["compared_chunks"] == counted["replicas"][1]["compared_chunks"] > 0
    assert summary["replicas"][0]["compared_chunks"] == report["replicas"][0]["compared_chunks"]
    assert summary["replicas"][0]["chunks_sent"] == 1, summary
    # Of that chunk, only the 4 KiB block with the flipped byte crossed the wire.
    assert summary["replicas"][0]["bytes_sent"] == 4096, summary
    assert cli("verify", m.path).returncode == 0
    m.unmount()
    # And on the unmounted pool: damage, verify finds it, sync repairs only that chunk.
    with open(replica_file(targets[1]), "r+b") as f:
        f.seek(4096 + 100)  # the backup header block: metadata, not data
        f.write(b"\x00\x01\x02")
    res = cli("verify", pool, "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 1 and report["replicas"][1]["differing"], res.stdout
    res = cli("sync", pool, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)
    for counted in (report, summary):
        assert [r["differing_chunks"] for r in counted["replicas"]] == [0, 1], counted
    assert summary["replicas"][1]["bytes_sent"] == 4096, summary
    assert ([r["compared_chunks"] for r in summary["replicas"]]
            == [r["compared_chunks"] for r in report["replicas"]]), (summary, report)
    text = cli("sync", pool)
    assert text.returncode == 0 and "chunks compared, 0 differing, 0 chunks sent" in text.stdout, text.stdout
    res = cli("verify", pool)
    assert res.returncode == 0, res.stdout + res.stderr
    local = pool_content(pool)
    for t in targets:
        assert pool_content(replica_file(t)) == local


def test_recover_rebuilds_a_lost_pool_from_a_replica(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,replica_timeout=5")
    files = {f"f{i}": os.urandom(30000 + i) for i in range(12)}
    for name, data in files.items():
        write_fsync(m.path / name, data)
    m.unmount()
    before = pool_content(pool)
    pool.unlink()  # the local node lost its pool
    token = work_dir / "token"
    res = cli("recover", pool, "--from", f"{targets[1].address}/app", "--token-file", token)
    assert res.returncode == 0, res.stdout + res.stderr
    assert pool_content(pool) == before
    refused = cli("recover", pool, "--from", f"{targets[1].address}/app", "--token-file", token)
    assert refused.returncode != 0 and "exists" in refused.stderr, refused.stderr
    m = mount_pool(pool, name="recovered", options="pmem=force,replica_timeout=5")
    replicas = status_json(m.path)["replicas"]
    assert [r["state"] for r in replicas] == ["in-sync", "in-sync"], replicas
    # The source needed nothing; the other replica was compared in full (nothing says how
    # far it had got).
    assert replicas[1]["last_resync"] is None or replicas[1]["last_resync"]["compared_chunks"] == 0
    assert replicas[0]["last_resync"]["compared_chunks"] > 0
    # Its one difference is the two header blocks with the epoch this mount claims under,
    # which the compare finds before the first durability point would carry them (a compare
    # by CRC-32C could not see a header that differs only so: rpmemfs/chunksum.py).
    assert replicas[0]["last_resync"]["differing_chunks"] == 1, replicas[0]
    assert replicas[0]["last_resync"]["bytes_sent"] == 2 * 4096, replicas[0]
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data
    m.unmount()


def test_kill9_of_the_initiator_while_a_replica_is_stale_then_both_catch_up(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,min_replicas=1,replica_timeout=2")
    acked: dict[str, bytes] = {}
    targets[1].kill()
    for i in range(15):
        data = os.urandom(9000 + i)
        write_fsync(m.path / f"f{i}", data)
        acked[f"f{i}"] = data
    # Unfsynced stores too: they reach the local pool, neither replica, nor the sync map.
    with open(m.path / "f0", "r+b") as f:
        f.write(b"never fsynced")
    m.kill9()
    again = _restart(targets[1], work_dir, 1)
    targets.append(again)
    m = mount_pool(pool, name="after-crash", options="pmem=force,replica_timeout=5")
    replicas = status_json(m.path)["replicas"]
    assert [r["state"] for r in replicas] == ["in-sync", "in-sync"], replicas
    # The mount did not end cleanly, so the map is not trusted: both were compared in full,
    # and the one that missed the fsyncs got what differs.
    for r in replicas:
        assert r["last_resync"]["compared_chunks"] > 0, r
    assert replicas[0]["last_resync"]["differing_chunks"] >= 1  # the unfsynced store
    assert replicas[1]["last_resync"]["differing_chunks"] >= 2
    for name, data in acked.items():
        got = (m.path / name).read_bytes()
        assert got == data or (name == "f0" and got[:13] == b"never fsynced"), name
    m.unmount()
    assert cli("verify", pool).returncode == 0


def test_a_full_disk_on_a_target_refuses_new_pools_and_leaves_existing_ones_working(
        work_dir: Path, mount_pool: MountPool) -> None:
    small = work_dir / "small-disk"
    small.mkdir()
    # (mode: a target refuses a pool directory others may write, as a fresh tmpfs is: 1777)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160M,mode=0700", "tmpfs", str(small)], check=True)
    targets: list[TargetProcess] = []
    try:
        for i, d in enumerate((work_dir / "roomy", small)):
            d.mkdir(exist_ok=True)
            t = TargetProcess(d, pmem="force", log_path=work_dir / f"t{i}.log")
            t.start()
            targets.append(t)
        pool = work_dir / "app.pool"
        _mkfs(pool, targets)  # 128M on each: fits
        m = mount_pool(pool, options="pmem=force,replica_timeout=5")
        write_fsync(m.path / "a", b"a" * 50000)
        # Fill the target's disk to the last block.
        # Unbuffered: a buffered file would try the rest of a short write again at close.
        with open(small / ".filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(1 << 20))
            except OSError as e:
                assert e.errno == errno.ENOSPC
        # Its pool's space was reserved when it was made: replication goes on.
        for i in range(10):
            write_fsync(m.path / f"b{i}", os.urandom(30000))
        assert _states(m.path) == ["in-sync", "in-sync"]
        # A new pool on the full target is refused, clearly, and nothing half made stays.
        other = work_dir / "other.pool"
        res = cli("mkfs", other, "--size", "16M", "--replica", f"{targets[1].address}/other")
        assert res.returncode != 0
        assert "not enough free space" in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (small / "other").exists()
        m.unmount()
        assert pool_content(replica_file(targets[1])) == pool_content(pool)
    finally:
        for t in targets:
            t.close()
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_after_a_long_outage_fsync_works_again_within_seconds_of_the_targets_return(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    _mkfs(pool, targets)
    m = mount_pool(pool, options="pmem=force,replica_timeout=2")  # min_replicas: all
    write_fsync(m.path / "first", b"both replicas have this")
    targets[1].kill()
    down = time.monotonic()
    # Down for 20 s: every fsync says EIO meanwhile, and the backoff reaches its cap.
    while time.monotonic() - down < 20:
        with pytest.raises(OSError) as err:
            write_fsync(m.path / "during", os.urandom(5000))
        assert err.value.errno == errno.EIO
        time.sleep(0.5)
    again = _restart(targets[1], work_dir, 1)
    targets.append(again)
    back = time.monotonic()
    while True:
        try:
            fsync_path(m.path / "during")
            break
        except OSError as exc:
            assert exc.errno == errno.EIO
            assert time.monotonic() - back < 30, status_json(m.path)
            time.sleep(0.05)
    took = time.monotonic() - back
    print(f"fsync works again {took:.2f} s after the target's return (a 20 s outage)")
    # The goal is 5 s; slack for a 2-core machine shared with other test runs.
    assert took < 8, took
    replicas = status_json(m.path)["replicas"]
    assert [r["state"] for r in replicas] == ["in-sync", "in-sync"], replicas
    # Its error is cleared once it is in sync; the mount's log keeps it, with its time.
    assert replicas[1]["last_error"] is None and replicas[1]["last_error_at"] is None, replicas[1]
    assert "is in sync again (its last error, at 20" in m.output(), m.output()[-2000:]
    # The probes that found it back cost its log nothing at the default level.
    assert "handshake" not in again.log_text(), again.log_text()
    write_fsync(m.path / "after", b"and this")
    m.unmount()
    local = pool_content(pool)
    for t in (targets[0], again):
        assert pool_content(replica_file(t)) == local, t.address
