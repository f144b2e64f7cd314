"""POSIX ACLs, setgid directories and timestamps through a real mount, checked against what
the same commands give on tmpfs (which has ACLs, and follows the same kernel rules as ext4):
as root, and as unprivileged users through setpriv(1). The tests run as root (they mount).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import MakePool, MountPool
from helpers import Mount, cli, fsync_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switches to other users: needs root")

MEMBER = 3000  # a group that user 1001 is in and user 1002 is not
PY_CREATE = "import os, sys; os.close(os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, int(sys.argv[2], 8)))"


def sh(cwd: Path, script: str, uid: int = 0, groups: tuple[int, ...] = (), umask: int = 0o022,
       check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a shell script in cwd as uid (its group the same number, with these supplementary
    groups and no capabilities unless root)."""
    argv = ["sh", "-c", f"umask {umask:03o}; {script}"]
    if uid:
        group_opt = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
        argv = ["setpriv", "--reuid", str(uid), "--regid", str(uid), *group_opt, "--", *argv]
    res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
    if check:
        assert res.returncode == 0, f"{script!r} as {uid}: {res.stderr}"
    return res


def observe(root: Path) -> dict[str, object]:
    """What ls -l and getfacl show of everything under root, by path."""
    paths = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    acls = subprocess.run(["getfacl", "-n", *paths], cwd=root, capture_output=True, text=True,
                          check=True).stdout
    modes = {}
    for p in paths:
        st = os.lstat(root / p)
        modes[p] = (stat.filemode(st.st_mode), oct(st.st_mode), st.st_uid, st.st_gid)
    return {"getfacl": acls.split("\n\n"), "stat": modes}


@pytest.fixture
def dirs(work_dir: Path, make_pool: MakePool, mount_pool: MountPool) -> tuple[Mount, Path]:
    """A mount reachable by other users, and a tmpfs directory beside it to compare with."""
    work_dir.chmod(0o755)
    mnt = mount_pool(make_pool("64M"))
    mnt.path.chmod(0o755)
    ref = work_dir / "tmpfs-ref"
    ref.mkdir(mode=0o755)
    ref.chmod(0o755)
    return mnt, ref


def both(dirs: tuple[Mount, Path], script: str, **kw: object) -> None:
    for d in (dirs[0].path, dirs[1]):
        sh(d, script, **kw)  # type: ignore[arg-type]


def can_read(d: Path, name: str, uid: int, groups: tuple[int, ...] = ()) -> bool:
    return sh(d, f"cat {shlex.quote(name)} >/dev/null", uid, groups, check=False).returncode == 0


# ------------------------------------------------------------------ access ACLs


def test_acl_decides_who_reads_as_on_tmpfs(dirs: tuple[Mount, Path]) -> None:
    mnt, ref = dirs
    both(dirs, f"echo secret > s; chmod 640 s; setfacl -m u:1001:r,g:{MEMBER}:r s")
    who = [(1001, ()), (1002, ()), (1003, (MEMBER,))]

    def readers() -> list[list[bool]]:
        return [[can_read(d, "s", uid, g) for uid, g in who] for d in (mnt.path, ref)]

    assert readers() == [[True, False, True]] * 2  # named user, nobody, named group
    # chmod moves the mask: the named entries lose what the group bits lose.
    both(dirs, "chmod 600 s")
    assert readers() == [[False, False, False]] * 2
    both(dirs, "setfacl -m m::r s")
    assert readers() == [[True, False, True]] * 2
    both(dirs, "setfacl -x u:1001 s")
    assert readers() == [[False, False, True]] * 2
    # A directory: a named user may create files in it, another may not.
    both(dirs, "mkdir w; setfacl -m u:1002:rwx w")
    for d in (mnt.path, ref):
        assert sh(d, "touch w/by1002", 1002, check=False).returncode == 0
        assert sh(d, "touch w/by1001", 1001, check=False).returncode != 0
    assert observe(mnt.path) == observe(ref)
    # The ACLs are in the pool: after a remount, and after a kill -9 behind an fsync.
    fsync_path(mnt.path / "s")
    mnt.kill9()
    mnt.start()
    assert readers() == [[False, False, True]] * 2
    assert observe(mnt.path) == observe(ref)
    mnt.remount()
    assert observe(mnt.path) == observe(ref)


def test_acl_and_mode_stay_in_step_as_on_tmpfs(dirs: tuple[Mount, Path]) -> None:
    both(dirs, "touch a b c; setfacl -m u:1001:rw,g:1234:r a; chmod 604 a;"
               " setfacl -m u::rwx,g::r,o::- b;"  # equivalent to a mode: no ACL kept
               " setfacl -m u:1001:rwx c; setfacl -b c;"
               " touch k; chown 1001:1234 k; chmod 2770 k")
    # The owner, not in the file's group, sets an ACL: setgid goes, as on ext4.
    both(dirs, "setfacl -m u:1002:r k", uid=1001)
    mnt, ref = dirs
    got = observe(mnt.path)
    assert got == observe(ref)
    assert got["stat"]["b"][0] == "-rwxr-----"  # type: ignore[index]
    assert got["stat"]["k"][0] == "-rwxrwx---"  # type: ignore[index]
    # Malformed ACLs are refused (EINVAL) and change nothing.
    for bad in (b"\x02\x00\x00\x00\x01\x00", b"\x02\x00\x00\x00" + b"\x01\x00\x06\x00\xff\xff\xff\xff"):
        with pytest.raises(OSError) as e:
            os.setxattr(mnt.path / "a", "system.posix_acl_access", bad)
        assert e.value.errno == errno.EINVAL
    assert observe(mnt.path) == got


# ------------------------------------------------------------------ default ACLs


def test_default_acl_applies_to_new_entries_as_on_tmpfs(dirs: tuple[Mount, Path]) -> None:
    both(dirs, f"mkdir d; setfacl -m u:1001:rwx d; setfacl -d -m u:1001:rwx,g:{MEMBER}:rx,m::rwx,o::- d;"
               " touch d/f1; mkdir d/s; mkfifo d/p;"
               f" python3 -c {shlex.quote(PY_CREATE)} d/f2 600;"
               " mkdir d/s/t; touch d/s/f3")
    # The umask does not apply under a default ACL...
    both(dirs, "touch d/f4; mkdir d/s2", umask=0o077)
    # ...and applies where there is none.
    both(dirs, "touch plain; mkdir plaind", umask=0o027)
    both(dirs, "touch d/by1001", uid=1001, umask=0o077)
    mnt, ref = dirs
    got = observe(mnt.path)
    assert got == observe(ref)
    assert got["stat"]["d/f4"][0] == "-rw-rw----"  # type: ignore[index]
    assert got["stat"]["plain"][0] == "-rw-r-----"  # type: ignore[index]
    # The named user of the default ACL may write the files made under it.
    assert sh(mnt.path, "echo x >> d/f1", 1001, check=False).returncode == 0
    assert sh(mnt.path, "echo x >> d/f1", 1002, check=False).returncode != 0
    sh(ref, "echo x >> d/f1", 1001)
    fsync_path(mnt.path / "d" / "f1")
    mnt.kill9()
    mnt.start()
    assert observe(mnt.path) == observe(ref)


# ------------------------------------------------------------------ setgid


def test_setgid_directory_as_on_tmpfs(dirs: tuple[Mount, Path]) -> None:
    both(dirs, f"mkdir g; chgrp {MEMBER} g; chmod 2777 g; touch g/rootfile; mkdir -p g/rootdir/sub;"
               " touch g/w g/c g/x; chmod 6777 g/w; chmod 6755 g/c; chmod 2755 g/x")
    member = f"touch g/m1; mkdir g/m2; python3 -c {shlex.quote(PY_CREATE)} g/m3 2775"
    both(dirs, member, uid=1001, groups=(MEMBER,))
    # A non-member: its setgid file loses the bit; it is not a member of the group it gets.
    both(dirs, f"touch g/n1; mkdir g/n2; python3 -c {shlex.quote(PY_CREATE)} g/n3 2775;"
               " touch g/n4; chmod 6755 g/n4", uid=1002, umask=0)
    # Writes by someone without CAP_FSETID clear setuid and setgid; root's do not; chown does.
    both(dirs, "echo x >> g/w", uid=1002)
    both(dirs, "echo y >> g/x; chown 1001 g/c")
    mnt, ref = dirs
    got = observe(mnt.path)
    assert got == observe(ref)
    s = got["stat"]
    assert s["g/rootfile"][3] == MEMBER and s["g/rootdir/sub"][0] == "drwxr-sr-x"  # type: ignore[index]
    assert s["g/n3"][0] == "-rwxrwxr-x" and s["g/m3"][0] == "-rwxr-sr-x"  # type: ignore[index]
    assert s["g/w"][0] == "-rwxrwxrwx" and s["g/c"][0] == "-rwxr-xr-x"  # type: ignore[index]
    assert s["g/x"][0] == "-rwxr-sr-x"  # type: ignore[index]
    mnt.remount()
    assert observe(mnt.path) == got


# ------------------------------------------------------------------ setuid and setgid


def test_setuid_and_setgid_are_cleared_by_writes_truncates_and_chowns_as_on_tmpfs(
        dirs: tuple[Mount, Path]) -> None:
    """With FUSE_HANDLE_KILLPRIV_V2 the kernel leaves the clearing to the file system and
    only says when (the writer lacks CAP_FSETID; any chown): every case of should_remove_suid
    against tmpfs, which the kernel clears for itself."""
    mnt, ref = dirs
    # Else the kernel would clear them itself and this would check the kernel, not us.
    assert json.loads(cli("status", mnt.path, "--json").stdout)["handle_killpriv_v2"] is True
    both(dirs, "for f in w1 w2 w3 w4 t1 t2 o1 o2 c2 m1; do touch $f; done;"
               f" chmod 6777 w1 w4 t1 t2 o1 o2 m1; chgrp {MEMBER} w2 w3; chmod 2767 w2 w3;"
               " chmod 6755 c2; touch c1; chown 1001 c1; chmod 6755 c1")
    both(dirs, "echo x >> w1", uid=1002)  # both bits
    both(dirs, "echo x >> w2", uid=1002)  # setgid without group exec: not in the group
    both(dirs, "echo x >> w3", uid=1001, groups=(MEMBER,))  # ...in the group: kept
    both(dirs, "echo x >> w4; truncate -s 1 t2; : > o2")  # root (CAP_FSETID): kept
    both(dirs, "truncate -s 1 t1", uid=1002)
    both(dirs, ": > o1", uid=1002)  # open(O_TRUNC): no setattr, the open says it
    both(dirs, f"chgrp {MEMBER} c1", uid=1001, groups=(MEMBER,))  # the owner's chown
    both(dirs, "chown 1001 c2")  # root's chown clears them too
    both(dirs, "printf abc | dd of=m1 bs=1 seek=3 conv=notrunc status=none", uid=1002)
    got = observe(mnt.path)
    assert got == observe(ref)
    s = got["stat"]
    assert s["w1"][0] == "-rwxrwxrwx" and s["w2"][0] == "-rwxrw-rwx"  # type: ignore[index]
    assert s["w3"][0] == "-rwxrwSrwx" and s["w4"][0] == "-rwsrwsrwx"  # type: ignore[index]
    assert s["t1"][0] == "-rwxrwxrwx" and s["o1"][0] == "-rwxrwxrwx"  # type: ignore[index]
    assert s["t2"][0] == "-rwsrwsrwx" and s["o2"][0] == "-rwsrwsrwx"  # type: ignore[index]
    assert s["c1"][0] == "-rwxr-xr-x" and s["c2"][0] == "-rwxr-xr-x"  # type: ignore[index]
    assert s["m1"][0] == "-rwxrwxrwx"  # type: ignore[index]
    mnt.remount()
    assert observe(mnt.path) == got


def test_direct_io_write_clears_setuid(dirs: tuple[Mount, Path]) -> None:
    """O_DIRECT writes take the kernel's direct path, which clears nothing itself and always
    asks the file system to (tmpfs has no O_DIRECT to compare with: ext4's rule, asserted)."""
    mnt, _ = dirs
    sh(mnt.path, "touch d; chmod 6777 d")
    script = ("import mmap, os; fd = os.open('d', os.O_WRONLY | os.O_DIRECT); "
              "buf = mmap.mmap(-1, 4096); buf.write(b'x' * 4096); os.write(fd, buf)")
    res = sh(mnt.path, f"python3 -c {shlex.quote(script)}", uid=1002, check=False)
    if res.returncode != 0 and "Invalid argument" in res.stderr:
        pytest.skip("this kernel refuses O_DIRECT on the mount")
    assert res.returncode == 0, res.stderr
    assert stat.filemode(os.stat(mnt.path / "d").st_mode) == "-rwxrwxrwx"


MAKE = {
    "fifo": "mknod $f p",
    "chr": "mknod $f c 1 3",
    "blk": "mknod $f b 7 0",
    "sock": "python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' $f",
    "reg": "touch $f",
    "symlink": "ln -s t $f",
}


@pytest.mark.parametrize("kind", list(MAKE))
def test_chown_clears_setuid_and_setgid_of_every_non_directory_as_on_tmpfs(
        dirs: tuple[Mount, Path], kind: str) -> None:
    """A chown of any non-directory clears setuid, and setgid when the group may execute or
    the caller is in neither the old group nor (when setuid goes too) the new one, unless it
    has CAP_FSETID. The kernel flags every such chown and leaves the clearing to us
    (HANDLE_KILLPRIV_V2), whatever the file's type. A symlink has no bits to lose (chmod
    follows it): its row checks that lchown of one changes nothing else."""
    chmod = ": " if kind == "symlink" else "chmod "
    both(dirs, f"touch t; for f in a b c d e g h k; do {MAKE[kind]}; done;"
               " chown -h 1001:1001 a b c; chown -h 1001:3001 d;"
               f" {chmod}6755 a e; {chmod}6745 b c g h k; {chmod}2745 d")
    # The owner, in the old group, to a group it is in (uid unchanged): group exec or not.
    both(dirs, f"chgrp -h {MEMBER} a b; chown -h 1001:{MEMBER} c", uid=1001, groups=(MEMBER,))
    # The owner, not in the old group: setgid goes even without group exec.
    both(dirs, f"chgrp -h {MEMBER} d", uid=1001, groups=(MEMBER,))
    # Root: setuid always goes, setgid only with group exec.
    both(dirs, f"chown -h 1002 e g; chgrp -h {MEMBER} h")
    # Root without CAP_FSETID, to a group it is not in: setgid goes with setuid.
    both(dirs, f"setpriv --clear-groups --bounding-set -fsetid -- chgrp -h {MEMBER} k")
    mnt, ref = dirs
    got = observe(mnt.path)
    assert got == observe(ref)
    s = got["stat"]
    modes = {name: int(s[name][1], 8) & 0o7777 for name in "abcdeghk"}  # type: ignore[index]
    if kind == "symlink":
        assert set(modes.values()) == {0o777}
    else:
        assert modes == {"a": 0o755, "b": 0o2745, "c": 0o2745, "d": 0o745, "e": 0o755,
                         "g": 0o2745, "h": 0o2745, "k": 0o745}
    assert [s[n][2:] for n in "abcdeghk"] == [  # type: ignore[index]
        (1001, MEMBER), (1001, MEMBER), (1001, MEMBER), (1001, MEMBER), (1002, 0), (1002, 0),
        (0, MEMBER), (0, MEMBER)]
    mnt.remount()
    assert observe(mnt.path) == got


# ------------------------------------------------------------------ without xattrs


def test_noxattr_mount_refuses_acls(work_dir: Path, make_pool: MakePool, mount_pool: MountPool) -> None:
    mnt = mount_pool(make_pool("64M"), options="pmem=force,noxattr")
    p = mnt.path / "f"
    p.touch()
    mode = p.stat().st_mode
    value = b"\x02\x00\x00\x00" + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + ident.to_bytes(4, "little")
        for tag, perm, ident in ((1, 6, 0xFFFFFFFF), (2, 4, 1001), (4, 4, 0xFFFFFFFF),
                                 (0x10, 4, 0xFFFFFFFF), (0x20, 0, 0xFFFFFFFF)))
    with pytest.raises(OSError) as e:
        os.setxattr(p, "system.posix_acl_access", value)
    assert e.value.errno == errno.EOPNOTSUPP
    res = subprocess.run(["setfacl", "-m", "u:1001:r", str(p)], capture_output=True, text=True)
    assert res.returncode != 0 and "not supported" in res.stderr
    assert p.stat().st_mode == mode  # nothing changed, nothing stored to be ignored


# ------------------------------------------------------------------ timestamps


def test_touch_right_after_create_never_takes_mtime_back(mnt: Mount) -> None:
    back = []
    for i in range(200):
        p = mnt.path / f"t{i}"
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
        before = os.stat(p)
        os.utime(p)  # touch: UTIME_NOW
        after = os.stat(p)
        if after.st_mtime_ns < before.st_mtime_ns or after.st_ctime_ns <= before.st_ctime_ns:
            back.append((p.name, before.st_mtime_ns, after.st_mtime_ns, before.st_ctime_ns,
                         after.st_ctime_ns))
    assert back == []
    # A time given is stored as given, back in time too (as on ext4).
    p = mnt.path / "t0"
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
