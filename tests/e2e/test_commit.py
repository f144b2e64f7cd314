"""Durability without fsync: the periodic commit (`-o commit=SECONDS`) and `rpmemfs flush`.

Each test writes without fsync and then makes the mount's daemon disappear with kill -9 (a
clean unmount runs a final durability point, which would hide the difference). What the
replicas hold is read from a copy of each replica's pool mounted on its own; what the local
pool holds, from the pool mounted again (a crash keeps the data's pages of a pool on
/dev/shm, but not the log record that describes them unless a durability point stored it).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import (
    Mount,
    assert_clean_error,
    cli,
    describe,
    is_mounted,
    mkfs_replicated,
    replica_file,
    status_json,
    write_fsync,
)

from rpmemfs.tools.processes import TargetProcess

ALONE = "pmem=force,min_replicas=0,replica_timeout=1"


def _write(path: Path, data: bytes) -> None:
    """Create or truncate and write, without fsync."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read(mnt: Mount, name: str) -> bytes | None:
    try:
        return (mnt.path / name).read_bytes()
    except FileNotFoundError:
        return None


def _held_after_crash(work_dir: Path, pool: Path, targets: list[TargetProcess], mount_pool: MountPool,
                      names: list[str]) -> dict[str, dict[str, bytes | None]]:
    """What each replica and the local pool hold of ``names`` (the mount killed already)."""
    for t in targets:
        t.stop()
    held: dict[str, dict[str, bytes | None]] = {}
    for i, t in enumerate(targets):
        copy = work_dir / f"copy{i}.pool"
        shutil.copy(replica_file(t), copy)
        alone = mount_pool(copy, name=f"alone{i}", options=ALONE)
        held[t.address] = {n: _read(alone, n) for n in names}
        alone.unmount()
    again = mount_pool(pool, name="local-again", options=ALONE)
    held["local"] = {n: _read(again, n) for n in names}
    again.unmount()
    return held


def _unfsynced(m: Mount) -> dict[str, bytes]:
    """A file fsynced, then changed without fsync; and a new file never fsynced."""
    write_fsync(m.path / "old", b"o" * 5000)
    files = {"old": os.urandom(7000), "new": os.urandom(30000)}
    for name, data in files.items():
        _write(m.path / name, data)
    return files


def test_the_default_periodic_commit_makes_unfsynced_writes_durable_everywhere(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool)
    assert status_json(m.path)["commit"]["seconds"] == 5  # the default, as ext4's
    files = _unfsynced(m)
    time.sleep(5 + 3)  # the interval, and slack for a busy 2-core machine
    assert status_json(m.path)["commit"]["points"] >= 1
    m.kill9()
    held = _held_after_crash(work_dir, pool, targets, mount_pool, list(files))
    for where, got in held.items():
        assert got == files, f"{where} lacks what the commit made durable"


def test_flush_makes_unfsynced_writes_durable_everywhere_at_once(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options="pmem=force,commit=0")  # only the flush can have done it
    files = _unfsynced(m)
    res = cli("flush", m.path)
    assert res.returncode == 0, describe(res)
    assert res.stdout.startswith(f"flushed {m.path}: the local pool and 2 of 2 replicas"), res.stdout
    m.kill9()
    held = _held_after_crash(work_dir, pool, targets, mount_pool, list(files))
    for where, got in held.items():
        assert got == files, f"{where} lacks what the flush made durable"


def test_without_the_commit_unfsynced_writes_are_not_durable(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options="pmem=force,commit=0")
    assert status_json(m.path)["commit"] == {"seconds": 0}
    write_fsync(m.path / "kept", b"k" * 3000)
    _write(m.path / "new", os.urandom(30000))
    time.sleep(5 + 3)  # what the default commit would have needed
    m.kill9()
    held = _held_after_crash(work_dir, pool, targets, mount_pool, ["kept", "new"])
    for where, got in held.items():
        assert got == {"kept": b"k" * 3000, "new": None}, (where, {k: v and len(v) for k, v in got.items()})


def test_a_failing_commit_is_logged_once_and_flush_says_why(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options="pmem=force,commit=1,replica_timeout=2")  # min_replicas: all
    write_fsync(m.path / "first", b"1" * 1000)
    targets[1].kill()
    _write(m.path / "late", b"late" * 1000)
    time.sleep(6)  # several commits fail meanwhile
    res = cli("flush", m.path)
    assert_clean_error(res, r"flush of .* failed: .*too few replicas", one_line=True)
    assert targets[1].address in res.stderr, res.stderr
    st = status_json(m.path)
    assert "too few replicas" in (st["commit"]["failing"] or ""), st["commit"]
    assert m.output().count("periodic commit failed") == 1, m.output()[-3000:]
    again = targets[1].respawn(log_path=work_dir / "restarted.log")
    again.start()
    targets.append(again)
    try:
        # Back: the next commit sends what the failed ones left, without anyone asking.
        deadline = time.monotonic() + 15
        while status_json(m.path)["commit"]["failing"]:
            assert time.monotonic() < deadline, status_json(m.path)
            time.sleep(0.2)
        assert m.output().count("periodic commit works again") == 1, m.output()[-3000:]
        res = cli("flush", m.path, "--json")
        assert res.returncode == 0, describe(res)
        m.unmount()
    finally:
        again.close()


@pytest.mark.parametrize("value", ["abc", "-1", "100000", ""])
def test_a_bad_commit_interval_is_refused(work_dir: Path, value: str) -> None:
    pool = work_dir / "p.pool"
    res = cli("mkfs", pool, "--size", "8M")
    assert res.returncode == 0, res.stderr
    mnt = work_dir / "mnt"
    mnt.mkdir()
    res = cli("mount", pool, mnt, "-f", "-o", f"pmem=force,commit={value}", timeout=60)
    assert_clean_error(res, r"commit=")
    assert not is_mounted(mnt)


def test_flush_of_a_mount_without_replicas_and_of_no_mount(work_dir: Path, mount_pool: MountPool) -> None:
    pool = work_dir / "p.pool"
    assert cli("mkfs", pool, "--size", "16M").returncode == 0
    m = mount_pool(pool)
    _write(m.path / "f", b"x" * 100)
    res = cli("flush", m.path)
    assert res.returncode == 0 and "the local pool (no replicas)" in res.stdout, describe(res)
    assert_clean_error(cli("flush", work_dir), r"not a mount point", one_line=True)
