"""Tokens rotate with no restart (issue 17): SIGHUP makes a target and a mount read their token
files again. A real target and mount, real signals; the target is killed and restarted only to
make the mount open a new connection, which then proves the token it holds."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio
from conftest import MountPool
from helpers import cli, status_json, wait_until, write_fsync

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
