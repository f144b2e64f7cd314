"""The POSIX rules the filesystem keeps itself, beside the kernel's permission checks: ACLs
and modes in step, default ACLs and setgid directories inherited, the umask, timestamps that
never go back; all of it durable and the same after a crash.

The expected values are what ext4 (fs/posix_acl.c, inode_init_owner) gives for the same calls;
tests/e2e/test_posix_acl.py compares a real mount with tmpfs.
"""

from __future__ import annotations

import errno
import stat
import struct
from collections.abc import Iterator

import pytest
from mempool import durable, new_fs, reopen, tree

from rpmemfs.fs import acl as A
from rpmemfs.fs import namespace as F
from rpmemfs.fs.creds import Creds, suidgid_to_clear
from rpmemfs.fs.filesystem import Filesystem, FsError
from rpmemfs.fs.replay import ROOT_INO

ROOT = ROOT_INO
OWNER = Creds(1000, 1000)  # an unprivileged caller, in its own group only
MEMBER = Creds(1000, 1000, frozenset({2000}))
ROOT_USER = Creds(0, 0, fsetid=True)


def acl(*entries: tuple[int, int, int]) -> bytes:
    return A.encode([A.Entry(*e) for e in entries])


U = A.UNDEFINED_ID
NAMED = acl((A.USER_OBJ, 6, U), (A.USER, 4, 1001), (A.GROUP_OBJ, 4, U), (A.MASK, 4, U), (A.OTHER, 0, U))


def perms(fs: Filesystem, ino: int) -> int:
    return stat.S_IMODE(fs.node(ino).mode)


@pytest.fixture
def fs() -> Filesystem:
    return new_fs()[0]


def remount(fs: Filesystem) -> Filesystem:
    durable(fs)
    return reopen(bytearray(fs.buf))[0]


# ------------------------------------------------------------------ the format


def test_acl_round_trip_and_what_is_malformed() -> None:
    assert A.encode(A.parse(NAMED)) == NAMED
    assert A.parse(struct.pack("<I", 2)) == []  # no entries: the kernel's "remove"
    bad = {
        "short": b"\x02\x00",
        "ragged": NAMED + b"\x00",
        "no mask with a named entry": acl((A.USER_OBJ, 6, U), (A.USER, 4, 5), (A.GROUP_OBJ, 4, U),
                                          (A.OTHER, 0, U)),
        "out of order": acl((A.GROUP_OBJ, 4, U), (A.USER_OBJ, 6, U), (A.OTHER, 0, U)),
        "no other": acl((A.USER_OBJ, 6, U), (A.GROUP_OBJ, 4, U)),
        "two owners": acl((A.USER_OBJ, 6, U), (A.USER_OBJ, 6, U), (A.GROUP_OBJ, 4, U), (A.OTHER, 0, U)),
        "perm past rwx": acl((A.USER_OBJ, 8, U), (A.GROUP_OBJ, 4, U), (A.OTHER, 0, U)),
        "unknown tag": acl((A.USER_OBJ, 6, U), (0x40, 4, U), (A.GROUP_OBJ, 4, U), (A.OTHER, 0, U)),
        "named user without id": acl((A.USER_OBJ, 6, U), (A.USER, 4, U), (A.GROUP_OBJ, 4, U),
                                     (A.MASK, 4, U), (A.OTHER, 0, U)),
    }
    for why, value in bad.items():
        with pytest.raises(FsError) as e:
            A.parse(value)
        assert e.value.errno == errno.EINVAL, why
    with pytest.raises(FsError) as e:
        A.parse(struct.pack("<I", 1) + NAMED[4:])
    assert e.value.errno == errno.EOPNOTSUPP  # another version: what the kernel answers


def test_malformed_acl_is_refused_and_changes_nothing(fs: Filesystem) -> None:
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 1000, 1000).ino
    before = tree(fs)
    with pytest.raises(FsError) as e:
        fs.setxattr(ino, A.ACCESS, NAMED[:-3], OWNER)
    assert e.value.errno == errno.EINVAL
    assert tree(fs) == before
    assert tree(remount(fs)) == before


# ------------------------------------------------------------------ access ACLs and the mode


def test_access_acl_sets_the_group_bits_from_its_mask(fs: Filesystem) -> None:
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o666, 1000, 1000).ino
    fs.setxattr(ino, A.ACCESS, NAMED, OWNER)
    assert perms(fs, ino) == 0o640
    assert fs.getxattr(ino, A.ACCESS) == NAMED
    again = remount(fs)
    assert perms(again, ino) == 0o640 and again.getxattr(ino, A.ACCESS) == NAMED


def test_acl_equivalent_to_a_mode_is_not_stored_and_sets_the_mode(fs: Filesystem) -> None:
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 1000, 1000).ino
    fs.setxattr(ino, A.ACCESS, NAMED, OWNER)
    fs.setxattr(ino, A.ACCESS, acl((A.USER_OBJ, 7, U), (A.GROUP_OBJ, 5, U), (A.OTHER, 1, U)), OWNER)
    assert perms(fs, ino) == 0o751
    assert fs.getxattr(ino, A.ACCESS) is None  # the stored one went too
    again = remount(fs)
    assert perms(again, ino) == 0o751 and again.getxattr(ino, A.ACCESS) is None


def test_chmod_rewrites_owner_mask_and_other_and_keeps_named_entries(fs: Filesystem) -> None:
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 1000, 1000).ino
    fs.setxattr(ino, A.ACCESS, NAMED, OWNER)
    fs.setattr(ino, mode=0o705)
    got = A.parse(fs.getxattr(ino, A.ACCESS) or b"")
    assert got == [A.Entry(A.USER_OBJ, 7, U), A.Entry(A.USER, 4, 1001), A.Entry(A.GROUP_OBJ, 4, U),
                   A.Entry(A.MASK, 0, U), A.Entry(A.OTHER, 5, U)]
    assert remount(fs).getxattr(ino, A.ACCESS) == A.encode(got)


def test_setting_an_acl_clears_setgid_unless_in_the_group_or_capable(fs: Filesystem) -> None:
    for who, keeps in ((OWNER, False), (MEMBER, True), (Creds(1000, 1000, fsetid=True), True)):
        name = f"f{who.groups}{who.fsetid}".encode()
        ino = fs.create(ROOT, name, stat.S_IFREG | 0o2770, 1000, 2000).ino
        fs.setxattr(ino, A.ACCESS, NAMED, who)
        assert bool(fs.node(ino).mode & stat.S_ISGID) == keeps, who


def test_where_acls_cannot_go(fs: Filesystem) -> None:
    f = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    link = fs.symlink(ROOT, b"l", b"f", 0, 0).ino
    default = acl((A.USER_OBJ, 7, U), (A.GROUP_OBJ, 5, U), (A.OTHER, 5, U))
    with pytest.raises(FsError) as e:
        fs.setxattr(f, A.DEFAULT, default)
    assert e.value.errno == errno.EACCES  # a default ACL on a file: set_posix_acl's answer
    with pytest.raises(FsError) as e:
        fs.setxattr(link, A.ACCESS, NAMED)
    assert e.value.errno == errno.EOPNOTSUPP


# ------------------------------------------------------------------ creating under a default ACL


DEFAULT = acl((A.USER_OBJ, 7, U), (A.USER, 7, 1001), (A.GROUP_OBJ, 5, U), (A.MASK, 7, U), (A.OTHER, 0, U))


def test_default_acl_is_inherited_and_the_umask_is_not_applied(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    fs.setxattr(d, A.DEFAULT, DEFAULT)
    f = fs.create(d, b"x", stat.S_IFREG | 0o666, 0, 0, umask=0o022).ino
    sub = fs.mkdir(d, b"y", 0o777, 0, 0, umask=0o077).ino
    # As getfacl shows on ext4 and tmpfs: the file's mask is the requested group bits
    # ANDed with the default mask; the umask plays no part.
    assert perms(fs, f) == 0o660
    assert A.parse(fs.getxattr(f, A.ACCESS) or b"") == [
        A.Entry(A.USER_OBJ, 6, U), A.Entry(A.USER, 7, 1001), A.Entry(A.GROUP_OBJ, 5, U),
        A.Entry(A.MASK, 6, U), A.Entry(A.OTHER, 0, U)]
    assert fs.getxattr(f, A.DEFAULT) is None
    assert perms(fs, sub) == 0o770
    assert fs.getxattr(sub, A.DEFAULT) == DEFAULT  # a new directory passes it on
    deeper = fs.create(sub, b"z", stat.S_IFREG | 0o600, 0, 0, umask=0o022).ino
    assert perms(fs, deeper) == 0o600
    again = remount(fs)
    assert tree(again) == tree(fs)


def test_default_acl_equivalent_to_the_mode_leaves_no_access_acl(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    fs.setxattr(d, A.DEFAULT, acl((A.USER_OBJ, 7, U), (A.GROUP_OBJ, 5, U), (A.OTHER, 0, U)))
    f = fs.create(d, b"x", stat.S_IFREG | 0o666, 0, 0, umask=0o022).ino
    assert perms(fs, f) == 0o640
    assert fs.getxattr(f, A.ACCESS) is None


def test_without_a_default_acl_the_umask_applies(fs: Filesystem) -> None:
    f = fs.create(ROOT, b"x", stat.S_IFREG | 0o666, 0, 0, umask=0o027).ino
    d = fs.mkdir(ROOT, b"d", 0o777, 0, 0, umask=0o027).ino
    link = fs.symlink(ROOT, b"l", b"x", 0, 0).ino
    assert (perms(fs, f), perms(fs, d), perms(fs, link)) == (0o640, 0o750, 0o777)


def test_acls_off_store_nothing_special() -> None:
    fs = new_fs()[0]
    fs.posix_acl = False  # a noxattr mount: the kernel checks modes only
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    fs.node(d).xattrs[A.DEFAULT] = DEFAULT  # left by an earlier mount
    f = fs.create(d, b"x", stat.S_IFREG | 0o666, 0, 0, umask=0o022).ino
    assert perms(fs, f) == 0o644 and fs.getxattr(f, A.ACCESS) is None


# ------------------------------------------------------------------ setgid directories


def test_setgid_directory_gives_its_group_and_keeps_the_bit_on_subdirectories(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o2775, 0, 2000).ino
    f = fs.create(d, b"f", stat.S_IFREG | 0o644, 1000, 1000, caller=OWNER).ino
    sub = fs.mkdir(d, b"s", 0o755, 1000, 1000, caller=OWNER).ino
    link = fs.symlink(d, b"l", b"f", 1000, 1000).ino
    fifo = fs.create(d, b"p", stat.S_IFIFO | 0o644, 1000, 1000).ino
    assert [fs.node(i).gid for i in (f, sub, link, fifo)] == [2000] * 4
    assert perms(fs, sub) == 0o2755 and perms(fs, f) == 0o644
    deeper = fs.create(sub, b"g", stat.S_IFREG | 0o644, 1000, 1000).ino
    assert fs.node(deeper).gid == 2000
    plain = fs.mkdir(ROOT, b"plain", 0o755, 0, 0).ino
    assert fs.node(fs.create(plain, b"h", stat.S_IFREG | 0o644, 1000, 1000).ino).gid == 1000
    assert tree(remount(fs)) == tree(fs)


def test_setgid_file_created_by_a_non_member_loses_the_bit(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o2777, 0, 2000).ino
    mode = stat.S_IFREG | 0o2775
    lost = fs.create(d, b"a", mode, 1000, 1000, caller=OWNER).ino
    kept = fs.create(d, b"b", mode, 1000, 1000, caller=MEMBER).ino
    assert perms(fs, lost) == 0o775 and perms(fs, kept) == 0o2775


def test_open_truncate_clears_setuid_and_setgid_for_the_unprivileged(fs: Filesystem) -> None:
    a = fs.create(ROOT, b"a", stat.S_IFREG | 0o6777, 0, 2000).ino
    fs.write(a, 0, b"data")
    fs.open_truncate(a, OWNER)
    assert perms(fs, a) == 0o777 and fs.node(a).size == 0
    b = fs.create(ROOT, b"b", stat.S_IFREG | 0o6777, 0, 2000).ino
    fs.open_truncate(b, Creds(0, 0, fsetid=True))
    assert perms(fs, b) == 0o6777


def test_kill_suidgid_follows_should_remove_suid_and_is_logged(fs: Filesystem) -> None:
    """What a write, truncate or chown the kernel flags (HANDLE_KILLPRIV_V2) clears: setuid
    always, setgid when the group may execute or the caller is not in the group."""
    a = fs.create(ROOT, b"a", stat.S_IFREG | 0o6777, 0, 2000).ino
    b = fs.create(ROOT, b"b", stat.S_IFREG | 0o6767, 0, 2000).ino
    c = fs.create(ROOT, b"c", stat.S_IFREG | 0o6767, 0, 2000).ino
    d = fs.mkdir(ROOT, b"d", stat.S_IFDIR | 0o2777, 0, 2000).ino
    ctime = fs.node(a).ctime
    fs.kill_suidgid(fs.node(a), MEMBER)
    fs.kill_suidgid(fs.node(b), OWNER)
    fs.kill_suidgid(fs.node(c), MEMBER)
    fs.kill_suidgid(fs.node(d), OWNER)  # a directory never loses them
    assert (perms(fs, a), perms(fs, b), perms(fs, c), perms(fs, d)) == (0o777, 0o767, 0o2767, 0o2777)
    assert fs.node(a).ctime > ctime
    fs.setattr(c, size=0, kill_suidgid=OWNER)
    assert perms(fs, c) == 0o767
    fs2 = remount(fs)
    assert (perms(fs2, a), perms(fs2, b), perms(fs2, c)) == (0o777, 0o767, 0o767)


@pytest.mark.parametrize("kind", [stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK,
                                  stat.S_IFREG], ids=["fifo", "chr", "blk", "sock", "reg"])
def test_chown_clears_setuid_and_setgid_of_every_non_directory(fs: Filesystem, kind: int) -> None:
    """The kernel flags a chown of any non-directory (HANDLE_KILLPRIV_V2), not only of a
    regular file, and leaves the clearing to us: chown_common's rule whatever the type."""
    inos = [fs.create(ROOT, name, kind | mode, 1000, gid, rdev=0x0701).ino
            for name, mode, gid in ((b"a", 0o6755, 1000), (b"b", 0o6745, 1000),
                                    (b"c", 0o6745, 1000), (b"d", 0o6745, 3000))]
    fs.setattr(inos[0], gid=2000, kill_suidgid=MEMBER)  # group exec: both go
    fs.setattr(inos[1], gid=2000, kill_suidgid=MEMBER)  # in the old group: setgid stays
    fs.setattr(inos[2], uid=1001, kill_suidgid=ROOT_USER)  # root: setuid goes, setgid stays
    fs.setattr(inos[3], gid=2000, kill_suidgid=MEMBER)  # not in the old group: setgid goes
    assert [perms(fs, i) for i in inos] == [0o755, 0o2745, 0o2745, 0o745]
    assert [fs.node(i).gid for i in inos] == [2000, 2000, 1000, 2000]
    fs2 = remount(fs)
    assert [perms(fs2, i) for i in inos] == [0o755, 0o2745, 0o2745, 0o745]


def test_suidgid_to_clear_follows_the_kernel() -> None:
    """setattr_should_drop_suidgid and chown_common with setattr_prepare, as a table:
    (mode, file's group, caller, new group of a chown) -> the bits that go."""
    no_fsetid_root = Creds(0, 0)  # CAP_CHOWN without CAP_FSETID
    cases = [
        (0o6755, 1000, OWNER, None, 0o6000),  # group exec: setgid goes for anyone
        (0o6755, 1000, ROOT_USER, 2000, 0o6000),
        (0o6745, 1000, OWNER, None, 0o4000),  # in the group
        (0o6745, 2000, OWNER, None, 0o6000),  # not in it
        (0o6745, 2000, MEMBER, None, 0o4000),
        (0o6745, 2000, ROOT_USER, None, 0o4000),  # capable
        (0o2745, 2000, OWNER, None, 0o2000),
        (0o0755, 2000, OWNER, None, 0),
        (0o6745, 1000, MEMBER, 2000, 0o4000),  # a chown to a group it is in
        (0o6745, 0, no_fsetid_root, 2000, 0o6000),  # ...not in the new group, setuid going
        (0o2745, 0, no_fsetid_root, 2000, 0),  # ...no setuid: no chmod, setgid stays
        (0o6745, 0, ROOT_USER, 2000, 0o4000),
    ]
    got = [suidgid_to_clear(mode, gid, who, new) for mode, gid, who, new, _ in cases]
    assert got == [want for *_, want in cases]


# ------------------------------------------------------------------ timestamps


@pytest.fixture
def stopped_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A wall clock the test sets (it may even go back)."""
    now = [1_700_000_000_000_000_000]
    monkeypatch.setattr(F.time, "time_ns", lambda: now[0])
    yield now


def test_touch_after_create_never_goes_back(fs: Filesystem, stopped_clock: list[int]) -> None:
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    created = fs.node(ino).mtime
    stopped_clock[0] -= 4_000_000  # the kernel's coarse clock is behind ours
    kernel_time = stopped_clock[0]
    fs.setattr(ino, atime=kernel_time, mtime=kernel_time, atime_now=True, mtime_now=True)
    node = fs.node(ino)
    assert node.mtime > created and node.atime == node.mtime == node.ctime


def test_every_change_advances_ctime(fs: Filesystem, stopped_clock: list[int]) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    ino = fs.create(d, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    seen = [fs.node(ino).ctime]
    dir_seen = [fs.node(d).ctime]

    def changed() -> None:
        seen.append(fs.node(ino).ctime)
        assert seen[-1] > seen[-2]

    for change in (
        lambda: fs.write(ino, 0, b"x"),
        lambda: fs.write(ino, 0, b"y"),
        lambda: fs.setattr(ino, mode=0o600),
        lambda: fs.setattr(ino, size=0),
        lambda: fs.setxattr(ino, b"user.a", b"1"),
        lambda: fs.removexattr(ino, b"user.a"),
        lambda: fs.setxattr(ino, A.ACCESS, NAMED),
        lambda: fs.link(ino, d, b"g"),
        lambda: fs.rename(d, b"g", d, b"h"),
        lambda: fs.unlink(d, b"h"),
    ):
        change()
        changed()
        stopped_clock[0] -= 1000  # and a clock that goes back changes nothing
    dir_seen.append(fs.node(d).ctime)
    assert dir_seen[-1] > dir_seen[0]
    assert fs.node(ino).mtime <= fs.node(ino).ctime


def test_explicit_times_are_stored_as_given(fs: Filesystem) -> None:
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    ctime = fs.node(ino).ctime
    fs.setattr(ino, atime=5, mtime=7)
    node = fs.node(ino)
    assert (node.atime, node.mtime) == (5, 7) and node.ctime > ctime
    again = remount(fs).node(ino)
    assert (again.atime, again.mtime, again.ctime) == (5, 7, node.ctime)


# ------------------------------------------------------------------ crashes


def test_acl_and_mode_change_together_at_every_crash_point() -> None:
    fs, persister = new_fs()
    ino = fs.create(ROOT, b"f", stat.S_IFREG | 0o2660, 1000, 2000).ino
    durable(fs)
    before = tree(fs)
    first = len(persister.calls)
    fs.setxattr(ino, A.ACCESS, NAMED, OWNER)  # mode 0640: setgid cleared, group bits from the mask
    fs.setattr(ino, mode=0o600)
    durable(fs)
    after = tree(fs)
    assert before != after
    assert len(persister.calls) > first
    for upto in range(first, len(persister.calls) + 1):
        for torn in ([], [0]):
            got = tree(reopen(persister.media(upto, torn=torn))[0])
            assert got in (before, after), (upto, torn)
    assert tree(reopen(persister.media())[0]) == after


def test_acls_survive_a_checkpoint(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    fs.setxattr(d, A.DEFAULT, DEFAULT)
    fs.create(d, b"x", stat.S_IFREG | 0o666, 0, 0, umask=0o022)
    want = tree(fs)
    fs.checkpoint()
    assert tree(remount(fs)) == want


def test_removing_a_default_acl_from_a_file_is_no_error(fs: Filesystem) -> None:
    f = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    fs.setxattr(f, A.DEFAULT, struct.pack("<I", 2))  # what setfacl -k sends: nothing to remove
    assert fs.getxattr(f, A.DEFAULT) is None


def test_caller_groups_and_cap_fsetid_from_proc_status() -> None:
    from rpmemfs.callers import ProcCaller, parse_status

    status = "Name:\tsetfacl\nUid:\t1000\t1000\t1000\t1000\nGroups:\t3000 4000 \nCapEff:\t0000000000000010\n"
    assert parse_status(status) == (frozenset({3000, 4000}), True)
    assert parse_status("Groups:\t\nCapEff:\t0000000000000000\n") == (frozenset(), False)
    gone = ProcCaller(1000, 1000, pid=0)  # no pid: the fsgid alone counts
    assert gone.in_group_or_capable(1000) and not gone.in_group_or_capable(3000)
    assert not gone.capable_fsetid()


def test_check_reports_a_malformed_stored_acl(fs: Filesystem) -> None:
    from rpmemfs.fs.check import check

    f = fs.create(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0).ino
    fs.setxattr(f, A.ACCESS, NAMED)
    durable(fs)
    assert check(memoryview(bytearray(fs.buf)))["problems"] == []
    fs.posix_acl = False  # as an older mount stored whatever it was given
    fs.setxattr(f, A.ACCESS, NAMED[:-8])
    fs.setxattr(f, A.DEFAULT, NAMED)
    durable(fs)
    problems = check(memoryview(bytearray(fs.buf)))["problems"]
    assert len(problems) == 2 and "malformed system.posix_acl_access" in problems[0], problems
