"""The pieces a system administrator touches: mount(8) and fstab, the background daemon, the demo."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_check_clean, cli, is_mounted, mkfs, pool_content, wait_until, write_fsync

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "mount" / "mount.rpmemfs"
SBIN_HELPER = Path("/sbin/mount.fuse.rpmemfs")
RPMEMFS_BIN = str(Path(sys.executable).parent / "rpmemfs")


def _umount(mnt: Path) -> None:
    subprocess.run(["umount", str(mnt)], check=True, timeout=30)
    assert wait_until(lambda: not is_mounted(mnt), 10)


def _daemon_gone(pool: Path) -> bool:
    out = subprocess.run(["pgrep", "-f", f"rpmemfs mount {pool}"], capture_output=True, text=True)
    return out.returncode != 0


def _run_helper(pool: Path, mnt: Path, opts: str) -> subprocess.CompletedProcess[str]:
    """What mount(8) runs for `mount -t fuse.rpmemfs POOL DIR -o OPTS`."""
    env = dict(os.environ, RPMEMFS_BIN=RPMEMFS_BIN)
    return subprocess.run([str(HELPER), str(pool), str(mnt), "-o", opts],
                          env=env, capture_output=True, text=True, timeout=60)


def test_mount_helper_background_and_umount(work_dir: Path) -> None:
    pool, mnt = work_dir / "p.pool", work_dir / "mnt"
    mnt.mkdir()
    mkfs(pool, "32M")
    res = _run_helper(pool, mnt, "rw,nofail,_netdev,pmem=force")  # fstab options included
    assert res.returncode == 0, res.stderr
    assert is_mounted(mnt), "the helper returned before the filesystem was mounted"
    write_fsync(mnt / "f", b"through mount(8)")
    _umount(mnt)
    # the background daemon persists and exits once the kernel lets go
    assert wait_until(lambda: _daemon_gone(pool), 15), "daemon still running after umount"
    assert_check_clean(pool)
    m = _run_helper(pool, mnt, "pmem=force")
    assert m.returncode == 0, m.stderr
    try:
        assert (mnt / "f").read_bytes() == b"through mount(8)"
    finally:
        _umount(mnt)


def test_mount_helper_rejects_unknown_option(work_dir: Path) -> None:
    pool, mnt = work_dir / "p.pool", work_dir / "mnt"
    mnt.mkdir()
    mkfs(pool, "32M")
    res = _run_helper(pool, mnt, "pmem=force,bogus=1")
    assert res.returncode != 0
    assert "unknown mount option" in res.stderr and "Traceback" not in res.stderr
    assert not is_mounted(mnt)


@pytest.mark.skipif(os.geteuid() != 0, reason="installing a mount(8) helper needs root")
def test_mount_t_fuse_rpmemfs(work_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if SBIN_HELPER.exists():
        pytest.skip(f"{SBIN_HELPER} already installed; not replacing it")
    pool, mnt = work_dir / "p.pool", work_dir / "mnt"
    mnt.mkdir()
    mkfs(pool, "32M")
    shutil.copy(HELPER, SBIN_HELPER)
    try:
        env = dict(os.environ, RPMEMFS_BIN=RPMEMFS_BIN)
        res = subprocess.run(["mount", "-t", "fuse.rpmemfs", str(pool), str(mnt), "-o", "pmem=force"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert is_mounted(mnt)
        write_fsync(mnt / "x", b"mount -t")
        assert (mnt / "x").read_bytes() == b"mount -t"
        _umount(mnt)
    finally:
        SBIN_HELPER.unlink()
    assert wait_until(lambda: _daemon_gone(pool), 15)
    assert_check_clean(pool)


def test_background_mount_reports_errors(work_dir: Path) -> None:
    mnt = work_dir / "mnt"
    mnt.mkdir()
    bad = work_dir / "junk.pool"
    bad.write_bytes(os.urandom(1 << 20))
    res = cli("mount", bad, mnt, "-o", "pmem=force")
    assert res.returncode != 0
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rpmemfs: ")]
    assert errors and "not an rpmemfs pool" in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not is_mounted(mnt)


def test_demo_runs_and_stops_cleanly(work_dir: Path) -> None:
    demo = work_dir / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "rpmemfs.cli", "demo", str(demo), "--size", "32M"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: is_mounted(demo / "mnt"), 30), "demo did not mount"
        write_fsync(demo / "mnt" / "hello", b"demo")
        status = cli("status", demo / "mnt", "--json")
        assert status.returncode == 0, status.stderr
        import json

        replicas = json.loads(status.stdout)["replicas"]
        assert [r["state"] for r in replicas] == ["in-sync", "in-sync"], replicas
        assert all(r["flushes"] == r["barriers"] >= 1 for r in replicas), replicas
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Ctrl-C" in out and "stopped" in out
    assert not is_mounted(demo / "mnt")
    assert_check_clean(demo / "demo.pool")
    for i in (1, 2):  # each replica is the same pool, byte for byte, after the clean stop
        assert pool_content(demo / f"target{i}" / "demo") == pool_content(demo / "demo.pool")


def test_status_without_xattrs_and_socket_cleanup(work_dir: Path) -> None:
    from rpmemfs.mountd.control import socket_path

    pool, mnt = work_dir / "p.pool", work_dir / "mnt"
    mnt.mkdir()
    mkfs(pool, "32M")
    res = cli("mount", pool, mnt, "-o", "pmem=force,noxattr")
    assert res.returncode == 0, res.stderr
    try:
        write_fsync(mnt / "f", b"x" * 5000)
        with pytest.raises(OSError):  # the kernel no longer forwards xattr calls
            os.setxattr(mnt / "f", "user.k", b"v")
        st = cli("status", mnt, "--json")
        assert st.returncode == 0, st.stderr
        import json

        info = json.loads(st.stdout)
        assert info["fsync_count"] >= 1 and info["pool"] == str(pool)
        assert Path(socket_path(str(mnt))).exists()
    finally:
        _umount(mnt)
    assert wait_until(lambda: not Path(socket_path(str(mnt))).exists(), 15)
    gone = cli("status", mnt)
    assert gone.returncode != 0 and "not a mount point" in gone.stderr
