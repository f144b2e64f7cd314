"""rpmemfs/safeopen.py: what a write of a named file refuses (issue 30, item 4). The commands
that use it are tested end to end in tests/e2e/test_planted_links.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rpmemfs import safeopen

NOBODY = 65534


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", [safeopen.append, safeopen.overwrite, safeopen.create,
                                 safeopen.replace, safeopen.write_text])
def test_a_link_is_never_written_through(tmp_path: Path, how: object) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"kept")
    link = tmp_path / "link"
    link.symlink_to(victim)
    refused = f"^{link} is a symbolic link: refusing to write through it"
    with pytest.raises(safeopen.RefusedPath, match=refused):
        if how is safeopen.write_text:
            safeopen.write_text(link, "x")
        else:
            how(str(link))  # type: ignore[operator]
    assert victim.read_bytes() == b"kept" and link.is_symlink()


def test_append_and_overwrite_refuse_a_file_with_another_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"kept")
    os.link(victim, tmp_path / "log")
    for how in (safeopen.append, safeopen.overwrite):
        with pytest.raises(safeopen.RefusedPath, match="has 2 names"):
            how(str(tmp_path / "log"))
    assert victim.read_bytes() == b"kept"


def test_append_and_overwrite_refuse_another_users_file(tmp_path: Path) -> None:
    theirs = tmp_path / "log"
    theirs.write_bytes(b"theirs")
    try:
        os.chown(theirs, NOBODY, NOBODY)
    except PermissionError:
        # Not root, or root stripped of CAP_CHOWN (scripts/test.sh runs this tier so too).
        pytest.skip("needs CAP_CHOWN, to give a file to another user")
    for how in (safeopen.append, safeopen.overwrite):
        with pytest.raises(safeopen.RefusedPath, match=f"belongs to uid {NOBODY}"):
            how(str(theirs))
    assert theirs.read_bytes() == b"theirs"


def test_what_each_one_writes(tmp_path: Path) -> None:
    log = tmp_path / "log"
    _write(safeopen.append(str(log)), b"one\n")
    _write(safeopen.append(str(log)), b"two\n")
    assert log.read_bytes() == b"one\ntwo\n" and log.stat().st_mode & 0o777 == 0o600
    safeopen.write_text(log, "new")
    assert log.read_text() == "new"
    _write(safeopen.overwrite(os.devnull), b"x")  # not a regular file: written as it is
    with pytest.raises(FileExistsError):
        safeopen.create(str(log))
    kept = os.open(log, os.O_RDONLY)
    try:
        _write(safeopen.replace(str(log)), b"fresh")
        assert os.pread(kept, 10, 0) == b"new"  # the old file lost its name, nothing more
    finally:
        os.close(kept)
    assert log.read_bytes() == b"fresh"
