"""Tokens rotate with no restart (issue 17): SIGHUP makes a target and a mount read their token
files again. A real target and mount, real signals; the target is killed and restarted only to
make the mount open a new connection, which then proves the token it holds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import trio
from conftest import MountPool
from helpers import cli, describe, status_json, wait_until, write_fsync

from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport import TransportError, connect
from rpmemfs.transport.tokens import new_token_file, read_token_file

POOL = 1 << 20


def _replace_token(path: Path, scratch: Path) -> bytes:
    """Write a fresh token into ``path`` the way an administrator should: beside it, then
    renamed over it (a reader never sees half a file)."""
    fresh = scratch / f"{path.name}.new"
    new_token_file(str(fresh))
    os.replace(fresh, path)
    return read_token_file(str(path))


def _can_connect(address: str, token: bytes) -> bool:
    async def main() -> bool:
        try:
            async with await connect(address, token, lanes=0, timeout=5):
                return True
        except TransportError as exc:
            assert "authentication failed" in str(exc), exc
            return False

    return trio.run(main)


def test_a_target_and_a_mount_reread_their_tokens_on_sighup(work_dir: Path, mount_pool: MountPool) -> None:
    target_token, mount_token = work_dir / "target.token", work_dir / "mount.token"
    new_token_file(str(target_token))
    old = read_token_file(str(target_token))
    mount_token.write_bytes(target_token.read_bytes())
    mount_token.chmod(0o600)
    (work_dir / "t").mkdir()
    t = TargetProcess(work_dir / "t", token_file=target_token, pmem="force", log_path=work_dir / "t.log")
    t.start()
    try:
        pool = work_dir / "app.pool"
        res = cli("mkfs", pool, "--size", "64M", "--replica", f"{t.address}/app", "--token-file", mount_token)
        assert res.returncode == 0, res.stderr
        # min_replicas=0: writes go on while the replica is out (below).
        m = mount_pool(pool, options="pmem=force,min_replicas=0")
        write_fsync(m.path / "a", b"before the rotation")

        # The target: a new token in its file, SIGHUP. New connections must prove it; the
        # mount's session, opened with the old one, goes on.
        new = _replace_token(target_token, work_dir)
        assert t.proc is not None
        t.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "tokens reread" in t.log_text()), t.log_text()
        assert not _can_connect(t.address, old)
        assert _can_connect(t.address, new)
        write_fsync(m.path / "b", b"after the target's rotation")
        assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync"]

        # A token file gone wrong (readable by others) changes nothing on SIGHUP.
        target_token.chmod(0o644)
        t.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "tokens not reread" in t.log_text()), t.log_text()
        target_token.chmod(0o600)
        assert _can_connect(t.address, new)

        # The mount opens a new connection only when it must: kill the target and start it
        # again. With the old token the mount cannot get back in...
        t.kill()
        t = t.respawn(log_path=work_dir / "t2.log")
        t.start()
        write_fsync(m.path / "c", b"while the replica is out")

        def last_error() -> str:
            return str(status_json(m.path)["replicas"][0].get("last_error") or "")

        assert wait_until(lambda: "authentication failed" in last_error(), timeout=30), \
            (status_json(m.path)["replicas"], m.output()[-3000:], t.log_text()[-3000:])
        assert status_json(m.path)["replicas"][0]["state"] != "in-sync"
        # ... and once its token file holds the new token and it got SIGHUP, it does, with
        # no restart of the mount.
        mount_token.write_bytes(target_token.read_bytes())
        assert m.proc is not None
        m.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: status_json(m.path)["replicas"][0]["state"] == "in-sync", timeout=20), \
            status_json(m.path)
        write_fsync(m.path / "d", b"after the mount's rotation")
        assert (m.path / "a").read_bytes() == b"before the rotation"
        assert m.running  # SIGHUP no longer stops a mount
    finally:
        t.close()


def test_the_documented_rotation_works_with_sighup_alone(work_dir: Path, mount_pool: MountPool) -> None:
    """Issue 28: docs/access.md's procedure, line by line, for targets started with
    `--token-file /etc/rpmemfs/token` (no --authz), while a mount writes through them. Each
    node's /etc/rpmemfs is a directory of its own here; `systemctl reload` is its ExecReload,
    a SIGHUP; `scp -p` is `cp -p`. Evicting a replica's session makes the mount open a new
    connection, which proves the token it holds then."""
    etc = {node: work_dir / node / "etc" for node in ("a", "b", "c")}  # a mounts; b, c serve
    for d in etc.values():
        d.mkdir(parents=True)
    new_token_file(str(etc["a"] / "token"))
    old = read_token_file(str(etc["a"] / "token"))
    for node in ("b", "c"):
        shutil.copy2(etc["a"] / "token", etc[node] / "token")
    targets = {}
    for node in ("b", "c"):
        (work_dir / node / "pools").mkdir()
        targets[node] = TargetProcess(work_dir / node / "pools", token_file=etc[node] / "token",
                                      pmem="force", log_path=work_dir / f"{node}.log")
        targets[node].start()
    stop, written, failures = threading.Event(), [0], []

    def writer() -> None:
        while not stop.is_set():
            try:
                write_fsync(m.path / f"w{written[0] % 50}", b"%d" % written[0])
                written[0] += 1
            except OSError as exc:
                failures.append(exc)
                return

    def run(node: str, line: str) -> None:
        res = subprocess.run(["sh", "-c", line.replace("/etc/rpmemfs", str(etc[node]))],
                             capture_output=True, text=True)
        assert res.returncode == 0, (line, res.stderr)

    def reload_target(node: str, tokens: str) -> None:
        t = targets[node]
        assert t.proc is not None
        before = t.log_text().count("tokens reread")
        t.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: t.log_text().count("tokens reread") > before), t.log_text()
        assert f"tokens reread: default (admin, {tokens})" in t.log_text(), t.log_text()

    def reconnect(node: str) -> None:
        """Drop the mount's session on ``node``; it comes back with the token it holds now."""
        back = f"replica {targets[node].address}/app is in sync again"
        before = m.output().count(back)
        res = cli("evict", targets[node].address, "app", "--token-file", etc[node] / "token")
        assert res.returncode == 0, describe(res)
        assert wait_until(lambda: m.output().count(back) > before, timeout=30), \
            (status_json(m.path), m.output()[-3000:])

    try:
        pool = work_dir / "app.pool"
        res = cli("mkfs", pool, "--size", "64M", "--replica", f"{targets['b'].address}/app",
                  "--replica", f"{targets['c'].address}/app", "--token-file", etc["a"] / "token")
        assert res.returncode == 0, describe(res)
        # min_replicas=1: fsync goes on while one replica reconnects; info: its SIGHUP's line.
        m = mount_pool(pool, options="pmem=force,min_replicas=1,log_level=info")
        thread = threading.Thread(target=writer)
        thread.start()

        # 1. The new token, made on one node and copied to the others.
        res = cli("token", "new", etc["a"] / "token.new")
        assert res.returncode == 0, describe(res)
        new = read_token_file(str(etc["a"] / "token.new"))
        for node in ("b", "c"):
            run("a", f"cp -p /etc/rpmemfs/token.new {etc[node] / 'token.new'}")
        # 2. Every target accepts it beside the old one.
        for node in ("b", "c"):
            run(node, "cat /etc/rpmemfs/token.new >> /etc/rpmemfs/token")
            reload_target(node, "2 tokens")
            assert _can_connect(targets[node].address, old)
            assert _can_connect(targets[node].address, new)
        reconnect("b")  # the mount, not reloaded yet, gets back in with the old token
        # 3. The mount proves the new token from now on.
        run("a", "cat /etc/rpmemfs/token.new >> /etc/rpmemfs/token")
        assert m.proc is not None
        m.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: f"SIGHUP: token file {etc['a'] / 'token'} reread" in m.output()), \
            m.output()[-3000:]
        reconnect("c")
        # 4. The new token alone, everywhere.
        for node in ("a", "b", "c"):
            run(node, "mv /etc/rpmemfs/token.new /etc/rpmemfs/token")
        for node in ("b", "c"):
            reload_target(node, "1 token")
            assert not _can_connect(targets[node].address, old)
            assert _can_connect(targets[node].address, new)
        for node in ("b", "c"):
            reconnect(node)  # the mount gets back in, with the new token
        stop.set()
        thread.join()
        assert not failures and written[0] > 0, (failures, m.output()[-3000:])
        write_fsync(m.path / "last", b"after the rotation")
        assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync", "in-sync"]
    finally:
        stop.set()
        for t in targets.values():
            t.close()
