"""The pieces a system administrator touches: mount(8) and fstab, the background daemon, the demo."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    assert_check_clean,
    assert_clean_error,
    cli,
    describe,
    file_sha256,
    is_mounted,
    mkfs,
    pool_content,
    status_json,
    wait_until,
    write_fsync,
)

from rpmemfs.units import human

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


def _start_demo(demo: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "rpmemfs.cli", "demo", str(demo), "--size", "32M"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _banner(proc: subprocess.Popen[str]) -> str:
    """What the demo printed up to its "Press Ctrl-C" line (from then on Ctrl-C stops it
    cleanly), or until it exited."""
    assert proc.stdout is not None
    lines = []
    while line := proc.stdout.readline():
        lines.append(line)
        if line.startswith("Press Ctrl-C"):
            break
    return "".join(lines)


def _stop_demo(proc: subprocess.Popen[str], banner: str) -> tuple[str, str]:
    """Ctrl-C, as its banner says, and all it printed; killed if it does not end."""
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        return banner + out, err
    finally:
        if proc.poll() is None:
            proc.kill()


def _disk_use(demo: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in demo.rglob("*")
               if p.is_file() and not p.is_symlink() and "mnt" not in p.relative_to(demo).parts)


def test_demo_runs_and_stops_cleanly(work_dir: Path) -> None:
    """On ports of its own choosing (the ones it once fixed are taken here), with a banner
    promising only what status shows and a closing message whose numbers and commands are
    true once everything has stopped; a second run mounts the same pool again."""
    demo = work_dir / "new" / "demo"
    pool = demo / "demo.pool"
    with contextlib.ExitStack() as taken:
        for port in (7421, 7422):
            s = taken.enter_context(socket.socket())
            with contextlib.suppress(OSError):  # held by someone else: taken all the same
                s.bind(("127.0.0.1", port))
                s.listen()
        proc = _start_demo(demo)
        out = _banner(proc)
        try:
            up = is_mounted(demo / "mnt")
            if up:
                write_fsync(demo / "mnt" / "hello", b"demo")
                st = status_json(demo / "mnt")
                table = cli("status", demo / "mnt")
                # made by the demo, for its user alone
                made = (stat.S_IMODE(demo.stat().st_mode), demo.stat().st_uid)
        finally:
            out, err = _stop_demo(proc, out)
    assert up, f"demo did not mount:\n{out}\n{err}"
    assert proc.returncode == 0, err
    assert [r["state"] for r in st["replicas"]] == ["in-sync", "in-sync"], st
    assert all(r["flushes"] == r["barriers"] >= 1 for r in st["replicas"]), st
    assert table.returncode == 0, describe(table)
    assert made == (0o700, os.geteuid())
    assert not is_mounted(demo / "mnt")
    header = next(ln for ln in table.stdout.splitlines() if ln.startswith("  replica "))
    columns = re.split(r"\s{2,}", header.strip())
    promised = re.search(r"status \S+/mnt +# health, then per replica: (.*)", out)
    assert promised, out
    assert set(promised[1].split(", ")) <= set(columns), (promised[1], columns)
    assert f"MiB in {demo}: the pool and its two replicas" in out, out
    closing = out[out.index("Ctrl-C here"):]
    assert closing.count(": identical,") == 2 and "\n  clean\n" in closing, closing
    # What it says is left, and a command that works now that the targets are gone.
    assert f"Left in {demo}: {human(_disk_use(demo))} " in closing, closing
    assert f"rpmemfs check {pool} " in closing and f"verify {pool}" not in closing, closing
    assert_check_clean(pool)
    for i in (1, 2):  # each replica is the same pool, byte for byte, after the clean stop
        assert pool_content(demo / f"target{i}" / "demo") == pool_content(pool)

    again = _start_demo(demo)  # its targets on the ports the pool recorded
    out = _banner(again)
    try:
        kept = (demo / "mnt" / "hello").read_bytes() if is_mounted(demo / "mnt") else None
    finally:
        out, err = _stop_demo(again, out)
    assert kept == b"demo", f"{out}\n{err}"
    assert again.returncode == 0, err


def _run_refused_demo(demo: Path) -> subprocess.CompletedProcess[str]:
    """The demo where it must refuse to run: at once, before starting anything (a demo that
    runs after all is stopped, and the test fails)."""
    proc = _start_demo(demo)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"the demo ran in {demo}:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


NOBODY = 65534


def _plant(work_dir: Path, case: str) -> tuple[Path, Path, Path]:
    """(DIR for the demo, a root-only file a planted log symlink points at, a pool another
    user made) as a local user would have set them up before root runs the demo."""
    secret = work_dir / "secret"
    secret.write_bytes(b"root's own\n")
    secret.chmod(0o600)
    theirs = work_dir / "theirs.pool"
    mkfs(theirs, "16M")  # a real pool, with no replicas: the old demo mounted it as it was
    os.chown(theirs, NOBODY, NOBODY)
    theirs.chmod(0o644)
    demo = work_dir / "demo"
    if case == "under a directory of theirs":
        (work_dir / "theirs").mkdir()
        os.chown(work_dir / "theirs", NOBODY, NOBODY)
        demo = work_dir / "theirs" / "demo"
    elif case == "a symlink of theirs to a directory of root":
        (work_dir / "roots").mkdir(mode=0o700)
        demo.symlink_to(work_dir / "roots")
        os.chown(demo, NOBODY, NOBODY, follow_symlinks=False)
        return demo, secret, theirs
    demo.mkdir()
    if case in ("made by them", "under a directory of theirs"):
        os.chown(demo, NOBODY, NOBODY)
    elif case == "root's, writable by all":
        demo.chmod(0o777)
    else:
        demo.chmod(0o700)
    if case != "root's, with a pool of theirs":
        (demo / "target1.log").symlink_to(secret)
        os.chown(demo / "target1.log", NOBODY, NOBODY, follow_symlinks=False)
    if case != "root's, with a planted link":
        os.link(theirs, demo / "demo.pool")
    return demo, secret, theirs


@pytest.mark.skipif(os.geteuid() != 0, reason="the demo run as root, in a directory of another user")
@pytest.mark.parametrize("case", ["made by them", "root's, writable by all", "root's, with a planted link",
                                  "root's, with a pool of theirs", "under a directory of theirs",
                                  "a symlink of theirs to a directory of root"])
def test_the_demo_as_root_follows_no_link_and_adopts_no_pool_it_did_not_make(
        work_dir: Path, case: str) -> None:
    """/dev/shm/rpmemfs-demo is anyone's to make: a user who made it first, with a symlink
    named like a target's log pointing at a root-only file and a pool of their own, must get
    neither root's log lines in that file nor root's data in their pool."""
    demo, secret, theirs = _plant(work_dir, case)
    before = sorted(os.listdir(demo))
    pool_before = file_sha256(theirs)
    res = _run_refused_demo(demo)
    assert_clean_error(res, rf"^rpmemfs: {re.escape(str(work_dir))}/\S+ .*(give|remove)", one_line=True)
    assert res.returncode == 1, describe(res)
    assert secret.read_bytes() == b"root's own\n"
    assert file_sha256(theirs) == pool_before and theirs.stat().st_uid == NOBODY
    assert not is_mounted(demo / "mnt")
    assert sorted(os.listdir(demo)) == before  # no target directory, log or mount point made


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
