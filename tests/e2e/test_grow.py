"""`rpmemfs grow`: an unmounted pool and its replicas grown; the next mount has the space,
keeps every file, compares the replicas in full and leaves them identical to the pool."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from conftest import MountPool
from helpers import assert_check_clean, cli, pool_content, replica_file, status_json, write_fsync

from rpmemfs.tools.processes import TargetProcess


def _write_all(path: Path, data: bytes) -> int:
    """Write ``data`` (looping over short writes) and fsync; the bytes written before ENOSPC."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    done = 0
    try:
        while done < len(data):
            try:
                done += os.write(fd, data[done:])
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def test_grow_a_replicated_pool_and_use_the_new_space(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "16M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force")
    kept = {f"f{i}": os.urandom(500_000) for i in range(8)}
    for name, data in kept.items():
        write_fsync(m.path / name, data)
    # Too big for the pool as it is: a short write, then ENOSPC.
    big = os.urandom(20 << 20)
    assert _write_all(m.path / "big", big) < len(big)
    (m.path / "big").unlink()
    res = cli("grow", m.path, "--size", "64M")
    assert res.returncode == 1 and "mounted" in res.stderr, res.stderr
    m.unmount()

    res = cli("grow", pool, "--size", "64M")
    assert res.returncode == 0, res.stderr
    assert pool.stat().st_size == 64 << 20
    for t in targets:
        assert replica_file(t).stat().st_size == 64 << 20
    assert_check_clean(pool)
    res = cli("grow", pool, "--size", "32M")
    assert res.returncode == 1 and "only grows" in res.stderr, res.stderr

    m = mount_pool(pool, name="again", options="pmem=force")
    assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync", "in-sync"]
    st = os.statvfs(m.path)
    assert st.f_blocks * st.f_frsize > 48 << 20
    assert _write_all(m.path / "big", big) == len(big)
    assert (m.path / "big").read_bytes() == big
    for name, data in kept.items():
        assert (m.path / name).read_bytes() == data, name
    m.unmount()
    assert cli("verify", pool).returncode == 0
    for i, t in enumerate(targets):
        assert pool_content(replica_file(t)) == pool_content(pool), t.address
        copy = work_dir / f"copy{i}.pool"
        shutil.copyfile(replica_file(t), copy)
        assert_check_clean(copy)


def test_grow_with_a_replica_down_changes_nothing_local(
        work_dir: Path, targets: list[TargetProcess]) -> None:
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "16M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
    before = pool.read_bytes()
    targets[1].kill()
    res = cli("grow", pool, "--size", "32M")
    assert res.returncode == 1 and "itself is unchanged" in res.stderr, res.stderr
    assert pool.read_bytes() == before
