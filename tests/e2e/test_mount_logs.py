"""A mount forked off without `-o log=` (as mount(8) and fstab start it) logs to syslog, and a
target that keeps failing costs a line per change, not one per attempt."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cli, is_mounted, wait_until, write_fsync

from rpmemfs.tools.processes import TargetProcess


@pytest.fixture
def syslog(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    d = tempfile.mkdtemp(prefix="rpm-syslog-")
    path = os.path.join(d, "log")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    sink.setblocking(False)
    monkeypatch.setenv("RPMEMFS_SYSLOG_SOCKET", path)  # the mount inherits it
    yield sink
    sink.close()
    os.unlink(path)
    os.rmdir(d)


def _drain(sink: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sink.recv(65536).decode())
        except BlockingIOError:
            return out


def test_a_forked_mount_logs_to_syslog_once_per_change(
        work_dir: Path, targets: list[TargetProcess], syslog: socket.socket) -> None:
    pool, mnt = work_dir / "app.pool", work_dir / "mnt"
    mnt.mkdir()
    res = cli("mkfs", pool, "--size", "64M", "--replica", f"{targets[1].address}/app")
    assert res.returncode == 0, res.stderr
    res = cli("mount", pool, mnt, "-o", "pmem=force,min_replicas=0,replica_timeout=1,log_level=info")
    assert res.returncode == 0, res.stderr
    try:
        targets[1].kill()
        write_fsync(mnt / "f", b"x" * 9000)
        lines: list[str] = []
        assert wait_until(lambda: bool(lines.extend(_drain(syslog)) or
                                       any("fell behind" in ln for ln in lines)), timeout=20), lines
        # Reconnect attempts go on for seconds (backoff up to 5 s); the reason stays the same.
        for _ in range(8):
            write_fsync(mnt / "f", b"y" * 9000)
        time.sleep(6)
        lines += _drain(syslog)
        assert all(ln.startswith("<") and "rpmemfs-mount[" in ln for ln in lines), lines
        unusable = [ln for ln in lines if "still unusable" in ln]
        assert len(unusable) <= 1, unusable
    finally:
        assert cli("umount", mnt).returncode == 0
    assert not is_mounted(mnt)
