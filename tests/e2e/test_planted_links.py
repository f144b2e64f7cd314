"""No file is written through a symbolic link another user planted (issue 30, item 4).

Root names a file in a world-writable sticky directory (as /tmp or /dev/shm are), where user
nobody has put a symbolic link at that name first, pointing at a file only root may write. On a
host with fs.protected_symlinks=0 the kernel follows such a link; mkfs, recover, promote and
`-o log=` must refuse it themselves, and the file it points at stays as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import Mount, assert_clean_error, cli, mkfs, mkfs_replicated

from rpmemfs.tools.processes import TargetProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to plant another user's link")

NOBODY = 65534
SYSCTL = Path("/proc/sys/fs/protected_symlinks")
SECRET = b"root's alone\n" * 100


@pytest.fixture
def links_followed() -> Iterator[None]:
    """fs.protected_symlinks=0 for the test, as it was afterwards."""
    try:
        was = SYSCTL.read_text()
        SYSCTL.write_text("0\n")
    except OSError as e:
        pytest.skip(f"cannot set fs.protected_symlinks=0 ({e.strerror}): the kernel would refuse "
                    "to follow the planted link itself")
    try:
        yield
    finally:
        SYSCTL.write_text(was)


@pytest.fixture
def planted(work_dir: Path, links_followed: None) -> tuple[Path, Path]:
    """(a link nobody planted in a sticky world-writable directory, the root-only file it
    points at)."""
    victim = work_dir / "victim"
    victim.write_bytes(SECRET)
    victim.chmod(0o600)
    shared = work_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / "app.pool"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    return link, victim


def _untouched(link: Path, victim: Path) -> None:
    assert victim.read_bytes() == SECRET
    assert link.is_symlink() and os.readlink(link) == str(victim)


@pytest.mark.parametrize("force", [(), ("--force",)])
def test_mkfs_refuses_a_planted_link(planted: tuple[Path, Path], force: tuple[str, ...]) -> None:
    link, victim = planted
    res = cli("mkfs", link, "--size", "8M", *force)
    assert res.returncode == 1, res
    assert_clean_error(res, f"{link} is a symbolic link: refusing to write through it", one_line=True)
    _untouched(link, victim)


@pytest.mark.parametrize("command", ["recover", "promote"])
@pytest.mark.parametrize("force", [(), ("--force",)])
def test_recover_and_promote_refuse_a_planted_link(planted: tuple[Path, Path], work_dir: Path,
                                                   targets: list[TargetProcess], command: str,
                                                   force: tuple[str, ...]) -> None:
    link, victim = planted
    mkfs_replicated(work_dir / "app.pool", targets, size="8M")
    res = cli(command, link, "--from", f"{targets[0].address}/app", *force)
    assert res.returncode == 1, res
    assert_clean_error(res, f"{link} is a symbolic link: refusing to write through it", one_line=True)
    _untouched(link, victim)


def test_mount_log_refuses_a_planted_link(planted: tuple[Path, Path], work_dir: Path) -> None:
    link, victim = planted
    pool = work_dir / "p.pool"
    mkfs(pool, "8M")
    out = Mount(pool, work_dir / "mnt", work_dir, options=f"pmem=force,log={link}").start_expect_failure()
    assert f"{link} is a symbolic link: refusing to write through it" in out, out
    _untouched(link, victim)


def test_mkfs_force_replaces_a_file_another_user_left(work_dir: Path) -> None:
    """--force takes the name, not the file: another user's file there (or a hard link to
    some other file) loses its name and is never written; the new pool is the caller's."""
    shared = work_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = shared / "app.pool"
    theirs.write_bytes(b"nobody's")
    os.chown(theirs, NOBODY, NOBODY)
    kept = os.open(theirs, os.O_RDONLY)
    try:
        res = cli("mkfs", theirs, "--size", "8M", "--force")
        assert res.returncode == 0, res
        assert os.pread(kept, 100, 0) == b"nobody's"  # the old file, which nothing wrote
    finally:
        os.close(kept)
    st = theirs.lstat()
    assert (st.st_uid, st.st_mode & 0o777, st.st_size) == (0, 0o600, 8 << 20)


def test_mkfs_force_refuses_a_pool_in_use(work_dir: Path, mount_pool: MountPool) -> None:
    """--force gives the name a new file: a mounted pool would lose its name under its daemon,
    which would go on writing a file nobody can reach. It is refused, naming the daemon."""
    pool = work_dir / "app.pool"
    mkfs(pool, "8M")
    m = mount_pool(pool)
    (m.path / "f").write_bytes(b"kept")
    inode = pool.stat().st_ino
    res = cli("mkfs", pool, "--size", "8M", "--force")
    assert res.returncode == 1, res
    assert_clean_error(res, rf"{pool} is in use \(pid {m.daemon.pid if m.daemon else 0} .*\): stop "
                       "that process before replacing the pool", one_line=True)
    assert pool.stat().st_ino == inode and (m.path / "f").read_bytes() == b"kept"
