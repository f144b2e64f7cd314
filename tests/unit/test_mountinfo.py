"""The mount table as read by mountinfo.py: lines, and which of several mounts at one point
is on top (the one an unmount there reaches)."""

from __future__ import annotations

import pytest

from rpmemfs import mountinfo

LINES = [
    r"22 1 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw",
    r"40 22 0:35 / /dev/shm/a\040b rw,nosuid - fuse.rpmemfs rpmemfs:/pools/x\040y.pool rw,user_id=0",
    # mounted over the first: its parent is the mount below it
    r"41 40 0:36 / /dev/shm/a\040b rw - tmpfs tmpfs rw",
    "not a mountinfo line",
]


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [e for e in map(mountinfo.parse_line, LINES) if e is not None]
    monkeypatch.setattr(mountinfo, "mounts", lambda: entries)


def test_lines_are_parsed_with_their_ids_and_escapes() -> None:
    e = mountinfo.parse_line(LINES[1])
    assert e == mountinfo.MountEntry("/dev/shm/a b", "fuse.rpmemfs", "rpmemfs:/pools/x y.pool", 40, 22)
    assert mountinfo.parse_line(LINES[3]) is None


def test_mount_at_is_the_one_on_top(table: None) -> None:
    top = mountinfo.mount_at("/dev/shm/a b")
    assert top is not None and (top.fstype, top.mount_id) == ("tmpfs", 41)
    assert mountinfo.mount_at("/dev/shm") is not None
    assert mountinfo.mount_at("/dev/shm/a") is None
