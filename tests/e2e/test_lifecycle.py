"""How a mount's daemon lives and ends, with real daemons, clients and mounts.

- A control client (`rpmemfs verify`, `rpmemfs sync`) killed with kill -9 in the middle of its
  request ends only that request: the daemon keeps serving, and the next run completes clean.
- `rpmemfs umount` (and umount(8) through mount/umount.rpmemfs) returns only when the daemon
  has exited and the pool is closed clean; a busy mount stays mounted and says so.
- SIGTERM on a busy mount detaches it and serves the files still open until they are closed:
  a writer's writes and fsyncs keep succeeding; then the pool closes clean with every byte
  the writer fsynced. A second SIGTERM stops at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import MakePool, MountPool
from helpers import (
    CLI,
    REPO,
    Mount,
    assert_check_clean,
    assert_clean_error,
    cli,
    describe,
    is_mounted,
    pool_content,
    replica_file,
    status_json,
    stop_process,
    wait_until,
    write_fsync,
)

from rpmemfs.tools.processes import TargetProcess, child_env

UMOUNT_HELPER = REPO / "mount" / "umount.rpmemfs"
RPMEMFS_BIN = str(Path(sys.executable).parent / "rpmemfs")
RECORD = 4096


def _replicated(work_dir: Path, targets: list[TargetProcess], size: str) -> Path:
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", size, *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, describe(res)
    return pool



def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def _syncmap_reliable(pool: Path) -> bool:
    """Whether the pool's sync map says its last mount ended clean (a remount then trusts it
    instead of comparing every replica in full), and no replica's slot asks for a comparison."""
    from rpmemfs.pool.header import read_header
    from rpmemfs.pool.syncmap import SyncMap

    buf = memoryview(bytearray(pool.read_bytes()))
    hdr = read_header(buf)[0]
    sm = SyncMap(buf, hdr, lambda ranges: None)
    return sm.reliable and not any(sm.slot_flags)


# ------------------------------------------------------- control clients that die


def _progress_then_kill(argv: list[str], label: str) -> None:
    """Run an `rpmemfs` client with its stderr on a terminal (so it draws its progress bar),
    and kill -9 it once the bar shows the daemon's first progress line."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave, env=child_env())
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while f"{label} [".encode() not in seen:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([master], [], [], max(left, 0))
            assert ready, f"no progress from {' '.join(argv)} within 60 s: {seen!r}"
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the client is gone, and closed the terminal
                chunk = b""
            assert chunk, f"{' '.join(argv)} ended (status {proc.wait()}) before any progress: {seen!r}"
            seen += chunk
        assert proc.poll() is None, f"{label} finished before it could be killed: {seen!r}"
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


@pytest.mark.parametrize("command", ["verify", "sync"])
def test_a_control_client_killed_mid_request_leaves_the_daemon_serving(
        command: str, work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = _replicated(work_dir, targets, "256M")
    m = mount_pool(pool)
    write_fsync(m.path / "before", os.urandom(300_000))
    argv = [*CLI, command, str(m.path), *(["--chunk", "4K"] if command == "verify" else [])]
    # A target that does not answer for a moment holds the request in the middle of its
    # comparison (well within replica_timeout), whatever the speed of this machine.
    assert targets[0].proc is not None
    stop_process(targets[0].proc.pid)
    try:
        _progress_then_kill(argv, command)
        time.sleep(1.5)  # the daemon's next progress lines go to the dead client
    finally:
        os.kill(targets[0].proc.pid, signal.SIGCONT)
    assert m.running, f"the daemon died with its {command} client\n{m.output()}"
    assert is_mounted(m.path)
    data = os.urandom(200_000)
    write_fsync(m.path / "after", data)
    assert (m.path / "after").read_bytes() == data
    again = cli(command, m.path, timeout=120)
    assert again.returncode == 0, describe(again)
    assert "clean" in again.stdout, describe(again)
    assert cli("verify", m.path).returncode == 0
    assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync", "in-sync"]


def test_a_sync_cut_short_by_the_end_of_the_mount_leaves_its_replica_to_a_full_comparison(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """The one thing that cancels a live sync is the end of its mount. Which of the chunks it
    found were sent is unknown then, so its replica is compared in full at the next mount
    (the other one, not being repaired, is not)."""
    pool = _replicated(work_dir, targets, "64M")
    m = mount_pool(pool)
    assert m.proc is not None and targets[0].proc is not None
    write_fsync(m.path / "f", os.urandom(100_000))
    stop_process(targets[0].proc.pid)  # the sync waits on replica 0's first checksums
    try:
        master, slave = pty.openpty()
        client = subprocess.Popen([*CLI, "sync", str(m.path)], cwd=REPO, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=slave, env=child_env())
        os.close(slave)
        seen = b""
        while b"sync [" not in seen:
            assert select.select([master], [], [], 60)[0], seen
            seen += os.read(master, 4096)
        os.kill(m.proc.pid, signal.SIGTERM)  # nothing open: the mount ends at once
        # The sync is cancelled (its asker's connection ends without an answer) while the
        # target still sleeps: the cut is certain, whatever the timing.
        assert client.wait(60) != 0
    finally:
        os.kill(targets[0].proc.pid, signal.SIGCONT)
        os.close(master)
    assert m.daemon is not None and m.daemon.wait(60) == 0, m.output()
    assert not is_mounted(m.path)
    assert_check_clean(pool)
    m.start()
    first, second = (r["last_resync"] for r in status_json(m.path)["replicas"])
    assert first["compared_chunks"] > 0 and second["compared_chunks"] == 0, (first, second)
    assert cli("verify", m.path).returncode == 0


def test_a_live_sync_that_fails_on_a_replica_has_it_compared_in_full_when_it_is_back(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """What a failed repair found differing is in no sync map: the replica's resync compares
    every chunk, instead of sending only what the barriers it missed wrote."""
    pool = _replicated(work_dir, targets, "64M")
    m = mount_pool(pool, options="pmem=force,min_replicas=1")
    doomed = targets[0]
    assert doomed.proc is not None
    write_fsync(m.path / "f", os.urandom(100_000))
    stop_process(doomed.proc.pid)
    client = subprocess.Popen([*CLI, "sync", str(m.path)], cwd=REPO, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    time.sleep(1.0)  # its comparison of replica 0 waits on the stopped target
    doomed.kill()  # the connection is reset: the repair fails
    out, err = client.communicate(timeout=60)
    assert client.returncode == 1 and "repair failed" in out, (out, err)
    again = doomed.respawn(log_path=work_dir / "target0-again.log")
    targets.append(again)
    again.start()

    def back() -> bool:
        r = status_json(m.path)["replicas"][0]
        return r["state"] == "in-sync" and r["resyncs"] >= 2

    assert wait_until(back, 60), status_json(m.path)["replicas"][0]
    resync = status_json(m.path)["replicas"][0]["last_resync"]
    assert resync["compared_chunks"] > 0, resync
    assert cli("verify", m.path).returncode == 0


def test_garbage_on_the_control_socket_harms_no_daemon(make_pool: MakePool, mount_pool: MountPool) -> None:
    import socket

    from rpmemfs.mountd.control import socket_path

    m = mount_pool(make_pool("16M"))
    path = socket_path(str(m.path))
    for request in (b"\xff\xfe\x00\n", b"", b"verify notanumber\n", b"status" * 1000, b"sync"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            if request:
                try:
                    s.sendall(request)
                except OSError:
                    pass
            # and gone, without reading the answer
    write_fsync(m.path / "f", b"still here")
    assert m.running and status_json(m.path)["pool"] == str(m.pool)


# ------------------------------------------------------------------ rpmemfs umount


def test_rpmemfs_umount_returns_once_the_daemon_has_closed_the_pool_clean(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = _replicated(work_dir, targets, "64M")
    m = mount_pool(pool)
    synced = os.urandom(500_000)
    write_fsync(m.path / "synced", synced)
    unsynced = os.urandom(300_000)
    (m.path / "unsynced").write_bytes(unsynced)  # made durable by the unmount itself
    assert m.proc is not None
    res = cli("umount", m.path)
    assert res.returncode == 0, describe(res)
    assert res.stderr == "" and res.stdout == "", describe(res)
    # Returned: the daemon has exited already (no waiting here), the mount is gone, the pool
    # is closed clean and its replicas hold all of it.
    assert m.proc.poll() == 0, f"daemon still running (or failed) after rpmemfs umount\n{m.output()}"
    assert not is_mounted(m.path)
    assert_check_clean(pool)
    assert _syncmap_reliable(pool), "the sync map says the mount did not end clean"
    for t in targets:
        assert pool_content(replica_file(t)) == pool_content(pool)
    m.start()
    assert "was not unmounted cleanly" not in m.output()
    for r in status_json(m.path)["replicas"]:
        # The sync map was trusted: nothing compared, nothing sent.
        assert r["state"] == "in-sync", r
        assert r["last_resync"]["compared_chunks"] == r["last_resync"]["bytes_sent"] == 0, r
    assert (m.path / "synced").read_bytes() == synced
    assert (m.path / "unsynced").read_bytes() == unsynced


def test_rpmemfs_umount_of_a_busy_mount_says_so_and_leaves_it_mounted(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("16M"))
    with open(m.path / "open", "wb") as f:
        res = cli("umount", m.path)
        assert_clean_error(res, r"busy.*stays mounted", one_line=True)
        assert m.running and is_mounted(m.path)
        f.write(b"still served")
        f.flush()
        os.fsync(f.fileno())
    res = cli("umount", m.path)
    assert res.returncode == 0, describe(res)
    assert m.proc is not None and m.proc.poll() == 0
    assert_check_clean(m.pool)
    m.start()
    assert (m.path / "open").read_bytes() == b"still served"


def test_rpmemfs_umount_refuses_what_it_cannot_unmount(work_dir: Path, make_pool: MakePool,
                                                       mount_pool: MountPool) -> None:
    assert_clean_error(cli("umount", work_dir), "not a mount point", one_line=True)
    assert_clean_error(cli("umount", "/dev/shm"), r"not an rpmemfs mount \(it is tmpfs\)", one_line=True)
    assert is_mounted("/dev/shm")
    m = mount_pool(make_pool("16M"))
    assert m.proc is not None
    stop_process(m.proc.pid)  # alive, but not answering (and not to be stat'ed here meanwhile)
    try:
        res = cli("umount", m.path, "--timeout", "2")
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
    assert_clean_error(res, r"does not answer.*stays mounted", one_line=True)
    # The request reaches the daemon once it runs again: its asker is gone, so it stays.
    time.sleep(0.5)
    assert is_mounted(m.path) and m.running
    write_fsync(m.path / "f", b"after the pause")
    # A daemon that died (kill -9): the mount is detached, and the pool said not to be clean.
    m.kill_daemon()
    res = cli("umount", m.path)
    assert_clean_error(res, r"had died.*unmounted now.*not\s+closed clean", one_line=True)
    assert not is_mounted(m.path)
    m.start()
    assert (m.path / "f").read_bytes() == b"after the pause"


def test_the_next_mount_clears_a_dead_mount_of_its_pool_and_status_names_it(
        work_dir: Path, make_pool: MakePool, mount_pool: MountPool) -> None:
    pool, other = make_pool("16M"), make_pool("16M")
    m = mount_pool(pool)
    write_fsync(m.path / "f", b"before the crash")
    m.kill_daemon()  # kill -9: its dead FUSE mount stays on the directory
    assert is_mounted(m.path)
    point = re.escape(os.path.realpath(m.path))
    dead = rf"{point} is a dead mount of pool {re.escape(str(pool))} \(its daemon has died\)"
    status = cli("status", m.path)
    assert_clean_error(status, rf"{dead}.*rpmemfs umount {point}", one_line=True)
    assert status.returncode == 3, describe(status)
    # Nothing has the pool open any more: check reads it, and points there from the mount.
    assert_clean_error(cli("check", m.path), rf"{dead}.*rpmemfs check {re.escape(str(pool))}",
                       one_line=True)
    assert cli("check", pool).returncode == 0
    # Another pool is not mounted over it: what is there is named, and what to run.
    res = cli("mount", other, m.path, "-o", "pmem=force")
    assert_clean_error(res, rf"{dead}.*rpmemfs umount {point}", one_line=True)
    assert is_mounted(m.path)
    assert_clean_error(cli("mount", pool, work_dir / "nowhere", "-o", "pmem=force"),
                       r"mountpoint \S*nowhere does not exist", one_line=True)
    # Its own pool clears it and mounts there: the log replayed, nothing fsync'ed lost.
    res = cli("mount", pool, m.path, "-o", "pmem=force")
    assert res.returncode == 0, describe(res)
    assert re.search(r"cleared the dead mount", res.stderr), describe(res)
    try:
        assert (m.path / "f").read_bytes() == b"before the crash"
        assert status_json(m.path)["health"] == "healthy"
    finally:
        res = cli("umount", m.path)
    assert res.returncode == 0, describe(res)
    assert not is_mounted(m.path)
    assert_check_clean(pool)


def test_commands_for_a_mount_name_a_dead_one_and_what_clears_it(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    """flush, verify, sync and replica add/remove on a mount whose daemon was killed say what
    status says (a dead mount of the pool, and what takes it away), not "no daemon answers"
    nor "not a mount point"."""
    pool = make_pool("16M")
    m = mount_pool(pool)
    m.kill_daemon()
    assert is_mounted(m.path)
    point = re.escape(os.path.realpath(m.path))
    dead = rf"{point} is a dead mount of pool {re.escape(str(pool))} \(its daemon has died\)"
    for argv in (["flush", m.path], ["verify", m.path], ["sync", m.path],
                 ["replica", "add", m.path, "127.0.0.1:7/app"],
                 ["replica", "remove", m.path, "127.0.0.1:7/app"]):
        res = cli(*argv)
        assert_clean_error(res, rf"{dead}.*rpmemfs umount {point}", one_line=True)
        assert res.returncode == 1, describe(res)
    res = cli("umount", m.path)
    assert_clean_error(res, r"had died.*unmounted now", one_line=True)
    assert not is_mounted(m.path)


def test_the_umount_helper_waits_for_the_daemon_and_leaves_lazy_unmounts_to_umount(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    env = dict(os.environ, RPMEMFS_BIN=RPMEMFS_BIN)
    m = mount_pool(make_pool("16M"))
    write_fsync(m.path / "f", b"through the helper")
    # What umount(8) runs for `umount DIR` of a fuse.rpmemfs mount.
    res = subprocess.run([str(UMOUNT_HELPER), str(m.path), "-t", "fuse.rpmemfs"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, describe(res)
    assert m.proc is not None and m.proc.poll() == 0
    assert_check_clean(m.pool)
    # `umount -l DIR`: detached at once, with a file still open; the daemon ends at its close.
    m.start()
    with open(m.path / "f", "rb") as f:
        res = subprocess.run([str(UMOUNT_HELPER), str(m.path), "-l"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, describe(res)
        assert not is_mounted(m.path)
        assert f.read() == b"through the helper"
        assert m.running
    assert m.daemon is not None and m.daemon.wait(60) == 0
    assert_check_clean(m.pool)


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs root")
def test_a_copy_of_the_mount_in_another_namespace_is_served_while_a_file_is_open_there(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    """A mount namespace made while the pool is mounted (a container, `ip netns exec`) holds a
    copy of the mount that our unmount does not remove. The daemon serves the file open there
    until it is closed, then stops though the copy is still there."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    m = mount_pool(make_pool("16M"))
    write_fsync(m.path / "f", b"seen from another namespace")
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"exec 3< {m.path}/f; echo open; read x; cat <&3; exec 3<&-; echo; echo closed; read y"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "open\n"
        umount = subprocess.Popen([*CLI, "umount", str(m.path)], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=child_env())
        assert wait_until(lambda: not is_mounted(m.path), 30)  # gone here at once...
        time.sleep(1.0)
        assert umount.poll() is None and m.running  # ...and still served there
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "seen from another namespace\n"
        assert holder.stdout.readline() == "closed\n"
        # The copy is still mounted there, nothing is open on it: the daemon is done.
        out, err = umount.communicate(timeout=60)
        assert umount.returncode == 0, (out, err)
        assert m.proc is not None and m.proc.poll() == 0
        assert "kernel still holds it" in m.output()
    finally:
        holder.kill()
        holder.wait()
    assert_check_clean(m.pool)


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs root")
def test_umount8_waits_through_the_installed_helper(work_dir: Path, make_pool: MakePool) -> None:
    """`umount DIR` itself, with the helper installed as scripts/install.sh --system does -- in
    a private mount namespace whose /usr/sbin is a copy, so nothing else on this machine (other
    tests' umount calls) sees it. umount(8) reaches it as umount.fuse.rpmemfs from the mount
    table (a relative DIR) and as umount.fuse from statfs(2) (an absolute one); another FUSE
    filesystem reaching umount.fuse is unmounted as without the helper."""
    if shutil.which("unshare") is None or shutil.which("findmnt") is None:
        pytest.skip("unshare(1) or findmnt(8) is not installed")
    sbin = work_dir / "sbin"
    sbin.mkdir()
    real = Path("/sbin").resolve()
    for entry in real.iterdir():
        (sbin / entry.name).symlink_to(entry)
    calls = work_dir / "helper-calls"
    for name in ("umount.fuse.rpmemfs", "umount.fuse"):
        helper = sbin / name
        if helper.is_symlink():
            helper.unlink()
        # The helper as installed, and a note of each call.
        helper.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexec {UMOUNT_HELPER} "$@"\n')
        helper.chmod(0o755)
    pool = make_pool("16M")
    mnt, src, other = work_dir / "mnt", work_dir / "src", work_dir / "other"
    for d in (mnt, src, other):
        d.mkdir()
    passthrough = " ".join([sys.executable, "-m", "rpmemfs.tools.bench.passthrough", str(src), str(other)])
    script = textwrap.dedent(f"""\
        set -e
        mount --bind {sbin} {real}
        n=0
        for dir in {mnt} mnt; do
            n=$((n + 1))
            {RPMEMFS_BIN} mount {pool} {mnt} -o pmem=force
            printf "through umount(8) $n" > {mnt}/f$n
            {RPMEMFS_BIN} status {mnt} --json > {work_dir}/status$n.json
            umount "$dir"
            echo "umount $dir returned $?"
        done
        {passthrough} &
        while ! findmnt -M {other} > /dev/null; do sleep 0.05; done
        umount {other}
        echo "umount {other} returned $?"
        wait
        """)
    env = dict(os.environ, RPMEMFS_BIN=RPMEMFS_BIN, PYTHONPATH=str(REPO))
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         cwd=work_dir, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, describe(res)
    assert res.stdout.count("returned 0") == 3, describe(res)
    assert calls.read_text().splitlines() == [
        f"umount.fuse {mnt} -n", f"umount.fuse.rpmemfs {mnt}", f"umount.fuse {other} -n"], describe(res)
    for n in (1, 2):
        pid = json.loads((work_dir / f"status{n}.json").read_text())["pid"]
        assert _exited(pid), f"umount(8) returned before daemon {pid} had exited"
    report = assert_check_clean(pool)
    assert report["stats"]["files"] == 2, report


# ------------------------------------------------------------------ SIGTERM, busy

WRITER = textwrap.dedent("""\
    import os, select, sys
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    i = 0
    try:
        while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes stdin
            record = (b"%08d" % i) * (RECORD // 8)
            os.write(fd, record)
            os.fsync(fd)
            print(i, flush=True)
            i += 1
    except OSError as e:
        print("error", e.errno, e, flush=True)
        sys.exit(1)
    os.close(fd)
    print("closed", flush=True)
    """).replace("RECORD", str(RECORD))


def test_sigterm_on_a_busy_mount_serves_open_files_until_closed_then_closes_clean(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = _replicated(work_dir, targets, "64M")
    m = mount_pool(pool)
    assert m.proc is not None
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(m.path / "log")], cwd="/",
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        assert writer.stdout is not None
        for line in writer.stdout:
            lines.append(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: len(lines) >= 20, 60), lines[-3:]
        os.kill(m.proc.pid, signal.SIGTERM)
        assert wait_until(lambda: not is_mounted(m.path), 30), "SIGTERM did not detach the mount"
        at_detach, detached = len(lines), time.monotonic()
        # The writer goes on: every write and fsync succeeds, and the daemon serves it.
        assert wait_until(lambda: (len(lines) >= at_detach + 100 and time.monotonic() > detached + 2)
                          or writer.poll() is not None, 60)
        assert writer.poll() is None, lines[-3:]
        assert m.running
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
    assert writer.wait(60) == 0, lines[-3:]
    reader.join(10)
    assert lines[-1] == "closed" and not any(ln.startswith("error") for ln in lines), lines[-3:]
    acked = int(lines[-2])
    # The last file closed: the daemon runs its last durability point and exits.
    assert m.daemon is not None and m.daemon.wait(30) == 0, m.output()
    assert "still open there are served until they are closed (SIGTERM again stops now)" in m.output()
    assert "is detached; 1 file or directory still open there" in m.output(), m.output()
    assert_check_clean(pool)
    assert _syncmap_reliable(pool)
    m.start()
    data = (m.path / "log").read_bytes()
    assert len(data) >= (acked + 1) * RECORD
    for i in range(acked + 1):
        assert data[i * RECORD : (i + 1) * RECORD] == (b"%08d" % i) * (RECORD // 8), f"record {i}"


def test_a_second_sigterm_stops_at_once_and_still_closes_the_pool_clean(
        make_pool: MakePool, mount_pool: MountPool) -> None:
    m: Mount = mount_pool(make_pool("16M"))
    assert m.proc is not None
    fd = os.open(m.path / "held", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x")
        os.fsync(fd)
        os.kill(m.proc.pid, signal.SIGTERM)
        assert wait_until(lambda: not is_mounted(m.path), 30)
        os.write(fd, b"y")
        os.fsync(fd)
        assert m.running
        os.kill(m.proc.pid, signal.SIGTERM)
        assert m.daemon is not None and m.daemon.wait(30) == 0, m.output()
        with pytest.raises(OSError) as exc:
            os.write(fd, b"z")
        assert exc.value.errno == errno.ENOTCONN
    finally:
        with contextlib.suppress(OSError):  # its flush gets ENOTCONN too; it is closed anyway
            os.close(fd)
    assert_check_clean(m.pool)
    m.start()
    assert (m.path / "held").read_bytes() == b"xy"
