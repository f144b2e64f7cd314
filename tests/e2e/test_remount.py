"""Remounts that stay quick: a mount after a crash checkpoints a long log tail away, so that
the next crash does not replay it again; an unmount rewrites no snapshot for a short tail.

What a mount replayed is read from `rpmemfs status --json` (replay.tail_records: the records
after the snapshot; log.checkpoints: checkpoints since the mount).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from conftest import MakePool, MountPool
from helpers import assert_check_clean, fsync_path, status_json

FILES = 400  # with an fsync each: a tail of several hundred KiB, far past 64 KiB


def make_files(root: Path, n: int, tag: str) -> dict[Path, bytes]:
    made: dict[Path, bytes] = {}
    for i in range(n):
        directory = root / f"{tag}{i // 100}"
        if i % 100 == 0:
            directory.mkdir()
        path = directory / f"f{i}"
        data = f"{tag} {i}\n".encode() * (1 + i % 7)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        made[path] = data
    fsync_path(root)
    return made


def replay(mnt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    st = status_json(mnt)
    return st["replay"], st["log"]


def test_a_mount_after_a_crash_checkpoints_and_the_next_crash_replays_no_tail(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("64M"))
    files = make_files(m.path, FILES, "a")

    m.kill9()
    assert_check_clean(m.pool)
    m.start()
    rp, lg = replay(m.path)
    assert rp["tail_records"] >= FILES, rp  # a record per create at least
    assert rp["tail_bytes"] > 64 << 10, rp
    assert lg["checkpoints"] == 1, lg  # written at mount, before serving
    assert lg["used"] < rp["tail_bytes"], (lg, rp)  # the snapshot is smaller than the tail

    m.kill9()
    assert_check_clean(m.pool)
    m.start()
    rp, lg = replay(m.path)
    assert rp["tail_records"] == 0, rp
    assert lg["checkpoints"] == 0, lg
    for path, data in files.items():
        assert path.read_bytes() == data, path
    assert len(list(m.path.glob("a*/f*"))) == FILES


def test_an_unmount_checkpoints_a_long_tail_only(make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("64M"))
    few = make_files(m.path, 3, "few")
    gen = status_json(m.path)["log"]["generation"]
    m.remount()
    rp, lg = replay(m.path)
    assert lg["generation"] == gen, "an unmount with a short tail rewrote the snapshot"
    assert rp["tail_records"] >= 3, rp
    assert lg["checkpoints"] == 0, lg

    many = make_files(m.path, FILES, "many")
    m.remount()
    rp, lg = replay(m.path)
    assert lg["generation"] == gen + 1, "an unmount with a long tail wrote no checkpoint"
    assert rp["tail_records"] == 0, rp
    for path, data in (few | many).items():
        assert path.read_bytes() == data, path
