"""The systemd units and the mount helper as an administrator meets them: the units pass
`systemd-analyze verify`, are rated below 5 by `systemd-analyze security`, start after the
network is online, and their daemons say READY=1 (Type=notify) only once they serve;
`mount.rpmemfs --help` lists every mount option."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cli, is_mounted, mkfs, wait_until

from rpmemfs.mountd.options import OPTIONS
from rpmemfs.tools.processes import TargetProcess, child_env, rpmemfs_command

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"rpmemfs@.service": "rpmemfs@app.service",
         "rpmemfs-target@.service": "rpmemfs-target@main.service"}
RPMEMFS_BIN = str(Path(sys.executable).parent / "rpmemfs")


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package has it)")
    return tool


@pytest.fixture
def instances(work_dir: Path) -> list[Path]:
    """Each unit as an instance, its ExecStart pointed at this checkout's rpmemfs."""
    out = []
    for template, name in UNITS.items():
        text = (ROOT / "mount" / template).read_text().replace("/usr/local/bin/rpmemfs", RPMEMFS_BIN)
        path = work_dir / name
        path.write_text(text)
        out.append(path)
    return out


def test_units_verify_and_order_after_the_network(instances: list[Path]) -> None:
    res = subprocess.run([_analyze(), "verify", *map(str, instances)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and not res.stderr.strip(), res.stdout + res.stderr
    for unit in instances:
        text = unit.read_text()
        assert re.search(r"^After=.*network-online\.target", text, re.M), unit
        assert re.search(r"^Wants=.*network-online\.target", text, re.M), unit
        assert "Type=notify" in text, unit


def test_units_are_rated_below_5_by_systemd_analyze_security(instances: list[Path]) -> None:
    for unit in instances:
        res = subprocess.run([_analyze(), "security", "--offline=true", "--no-pager", str(unit)],
                             capture_output=True, text=True, timeout=60)
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", res.stdout)
        assert found, res.stdout + res.stderr
        assert float(found.group(1)) < 5, (unit.name, found.group(0))


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    d = tempfile.mkdtemp(prefix="rpm-notify-")
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(30)
    monkeypatch.setenv("NOTIFY_SOCKET", path)  # what systemd hands a Type=notify service
    yield s
    s.close()
    os.unlink(path)
    os.rmdir(d)


def test_the_target_says_ready_once_it_listens(work_dir: Path, notify_socket: socket.socket) -> None:
    d = work_dir / "pools"
    d.mkdir()
    with TargetProcess(d) as t:
        msg = notify_socket.recv(4096).decode()
        assert "READY=1" in msg.splitlines(), msg
        # Ready means serving: a client gets in.
        assert cli("pools", t.address).returncode == 0
        t.stop()
        assert "STOPPING=1" in notify_socket.recv(4096).decode()


def test_a_foreground_mount_says_ready_once_mounted(work_dir: Path, notify_socket: socket.socket) -> None:
    pool, mnt = work_dir / "p.pool", work_dir / "mnt"
    mnt.mkdir()
    mkfs(pool, "16M")
    proc = subprocess.Popen([*rpmemfs_command("mount", "-f", pool, mnt, "-o", "pmem=force")],
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        msg = notify_socket.recv(4096).decode()
        assert "READY=1" in msg.splitlines(), msg
        assert is_mounted(mnt)  # already, when it said so
        (mnt / "f").write_bytes(b"served")
    finally:
        assert cli("umount", mnt).returncode == 0
        proc.wait(timeout=60)
    assert "STOPPING=1" in notify_socket.recv(4096).decode()
    assert wait_until(lambda: not is_mounted(mnt), 10)


def test_the_mount_helper_lists_every_option() -> None:
    env = dict(os.environ, RPMEMFS_BIN=RPMEMFS_BIN)
    res = subprocess.run([str(ROOT / "mount" / "mount.rpmemfs"), "--help"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for name, (_, shown, _, _) in OPTIONS.items():
        assert f"  {shown} " in res.stdout, (name, res.stdout)
    assert len(OPTIONS) >= 14


def test_mkfs_refused_by_a_target_leaves_nothing_behind(work_dir: Path, targets: list[TargetProcess]) -> None:
    # Replica 1 cannot be made (a pool of that name is there already); replica 0 can.
    pool = work_dir / "app.pool"
    (targets[1].pool_dir / "app").write_bytes(b"someone else's")
    res = cli("mkfs", pool, "--size", "16M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "local pool was removed, and so was every replica it made" in res.stderr, res.stderr
    assert "no --force needed" in res.stderr
    assert not pool.exists()
    assert not (targets[0].pool_dir / "app").exists()  # made, then removed again
    assert (targets[1].pool_dir / "app").read_bytes() == b"someone else's"  # not ours: untouched
    (targets[1].pool_dir / "app").unlink()
    res = cli("mkfs", pool, "--size", "16M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
