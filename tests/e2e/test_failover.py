"""Failover that cannot split the brain: an old primary that comes back after another copy of
its pool took the replicas over is refused (or fenced while it runs), and it never damages a
replica, however often it retries.

Real target daemons on loopback, real FUSE mounts, the old primary's daemon killed with -9.
The new primary is made as an operator makes it today: `rpmemfs recover NEW --from REPLICA`,
then mounted with the same replicas; its mount claims them under a newer epoch, which each
target records beside the pool (target/owners.py) before any byte is written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import (
    assert_check_clean,
    assert_clean_error,
    cli,
    describe,
    mkfs_replicated,
    pool_content,
    replica_file,
    status_json,
    wait_until,
    write_fsync,
)

from rpmemfs.pool.layout import Header, next_epoch, show_epoch
from rpmemfs.tools.processes import TargetProcess

OPTS = "pmem=force,replica_timeout=2"


def _epoch(path: Path) -> str:
    return show_epoch(Header.decode(path.read_bytes()[:4096]).epoch)


def _failover(work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool,
              old_options: str = OPTS) -> tuple[Path, Path, dict[str, bytes]]:
    """A primary writes and dies (kill -9); a new primary is recovered from replica 0 and
    mounted (claiming both replicas). Returns the old pool, the new pool, what was acked."""
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=old_options)
    acked = {f"a{i}": bytes([65 + i]) * (3000 + 5000 * i) for i in range(4)}
    for name, data in acked.items():
        write_fsync(a.path / name, data)
    a.kill9()
    new = work_dir / "new.pool"
    res = cli("recover", new, "--from", f"{targets[0].address}/app")
    assert res.returncode == 0, res.stderr
    return pool, new, acked


def _fsync_fails(path: Path) -> None:
    """A write and fsync there: the fsync must fail with EIO (a fenced primary's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 5000)
        try:
            os.fsync(fd)
        except OSError as e:
            assert e.errno == errno.EIO
        else:
            raise AssertionError("the fenced primary's fsync returned 0")
    finally:
        os.close(fd)


def _refused(mount_pool: MountPool, pool: Path, name: str, options: str = OPTS) -> str:
    return mount_pool(pool, name=name, options=options, start=False).start_expect_failure()


def _alone(copy_of: Path, work_dir: Path, name: str, mount_pool: MountPool) -> Path:
    """A copy of a replica's pool file, mounted on its own (min_replicas=0); its mountpoint."""
    copy = work_dir / f"{name}.pool"
    shutil.copyfile(copy_of, copy)
    assert_check_clean(copy)
    m = mount_pool(copy, name=name, options="pmem=force,min_replicas=0,replica_timeout=1")
    return m.path


def test_the_old_primary_back_before_the_new_one_writes_is_refused(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool, new, acked = _failover(work_dir, targets, mount_pool)
    q = mount_pool(new, name="q", options=OPTS)
    assert [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"]
    old_epoch = _epoch(pool)
    # Node A is back before Q wrote anything, and its service manager retries the mount.
    for attempt in range(3):
        err = _refused(mount_pool, pool, f"old{attempt}")
        assert "taken over" in err and "nothing was changed" in err, err
        assert _epoch(pool) == old_epoch  # a refused mount moves no epoch
    # Q's acknowledged fsyncs are on both replicas.
    more = {f"q{i}": bytes([97 + i]) * 7000 for i in range(3)}
    for name, data in more.items():
        write_fsync(q.path / name, data)
    acked.update(more)
    q.unmount()
    assert cli("verify", new).returncode == 0
    for t in targets:
        assert pool_content(replica_file(t)) == pool_content(new), t.address
    # Each replica's pool, copied, checks clean and mounts alone with every acknowledged write.
    for i, t in enumerate(targets):
        mnt = _alone(replica_file(t), work_dir, f"copy{i}", mount_pool)
        for name, data in acked.items():
            assert (mnt / name).read_bytes() == data, (t.address, name)


def test_a_running_old_primary_is_fenced_when_the_new_one_claims_its_replicas(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "before", b"b" * 9000)
    # While A still runs (a partition it cannot see, say), a new primary is made and mounted.
    new = work_dir / "new.pool"
    assert cli("recover", new, "--from", f"{targets[0].address}/app").returncode == 0
    q = mount_pool(new, name="q", options=OPTS)
    # A's writes no longer reach either replica: its fsync fails (min_replicas is all) ...
    _fsync_fails(a.path / "late")
    # ... and keeps failing: its reconnects are refused, naming the new owner.
    assert wait_until(lambda: all("taken over" in (r.get("last_error") or "")
                                  for r in status_json(a.path)["replicas"]), timeout=20), \
        status_json(a.path)["replicas"]
    # The new primary is untouched by all of it.
    write_fsync(q.path / "after", b"q" * 9000)
    q.unmount()
    assert cli("verify", new).returncode == 0
    for t in targets:
        assert pool_content(replica_file(t)) == pool_content(new), t.address
    a.kill9()


def test_with_min_replicas_0_the_old_primary_mounts_alone_and_writes_no_replica(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool, new, _ = _failover(work_dir, targets, mount_pool)
    q = mount_pool(new, name="q", options=OPTS)
    write_fsync(q.path / "q", b"q" * 4000)
    before = [pool_content(replica_file(t)) for t in targets]
    old_epoch = _epoch(pool)
    a = mount_pool(pool, name="alone", options=OPTS + ",min_replicas=0")
    st = status_json(a.path)
    assert st["fenced"] and "held by" in st["fenced"], st
    write_fsync(a.path / "local-only", b"l" * 20000)
    a.unmount()
    assert _epoch(pool) == old_epoch
    write_fsync(q.path / "q2", b"r" * 4000)  # the new primary still holds both replicas
    assert [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"]
    q.unmount()
    for t in targets:
        assert b"l" * 20000 not in pool_content(replica_file(t)), t.address
        assert pool_content(replica_file(t)) == pool_content(new)
    assert before[0] != pool_content(new)  # q2 reached them


def _promote(new: Path, source: TargetProcess, *extra: str) -> dict[str, object]:
    import json

    res = cli("promote", new, "--from", f"{source.address}/app", "--json", *extra)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def test_promote_fences_the_old_primary_before_the_new_one_is_even_mounted(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    acked = {f"a{i}": bytes([65 + i]) * (4000 + 3000 * i) for i in range(3)}
    for name, data in acked.items():
        write_fsync(a.path / name, data)
    a.kill9()
    new = work_dir / "new.pool"
    result = _promote(new, targets[0])
    assert result["claimed"] == [f"{t.address}/app" for t in targets], result
    assert result["replicas"] == [f"{t.address}/app" for t in targets], result  # never itself
    # No window: the old primary is refused although the new one has not been mounted yet.
    old_epoch = _epoch(pool)
    err = _refused(mount_pool, pool, "old")
    assert "taken over" in err and str(result["epoch"]) in err, err
    assert _epoch(pool) == old_epoch
    # Mounted with the default options, the new primary is clean everywhere at once.
    q = mount_pool(new, name="q", options=OPTS)
    assert [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"]
    for name, data in acked.items():
        assert (q.path / name).read_bytes() == data
    verify = cli("verify", q.path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    sync = cli("sync", q.path)
    assert sync.returncode == 0, sync.stdout + sync.stderr
    write_fsync(q.path / "q", b"q" * 5000)
    q.unmount()
    for t in targets:
        assert pool_content(replica_file(t)) == pool_content(new), t.address


def test_a_running_primary_a_promote_fenced_says_so_and_names_a_log_that_says_why(
        work_dir: Path, targets: list[TargetProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """Mounted as mount(8) and fstab mount it (forked off, no -o log) on a node with no syslog
    socket: fenced while it runs, it says so in status and leaves its reason where umount says."""
    monkeypatch.setenv("RPMEMFS_SYSLOG_SOCKET", str(work_dir / "no-syslog"))  # the mount inherits it
    pool, mnt = work_dir / "app.pool", work_dir / "a"
    mnt.mkdir()
    mkfs_replicated(pool, targets)
    res = cli("mount", pool, mnt, "-o", OPTS)
    assert res.returncode == 0, res.stderr
    try:
        write_fsync(mnt / "before", b"b" * 9000)
        own = status_json(mnt)["epoch"]
        took = str(_promote(work_dir / "new.pool", targets[0])["epoch"])
        _fsync_fails(mnt / "late")
        assert wait_until(lambda: status_json(mnt)["fenced"] is not None, timeout=20), status_json(mnt)
        res = cli("status", mnt, "--json")
        assert res.returncode == 2, describe(res)  # failing
        st = json.loads(res.stdout)
        assert took in st["fenced"] and str(work_dir / "new.pool") in st["fenced"], st["fenced"]
        for r in st["replicas"]:
            # The owner record the target holds, and this mount's own epoch (what status shows).
            assert set(re.findall(r"\b\d+:[0-9a-f]{8}\b", r["last_error"])) == {own, took}, r
        res = cli("status", mnt)
        assert res.returncode == 2, describe(res)
        head = res.stdout.splitlines()[0]
        assert "failing (fenced: " in head and took in head, res.stdout
    finally:
        res = cli("umount", mnt)
    assert res.returncode == 1, describe(res)
    # What is true of it now: a failover fenced it, naming the new primary; its next mount is
    # refused (nothing is "compared in full"), and the runbook says how it comes back.
    assert "in full" not in res.stderr, describe(res)
    assert re.search(rf"fenced by a failover.*{re.escape(str(work_dir / 'new.pool'))}.*"
                     r"next mount .* is refused.*docs/failover\.md", res.stderr), describe(res)
    again = cli("mount", pool, mnt, "-o", OPTS)
    assert_clean_error(again, r"taken over by another primary")
    named = re.search(r"(/[^\s,;()]+\.log)\b", res.stderr)
    assert named, res.stderr
    log = Path(named.group(1))
    try:
        lines = [ln for ln in log.read_text().splitlines() if "fenced" in ln]
        assert any("taken over" in ln and took in ln for ln in lines), log.read_text()
    finally:
        log.unlink()


def test_promote_with_a_replica_down_fences_it_when_it_returns(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "a", b"a" * 30000)
    a.kill9()
    targets[1].stop()
    new = work_dir / "new.pool"
    result = _promote(new, targets[0])
    assert result["claimed"] == [f"{targets[0].address}/app"], result
    assert f"{targets[1].address}/app" in dict(result["unreachable"]), result  # type: ignore[arg-type]
    q = mount_pool(new, name="q", options=OPTS + ",min_replicas=1")
    write_fsync(q.path / "q", b"q" * 30000)
    again = targets[1].respawn(log_path=work_dir / "t1-again.log")
    again.start()
    targets.append(again)
    # The new primary reaches it: claims it (a generation ahead of what it recorded), resyncs it.
    assert wait_until(lambda: [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"],
                      timeout=40), status_json(q.path)["replicas"]
    # The old primary now finds both replicas taken.
    err = _refused(mount_pool, pool, "old")
    assert "taken over" in err, err
    q.unmount()
    assert cli("verify", new).returncode == 0
    for t in (targets[0], again):
        assert pool_content(replica_file(t)) == pool_content(new), t.address


def test_no_claim_moves_a_target_s_epoch_back_so_the_fenced_primary_stays_fenced(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """A client holding a token for the pool claims it as a mount would (``prev`` the owner
    record) at an epoch that does not rise: to 0, back to the fenced primary's own epoch, or
    beside the record in its generation. Every target refuses, takeovers included; the record
    stays, and the old primary stays fenced, running or mounted again."""
    from test_target import RawConn

    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "before", b"b" * 9000)
    fenced = Header.decode(pool.read_bytes()[:4096]).epoch  # the running primary's epoch
    assert show_epoch(fenced) == status_json(a.path)["epoch"]
    new = work_dir / "new.pool"
    took = str(_promote(new, targets[0])["epoch"])
    _fsync_fails(a.path / "late")
    for t in targets:
        raw = RawConn(t.address)
        try:
            raw.handshake()
            record = raw.control({"op": "probe", "name": "app"})["owner"]["epoch"]
            assert show_epoch(record) == took
            beside = (record & ~0xFFFFFFFF) | ((record + 1) & 0xFFFFFFFF)  # same generation
            for cur, takeover in ((0, False), (fenced, False), (record - 1, False), (beside, False),
                                  (fenced, True), (record, True)):
                reply = raw.control({"op": "open", "name": "app", "epoch": [record, cur],
                                     "holder": {"host": "rogue"}, "takeover": takeover})
                assert not reply["ok"] and reply["code"] == "epoch", (t.address, show_epoch(cur), reply)
            owner = raw.control({"op": "probe", "name": "app"})["owner"]
            assert owner["epoch"] == record and owner["holder"]["command"] == "promote", owner
        finally:
            raw.close()
    # The fence holds: the old primary's writes still land nowhere, and its mount is refused.
    _fsync_fails(a.path / "later")
    a.kill9()
    err = _refused(mount_pool, pool, "old")
    assert "taken over" in err and took in err, err
    # A mount's normal claim still rises past the promote's takeover.
    q = mount_pool(new, name="q", options=OPTS)
    write_fsync(q.path / "q", b"q" * 5000)
    assert [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"]
    q.unmount()


def test_promote_onto_an_older_copy_sends_only_what_differs(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "big", os.urandom(8 << 20))
    a.unmount()
    # Fail over to B, which writes a little; then fail back onto A's (older) pool file.
    new = work_dir / "new.pool"
    _promote(new, targets[0])
    q = mount_pool(new, name="q", options=OPTS)
    write_fsync(q.path / "small", b"s" * 4000)
    q.unmount()
    back = _promote(pool, targets[1])
    assert int(back["chunks_differing"]) > 0, back  # type: ignore[call-overload]
    assert int(back["bytes_copied"]) <= (4 << 20), back  # type: ignore[call-overload]  # of 64 MiB
    m = mount_pool(pool, name="back", options=OPTS)
    assert (m.path / "small").read_bytes() == b"s" * 4000
    assert cli("verify", m.path).returncode == 0
    m.unmount()


def test_promote_onto_a_file_that_is_no_copy_of_the_pool_is_refused_before_it_fences(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """A promote that cannot write its destination (a file there that is no older copy of
    this pool: a typo, a copy made before a grow) stops before it claims anything: the
    primary running meanwhile is not fenced for nothing, and the file is left as it was."""
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "before", b"b" * 5000)
    other = work_dir / "other.pool"
    other.write_bytes(b"precious data")
    res = cli("promote", other, "--from", f"{targets[0].address}/app")
    assert_clean_error(res, r"other\.pool exists and is not an older copy of this pool.*"
                            r"nothing was claimed.*--force", one_line=True)
    assert other.read_bytes() == b"precious data"
    write_fsync(a.path / "after", b"a" * 5000)  # not fenced: its fsync reaches both replicas
    assert status_json(a.path)["fenced"] is None


def test_a_session_that_does_not_claim_a_claimed_pool_can_read_it_but_never_write_it(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """The way around fencing that must stay closed: opening a claimed pool without an epoch
    (as verify and recover do) and writing through that registration."""
    import pytest
    import trio

    from rpmemfs.transport.base import TransportError, barrier
    from rpmemfs.transport.tcp import connect

    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    q = mount_pool(pool, name="q", options=OPTS)  # claims both replicas
    write_fsync(q.path / "f", b"f" * 5000)
    before = replica_file(targets[1]).read_bytes()

    async def rogue() -> None:
        async with await connect(targets[1].address, None, lanes=1) as s:
            region = await s.open_pool("app")
            assert await s.lanes[0].read(region, 0, 4096) == before[:4096]  # reading is fine
            with pytest.raises(TransportError):
                await barrier(s.lanes[0], region, [(8192, b"X" * 4096)])
        async with await connect(targets[1].address, None, lanes=1) as s:
            region = await s.open_pool("app")
            with pytest.raises(TransportError):  # posted without a reply: the lane is closed
                await s.lanes[0].atomic_write(region, 8192, 0x5858585858585858)
                await s.lanes[0].read(region, 0, 8)

    trio.run(rogue)
    assert replica_file(targets[1]).read_bytes()[8192:12288] == before[8192:12288]
    # The owner was not disturbed either: its barriers still land on both replicas.
    write_fsync(q.path / "g", b"g" * 5000)
    assert [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"]
    q.unmount()
    assert cli("verify", pool).returncode == 0


def test_two_takeovers_racing_one_wins_and_the_other_is_told_who(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    import subprocess
    import sys

    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "a", b"a" * 20000)
    a.kill9()
    news = [work_dir / "b.pool", work_dir / "c.pool"]
    procs = [subprocess.Popen([sys.executable, "-m", "rpmemfs.cli", "promote", str(n), "--from",
                               f"{targets[i].address}/app"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i, n in enumerate(news)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = [p.returncode for p in procs]
    assert 0 in codes, outs
    for code, (_, err) in zip(codes, outs, strict=True):
        if code:
            assert "another takeover won" in err or "held by" in err, err
    # Whatever each promote said, exactly one of the two pools holds the replicas now: it
    # mounts, and the other's mount is refused naming it.
    winners, losers = [], []
    for i, n in enumerate(news):
        if not n.exists():
            continue
        m = mount_pool(n, name=f"m{i}", options=OPTS, start=False)
        try:
            m.start()
            winners.append((n, m))
        except AssertionError as e:
            losers.append((n, str(e)))
    assert len(winners) == 1, (winners, losers)
    win_pool, win = winners[0]
    for _, err in losers:
        assert "taken over" in err and str(win_pool) in err, err
    write_fsync(win.path / "w", b"w" * 5000)
    assert [r["state"] for r in status_json(win.path)["replicas"]] == ["in-sync", "in-sync"]
    win.unmount()
    for t in targets:
        assert pool_content(replica_file(t)) == pool_content(win_pool), t.address


def test_mount_takeover_fences_the_newer_owner_and_wins_the_replicas(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    write_fsync(a.path / "a", b"a" * 9000)
    a.unmount()
    new = work_dir / "new.pool"
    _promote(new, targets[0])
    q = mount_pool(new, name="q", options=OPTS)
    write_fsync(q.path / "q", b"q" * 9000)
    # The operator decides A's copy wins after all.
    back = mount_pool(pool, name="back", options=OPTS + ",takeover")
    assert [r["state"] for r in status_json(back.path)["replicas"]] == ["in-sync", "in-sync"]
    _fsync_fails(q.path / "late")
    write_fsync(back.path / "b", b"b" * 9000)
    assert not (back.path / "q").exists()
    back.unmount()
    assert cli("verify", pool).returncode == 0
    for t in targets:
        assert pool_content(replica_file(t)) == pool_content(pool), t.address
    q.kill9()


def test_a_target_says_who_owns_its_pools_and_an_administrator_can_evict_a_writer(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    import json

    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    q = mount_pool(pool, name="q", options=OPTS)
    write_fsync(q.path / "f", b"f" * 5000)
    t = targets[1]
    res = cli("pools", t.address, "--json")
    assert res.returncode == 0, res.stderr
    pools = json.loads(res.stdout)
    assert list(pools) == ["app"], pools  # the owner record beside it is not a pool
    app = pools["app"]
    assert app["owner"]["epoch_shown"] == _epoch(pool)
    assert app["owner"]["holder"]["pool"] == str(pool)
    assert app["owner"]["holder"]["pid"] == q.proc.pid if q.proc else False
    assert app["writer"] and len(app["sessions"]) == 1 and app["writes"] > 0
    assert wait_until(lambda: json.loads(cli("pools", t.address, "--json").stdout)["app"]["last_activity"],
                      timeout=10)
    table = cli("pools", t.address)
    assert table.returncode == 0 and "app" in table.stdout and _epoch(pool) in table.stdout, table.stdout
    # Evicting the writer drops its registration: its next barrier fails there, and the
    # replica falls behind until the same mount claims it again (its own epoch: let in).
    ev = cli("evict", t.address, "app")
    assert ev.returncode == 0, ev.stderr
    fd = os.open(q.path / "g", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"g" * 5000)
        try:
            os.fsync(fd)
        except OSError as e:
            assert e.errno == errno.EIO  # min_replicas is all: the evicted replica missed it
    finally:
        os.close(fd)
    assert wait_until(lambda: [r["state"] for r in status_json(q.path)["replicas"]] == ["in-sync", "in-sync"],
                      timeout=30), status_json(q.path)["replicas"]
    assert cli("evict", t.address, "nope").returncode == 1
    q.unmount()
    assert cli("verify", pool).returncode == 0


def test_control_characters_in_a_claim_s_holder_forge_no_log_line_and_reach_no_terminal(
        work_dir: Path, targets: list[TargetProcess]) -> None:
    """A claimant names itself with newlines and terminal escapes: the target's log keeps one
    line per event, and `rpmemfs pools` (table and --json) shows them escaped."""
    from test_target import RawConn

    t = targets[0]
    forged = 'level=error logger=rpmemfs.forged msg="forged"'
    holder = {"host": f"node\n{forged}\x1b[31m", "pid": 7, "pool": "/p\r\x1b]0;owned\x07\x9b2J",
              "mountpoint": "/m\x7f\u2028", "command": "mount\x00"}
    first, second = next_epoch(0, 1), next_epoch(next_epoch(0, 1), 2)
    conns = []
    try:
        for epoch in ([0, first], [first, second], [0, 0]):  # the last one is refused, naming it
            raw = RawConn(t.address)
            conns.append(raw)
            raw.handshake()
            if epoch[0] == 0 and epoch[1]:
                assert raw.control({"op": "create", "name": "evil", "size": 1 << 20})["ok"]
            reply = raw.control({"op": "open", "name": "evil", "epoch": epoch, "holder": holder})
            assert reply["ok"] == bool(epoch[1]), reply
            assert str(reply.get("error", "")).isprintable(), reply  # what the refused one is told
    finally:
        for raw in conns:
            raw.close()
    log = t.log_text()
    assert not [c for c in log if not c.isprintable() and c != "\n"], log
    mentions = [ln for ln in log.splitlines() if "forged" in ln]
    assert mentions and all(ln.startswith("ts=") for ln in mentions), log
    assert [ln for ln in mentions if "claimed at epoch" in ln], log
    assert [ln for ln in mentions if "refused" in ln], log
    table = cli("pools", t.address)
    assert table.returncode == 0, describe(table)
    assert all(ln.isprintable() for ln in table.stdout.splitlines()), table.stdout
    row = next(ln for ln in table.stdout.splitlines() if ln.startswith("evil "))
    assert "node\\nlevel=error" in row and "\\x1b[31m" in row, row
    listed = cli("pools", t.address, "--json")
    assert listed.returncode == 0, describe(listed)
    shown = json.loads(listed.stdout)["evil"]["owner"]
    assert all(str(v).isprintable() for v in shown["holder"].values()), shown
    assert shown["described"].isprintable(), shown


def test_promote_killed_at_random_moments_leaves_every_replica_consistent(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    import random
    import signal
    import subprocess
    import sys
    import time

    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    a = mount_pool(pool, name="a", options=OPTS)
    acked = {f"f{i}": os.urandom(300_000) for i in range(30)}
    for name, data in acked.items():
        write_fsync(a.path / name, data)
    a.kill9()
    new = work_dir / "new.pool"
    rng = random.Random(14)
    for attempt in range(5):
        p = subprocess.Popen([sys.executable, "-m", "rpmemfs.cli", "promote", str(new), "--from",
                              f"{targets[0].address}/app", "--force"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait()
        # Promote only reads from the replicas: each still checks clean and mounts alone.
        for i, t in enumerate(targets):
            mnt = _alone(replica_file(t), work_dir, f"copy{attempt}-{i}", mount_pool)
            assert (mnt / "f7").read_bytes() == acked["f7"]
    # The old primary is fenced wherever a killed promote got to claim; a promote run to the
    # end then takes over everything, and the new primary has every acknowledged write.
    result = _promote(new, targets[0], "--force")
    assert len(result["claimed"]) == 2, result  # type: ignore[arg-type]
    q = mount_pool(new, name="q", options=OPTS)
    for name, data in acked.items():
        assert (q.path / name).read_bytes() == data, name
    assert "taken over" in _refused(mount_pool, pool, "old")
    q.unmount()
