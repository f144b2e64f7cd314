"""The `rpmemfs` command line: mkfs, mount, status, check; global options, dispatch and errors."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from helpers import (
    CLI,
    REPO,
    MiB,
    assert_check_clean,
    assert_clean_error,
    check_json,
    cli,
    cpu_seconds,
    cpu_wanted,
    describe,
    fsync_path,
    is_mounted,
    mkfs_replicated,
    pin_process,
    replica_file,
    wait_until,
    write_fsync,
)

from rpmemfs.tools.processes import TargetProcess, detach

if TYPE_CHECKING:
    from conftest import MakePool, MountPool


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- mkfs


def test_mkfs_creates_a_clean_pool(work_dir: Path) -> None:
    pool = work_dir / "p.img"
    res = cli("mkfs", pool, "--size", "64M")
    assert res.returncode == 0, describe(res)
    assert pool.stat().st_size == 64 * MiB
    report = assert_check_clean(pool)
    assert report["pool"] in (str(pool), os.path.abspath(pool))
    data = report["layout"]["data"]
    assert data["block_size"] == 4096
    assert data["blocks"] * 4096 <= 64 * MiB
    assert data["blocks"] * 4096 >= 48 * MiB


@pytest.mark.parametrize("size,nbytes", [("4M", 4 * MiB), ("8m", 8 * MiB), ("1G", 1 << 30)])
def test_mkfs_sizes(work_dir: Path, size: str, nbytes: int) -> None:
    pool = work_dir / "p.img"
    res = cli("mkfs", pool, "--size", size)
    assert res.returncode == 0, describe(res)
    assert pool.stat().st_size == nbytes
    assert_check_clean(pool)


def test_mkfs_refuses_existing_file(work_dir: Path) -> None:
    pool = work_dir / "p.img"
    pool.write_bytes(b"precious data")
    res = cli("mkfs", pool, "--size", "16M")
    assert_clean_error(res, r"exist|force", one_line=True)
    assert pool.read_bytes() == b"precious data"
    # an existing pool is not overwritten either
    pool2 = work_dir / "p2.img"
    assert cli("mkfs", pool2, "--size", "8M").returncode == 0
    before = digest(pool2)
    assert_clean_error(cli("mkfs", pool2, "--size", "16M"), r"exist|force", one_line=True)
    assert digest(pool2) == before


def test_mkfs_force_overwrites(work_dir: Path, mount_pool: MountPool) -> None:
    pool = work_dir / "p.img"
    pool.write_bytes(b"junk" * 1000)
    res = cli("mkfs", pool, "--size", "16M", "--force")
    assert res.returncode == 0, describe(res)
    assert pool.stat().st_size == 16 * MiB
    assert_check_clean(pool)
    m = mount_pool(pool)
    (m.path / "f").write_bytes(b"data")
    m.unmount()
    # --force over a used pool gives an empty filesystem
    res = cli("mkfs", pool, "--size", "8M", "--force")
    assert res.returncode == 0, describe(res)
    assert pool.stat().st_size == 8 * MiB
    m.start()
    assert os.listdir(m.path) == []


def test_mkfs_refuses_too_small(work_dir: Path) -> None:
    pool = work_dir / "p.img"
    for size in ("1M", "4095K", "100"):
        res = cli("mkfs", pool, "--size", size)
        assert_clean_error(res, r"minimum|small|at least|4M|4 ?MiB", one_line=True)
        assert not pool.exists(), f"mkfs --size {size} left a file behind"


@pytest.mark.parametrize("size", ["abc", "12Q", "-5M", "", "M", "1.2.3G", "4M5", "0"])
def test_mkfs_refuses_bad_size(work_dir: Path, size: str) -> None:
    pool = work_dir / "p.img"
    res = cli("mkfs", pool, f"--size={size}")
    assert_clean_error(res, r"size", one_line=True)
    assert not pool.exists()


def test_mkfs_checks_free_space(work_dir: Path) -> None:
    pool = work_dir / "huge.img"
    res = cli("mkfs", pool, "--size", "100T")
    assert_clean_error(res, r"space|free|available", one_line=True)
    assert not pool.exists(), "mkfs left a file behind after refusing"


def test_mkfs_missing_directory(work_dir: Path) -> None:
    res = cli("mkfs", work_dir / "no" / "such" / "dir" / "p.img", "--size", "8M")
    assert_clean_error(res, one_line=True)


# ---------------------------------------------------------------------------- check


def test_check_clean_pool(make_pool: MakePool, mount_pool: MountPool) -> None:
    pool = make_pool("16M")
    res = cli("check", pool)
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr
    m = mount_pool(pool)
    for i in range(20):
        (m.path / f"f{i}").write_bytes(os.urandom(10_000))
    os.mkdir(m.path / "d")
    os.symlink("f1", m.path / "d" / "l")
    m.unmount()
    rc, report = check_json(pool)
    assert rc == 0, report
    assert report["clean"] is True and report["problems"] == []
    assert isinstance(report.get("stats"), dict)
    areas = report["layout"]["log_areas"]
    assert len(areas) >= 2 and sum(a["active"] for a in areas) == 1
    for a in areas:
        assert {"offset", "size", "gen", "active"} <= set(a)


def test_check_missing_pool(work_dir: Path) -> None:
    assert_clean_error(cli("check", work_dir / "nope.img"), r"nope\.img does not exist",
                       one_line=True)
    assert_clean_error(cli("check", work_dir), r"is a directory, not a pool file", one_line=True)


def test_check_refuses_a_pool_a_process_has_open_and_says_what_to_run(
    work_dir: Path, make_pool: MakePool, mount_pool: MountPool, targets: list[TargetProcess]
) -> None:
    """A pool being written is no consistent image to check (a record half stored looks
    damaged): check names the mount and its daemon, or the target daemon serving a replica,
    instead of reporting damage that is not there."""
    pool = work_dir / "app.pool"
    mkfs_replicated(pool, targets[:1], size="16M")
    m = mount_pool(pool)
    assert m.proc is not None
    point = re.escape(os.path.realpath(m.path))
    poolset = work_dir / "app.set"
    poolset.write_text(f"PMEMPOOLSET\n16M {pool}\nREPLICA {targets[0].address} app\n")
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            write_fsync(m.path / f"w{i % 8}", os.urandom(20_000))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        direct, via_set, at_mount, replica = (cli("check", p) for p in (
            pool, poolset, m.path, replica_file(targets[0])))
    finally:
        stop.set()
        t.join()
    mounted = (rf"{re.escape(str(pool))} is mounted at {point} \(its daemon is pid {m.proc.pid}\)"
               rf".*rpmemfs verify {point}.*rpmemfs umount {point}")
    assert_clean_error(direct, mounted, one_line=True)
    assert_clean_error(via_set, mounted, one_line=True)
    assert_clean_error(at_mount, rf"{point} is a mount point \(of pool {re.escape(str(pool))}\).*"
                       rf"rpmemfs verify {point}", one_line=True)
    assert_clean_error(replica, rf"open in the target daemon pid {targets[0].pid} .*serves it "
                       "as a replica", one_line=True)
    assert direct.returncode == via_set.returncode == at_mount.returncode == 1
    m.unmount()
    assert_check_clean(pool)


# ---------------------------------------------------------------------------- mount


def test_mount_missing_pool(work_dir: Path) -> None:
    mnt = work_dir / "mnt"
    mnt.mkdir()
    res = cli("mount", work_dir / "nope.img", mnt, "-f", "-o", "pmem=force", timeout=60)
    assert_clean_error(res, r"nope\.img|exist|no such")
    assert not is_mounted(mnt)


def test_mount_missing_mountpoint(make_pool: MakePool, work_dir: Path) -> None:
    pool = make_pool("8M")
    res = cli("mount", pool, work_dir / "no-mnt", "-f", "-o", "pmem=force", timeout=60)
    assert_clean_error(res, r"no-mnt|mount ?point|exist|director")
    assert_check_clean(pool)


def test_mount_bad_option(make_pool: MakePool, work_dir: Path) -> None:
    pool = make_pool("8M")
    mnt = work_dir / "mnt"
    mnt.mkdir()
    res = cli("mount", pool, mnt, "-f", "-o", "pmem=bogus", timeout=60)
    assert_clean_error(res, r"pmem")
    assert not is_mounted(mnt)


def test_mount_twice_refused(make_pool: MakePool, mount_pool: MountPool, work_dir: Path) -> None:
    pool = make_pool("8M")
    m = mount_pool(pool)
    other = work_dir / "other"
    other.mkdir()
    # the same mountpoint again
    res = cli("mount", make_pool("8M"), m.path, "-f", "-o", "pmem=force", timeout=60)
    assert_clean_error(res)
    (m.path / "still-works").write_bytes(b"yes")
    assert (m.path / "still-works").read_bytes() == b"yes"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_signal_unmounts_cleanly(
    make_pool: MakePool, mount_pool: MountPool, sig: signal.Signals
) -> None:
    m = mount_pool(make_pool("16M"))
    (m.path / "f").write_bytes(b"before signal")
    m.unmount(sig)  # asserts exit 0, no mount left, no traceback
    assert not is_mounted(m.path)
    assert os.listdir(m.path) == []
    assert_check_clean(m.pool)
    m.start()
    assert (m.path / "f").read_bytes() == b"before signal"


def test_background_mount(make_pool: MakePool, work_dir: Path) -> None:
    """Without -f the command returns 0 once mounted and the daemon keeps serving."""
    pool = make_pool("16M")
    mnt = work_dir / "bg"
    mnt.mkdir()
    out = work_dir / "bg-mount.out"
    try:
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                [*CLI, "mount", str(pool), str(mnt), "-o", "pmem=force"],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
            )
            rc = proc.wait(timeout=60)
        text = out.read_text(errors="replace")
        assert rc == 0, text
        assert "Traceback" not in text
        assert is_mounted(mnt) and os.path.ismount(mnt), "not mounted when mount returned"
        (mnt / "bg-file").write_bytes(b"served by the daemon")
        fsync_path(mnt / "bg-file")
        assert (mnt / "bg-file").read_bytes() == b"served by the daemon"
        st = cli("status", mnt, "--json")
        assert st.returncode == 0, describe(st)
        pid = json.loads(st.stdout).get("pid")
        res = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == 0, res.stderr
        assert wait_until(lambda: not is_mounted(mnt))
        if isinstance(pid, int):
            assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 30), (
                "daemon still running after its filesystem was unmounted"
            )
        assert wait_until(lambda: cli("check", pool).returncode == 0, 30), describe(
            cli("check", pool))
    finally:
        if is_mounted(mnt):
            detach(mnt)
    # the file is there when mounted again (foreground this time)
    proc = subprocess.Popen([*CLI, "mount", str(pool), str(mnt), "-f", "-o", "pmem=force"],
                            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: is_mounted(mnt) and os.path.ismount(mnt), 30)
        assert (mnt / "bg-file").read_bytes() == b"served by the daemon"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert not is_mounted(mnt)


def test_background_mount_failure_reports(work_dir: Path) -> None:
    mnt = work_dir / "bg"
    mnt.mkdir()
    junk = work_dir / "junk.img"
    junk.write_bytes(b"\0" * (8 * MiB))
    out = work_dir / "bg.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([*CLI, "mount", str(junk), str(mnt), "-o", "pmem=force"],
                                cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=f)
        rc = proc.wait(timeout=60)
    text = out.read_text(errors="replace")
    assert rc != 0, text
    assert "Traceback" not in text, text
    assert any(ln.startswith("rpmemfs:") for ln in text.splitlines()), text
    assert not is_mounted(mnt)


# --------------------------------------------------------------------------- status


def status(mnt: Path) -> dict[str, object]:
    res = cli("status", mnt, "--json")
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr
    st = json.loads(res.stdout)
    assert isinstance(st, dict)
    return st


def test_status_json(make_pool: MakePool, mount_pool: MountPool) -> None:
    pool = make_pool("32M")
    m = mount_pool(pool)
    st = status(m.path)
    for key in ("pool", "size", "used", "pmem_mode", "fsync_count", "fsync_latency_us"):
        assert key in st, f"status lacks {key}: {st}"
    assert st["pool"] in (str(pool), os.path.realpath(pool))
    assert st["size"] == 32 * MiB
    assert st["pmem_mode"] == "force"
    assert isinstance(st["used"], int) and 0 <= st["used"] <= st["size"]
    lat = st["fsync_latency_us"]
    assert isinstance(lat, dict) and {"p50", "p99"} <= set(lat)
    count0 = st["fsync_count"]
    assert isinstance(count0, int)
    used0 = st["used"]

    fd = os.open(m.path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for i in range(25):
            os.write(fd, os.urandom(64 * 1024))
            if i % 2:
                os.fsync(fd)
            else:
                os.fdatasync(fd)
    finally:
        os.close(fd)
    st2 = status(m.path)
    assert isinstance(st2["fsync_count"], int) and st2["fsync_count"] >= count0 + 25
    assert isinstance(st2["used"], int) and st2["used"] >= used0 + 25 * 64 * 1024
    lat2 = st2["fsync_latency_us"]
    assert isinstance(lat2, dict)
    assert 0 <= lat2["p50"] <= lat2["p99"]
    assert lat2["p99"] > 0

    text = cli("status", m.path)
    assert text.returncode == 0, describe(text)
    assert str(pool) in text.stdout or os.path.realpath(pool) in text.stdout


def test_a_status_that_is_only_an_error_is_not_healthy(make_pool: MakePool, mount_pool: MountPool
                                                      ) -> None:
    """A daemon that answers status with an error alone (a bug behind its handler, a daemon of
    another version) tells nothing of the pool's health: unknown (3), the error said, and
    --json never says healthy. The mount's control socket is answered by a stand-in here."""
    from rpmemfs.mountd import control

    m = mount_pool(make_pool("16M"))
    real = control.socket_path(str(m.path))
    aside = real + ".aside"
    os.rename(real, aside)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as fake:
            fake.bind(real)
            fake.listen()
            fake.settimeout(60)

            def answer() -> None:
                for _ in range(2):
                    try:
                        conn, _ = fake.accept()
                    except OSError:
                        return
                    with conn:
                        conn.recv(4096)
                        conn.sendall(b'{"error": "internal error in status: KeyError(\'x\')"}\n')

            threading.Thread(target=answer, daemon=True).start()
            js = cli("status", m.path, "--json")
            text = cli("status", m.path)
    finally:
        os.unlink(real)
        os.rename(aside, real)
    assert js.returncode == 3, describe(js)
    assert json.loads(js.stdout)["health"] == "unknown", describe(js)
    assert text.returncode == 3, describe(text)
    assert_clean_error(text, r"answered status with an error: internal error in status: KeyError",
                       one_line=True)
    assert "healthy" not in text.stdout + text.stderr, describe(text)


def test_status_msync_mode(make_pool: MakePool, mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("16M"), options="pmem=msync")
    assert status(m.path)["pmem_mode"] == "msync"
    (m.path / "f").write_bytes(b"msync mode data")
    fsync_path(m.path / "f")
    m.remount()
    assert (m.path / "f").read_bytes() == b"msync mode data"


@pytest.mark.parametrize("poll_us", [0, 2000])
def test_polling_budget(make_pool: MakePool, mount_pool: MountPool, poll_us: int) -> None:
    """-o poll_us=N: the daemon polls after requests only when N > 0, and says so."""
    m = mount_pool(make_pool("16M"), options=f"pmem=force,poll_us={poll_us}")
    fd = os.open(m.path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for i in range(20):
            os.pwrite(fd, b"%d" % i * 100, i * 4096)
            os.fsync(fd)
    finally:
        os.close(fd)
    st = status(m.path)
    assert st["poll_us"] == poll_us
    passes, yielded = st["poll_passes"], st["poll_yielded"]
    assert isinstance(passes, int) and isinstance(yielded, int)
    # A poll either ran its passes or gave way to another thread at once (a busy machine).
    assert (passes + yielded > 0) == (poll_us > 0), st
    m.remount()
    assert (m.path / "f").read_bytes()[19 * 4096:19 * 4096 + 3] == b"191"


def test_polling_stops_on_a_cpu_another_thread_wants(make_pool: MakePool, mount_pool: MountPool) -> None:
    """The daemon polls /dev/fuse after a request for poll_us, but not on a CPU another
    thread wants: a program that runs a moment between system calls preempts the poller,
    and that ends the poll (and the polls of the next requests)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: the daemon's loop's and everything else's")
    cpu, rest = cpus[0], cpus[1:]
    m = mount_pool(make_pool("16M"), options="pmem=force,poll_us=2000")
    assert m.proc is not None
    pid = m.proc.pid
    # The daemon's loop (its main thread) alone on its CPU: its other threads, and this
    # process sending the requests, would preempt it there themselves.
    pin_process(pid, *rest)
    pin_process(os.getpid(), *rest)
    os.sched_setaffinity(pid, {cpu})
    fd = os.open(m.path / "f", os.O_CREAT | os.O_WRONLY, 0o644)

    def polled(what: bytes) -> float:
        """The loop's CPU time over 0.5 s of a write every 3 ms: alone on its CPU it polls
        2 ms after each."""
        before = cpu_seconds(pid, pid)
        end = time.monotonic() + 0.5
        i = 0
        while time.monotonic() < end:
            os.pwrite(fd, what, 16 * (i % 100))
            time.sleep(0.003)
            i += 1
        return cpu_seconds(pid, pid) - before

    try:
        # A kernel thread on that CPU now and then ends a poll too, and two in a row stop the
        # polling for 50 ms: one window of four is enough.
        alone = [polled(b"alone") for _ in range(4)]
        assert max(alone) > 0.1, f"the daemon did not poll with its CPU idle ({alone}s of 0.5)"
        before = status(m.path)["poll_yielded"]
        with cpu_wanted(cpu):
            busy = polled(b"contended")
        # Its CPU time then is the ~160 requests' own (30-50 ms here, counted in 10 ms ticks),
        # not 2 ms of polling after each (over 300 ms): a bound between the two, and well
        # under what it polled alone.
        assert busy < min(0.1, max(alone) / 2), (
            f"the daemon used {busy:.3f}s of 0.5 on a CPU another thread wanted ({alone}s alone)")
        assert status(m.path)["poll_yielded"] > before  # type: ignore[operator]
    finally:
        os.close(fd)
        pin_process(os.getpid(), *cpus)


@pytest.mark.parametrize("value", ["abc", "-1", "1000001", ""])
def test_polling_budget_refused(make_pool: MakePool, work_dir: Path, value: str) -> None:
    pool = make_pool("8M")
    mnt = work_dir / "mnt"
    mnt.mkdir()
    res = cli("mount", pool, mnt, "-f", "-o", f"pmem=force,poll_us={value}", timeout=60)
    assert_clean_error(res, r"poll_us")
    assert not is_mounted(mnt)


def test_status_not_a_mount(work_dir: Path) -> None:
    res = cli("status", work_dir)
    assert_clean_error(res)


def _into_a_closed_pipe(*args: str | os.PathLike[str], unbuffered: bool
                        ) -> subprocess.CompletedProcess[str]:
    """`rpmemfs ARGS | head -0`, deterministically: the pipe's reading end is closed before
    the command starts. Unbuffered, its first print meets the closed pipe; buffered, its
    flush at exit does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([*CLI, *(os.fspath(a) for a in args)], cwd=REPO, env=env,
                             stdin=subprocess.DEVNULL, stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(write)
    res.stdout = ""  # nobody could read it
    return res


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_closed_stdout_is_no_error_of_the_pool(
        make_pool: MakePool, mount_pool: MountPool, targets: list[TargetProcess], unbuffered: bool
) -> None:
    """`rpmemfs status MNT | head -1`: nothing on stderr, and the status the command has
    anyway (status: the mount's health; pools: its pools' consistency)."""
    m = mount_pool(make_pool("16M"))
    for args, code in [(("status", m.path), 0), (("status", m.path, "--json"), 0),
                       (("pools", targets[0].address), 0), (("status", "/"), 3)]:
        res = _into_a_closed_pipe(*args, unbuffered=unbuffered)
        assert res.returncode == code, describe(res)
        if code == 0:
            assert res.stderr == "", describe(res)
        else:  # its own error still says why
            assert_clean_error(res, r"not an rpmemfs mount", one_line=True)


# ------------------------------------------------------- options, dispatch, errors

DEBUG = ("--log-level", "debug")


def _placed(where: str, command: list[str], option: tuple[str, ...] = DEBUG) -> list[str]:
    """``command`` with a global option before the command, right after its name, or last."""
    if where == "before":
        return [*option, *command]
    if where == "after":
        return [command[0], *option, *command[1:]]
    return [*command, *option]


@pytest.mark.parametrize("where", ["before", "after", "last"])
def test_global_option_before_or_after_the_command(make_pool: MakePool, work_dir: Path,
                                                   where: str) -> None:
    pool = make_pool("8M")
    res = cli(*_placed(where, ["check", str(pool)]))
    assert res.returncode == 0 and "clean" in res.stdout, describe(res)
    res = cli(*_placed(where, ["mkfs", str(work_dir / "new.img"), "--size", "8M"]))
    assert res.returncode == 0, describe(res)
    assert_check_clean(work_dir / "new.img")
    # An error of the command itself, not a usage error: the option was taken as global.
    assert_clean_error(cli(*_placed(where, ["status", str(work_dir)])), r"not a mount point",
                       one_line=True)


@pytest.mark.parametrize("command", ["soak", "bench", "target"])
@pytest.mark.parametrize("where", ["none", "before", "after"])
def test_commands_with_their_own_options_show_their_help(command: str, where: str) -> None:
    argv = [command, "--help"] if where == "none" else _placed(where, [command, "--help"])
    res = cli(*argv)
    assert res.returncode == 0, describe(res)
    assert res.stdout.startswith(f"usage: rpmemfs {command}"), describe(res)
    assert "Traceback" not in res.stderr, describe(res)


@pytest.mark.parametrize("where", ["before", "after", "last"])
def test_commands_with_their_own_options_get_them_in_order(where: str) -> None:
    """The global option is taken out wherever it stands, the rest reaches the command as
    given: each command below then refuses a value of its own option, in one line."""
    soak = cli(*_placed(where, ["soak", "--seconds", "0", "--writers", "1"]))
    assert_clean_error(soak, r"must be positive", one_line=True)
    assert soak.returncode == 2
    bench = cli(*_placed(where, ["bench", "--quick", "--only", "nosuch"]))
    assert_clean_error(bench, r"unknown workload.*nosuch", one_line=True)
    target = cli(*_placed(where, ["target", "--listen", "127.0.0.1:0", "--pool-dir", "/nonexistent"]))
    assert_clean_error(target, r"/nonexistent does not exist", one_line=True)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nosuch"],
        ["--bogus", "status", "/"],
        ["--log-level", "loud", "status", "/"],
        ["status", "/", "--log-level", "loud"],
        ["mkfs"],
        ["mkfs", "p.img", "--size", "8M", "--bogus"],
        ["mount", "p.img"],
        ["status"],
        ["status", "/", "--bogus"],
        ["check", "--bogus"],
        ["verify"],
        ["sync", "a", "b"],
        ["recover", "p.img"],
        ["demo"],
        ["demo", "d", "--size", "big"],
        ["target", "--bogus"],
        ["target", "--listen", "127.0.0.1:0"],
        ["bench", "--bogus"],
        ["bench", "--rounds", "0"],
        ["bench", "--micro", "--bogus"],
        ["soak", "--bogus"],
        ["soak", "--writers", "many"],
    ],
    ids=lambda argv: " ".join(argv) or "nothing",
)
def test_a_usage_error_is_one_line(work_dir: Path, argv: list[str]) -> None:
    res = cli(*argv)
    assert_clean_error(res, one_line=True)
    assert res.returncode == 2, describe(res)
    assert "usage:" not in res.stderr, describe(res)


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["mkfs", "p.img", "--size", "8M", "--replica", "bogus"],
         r"mkfs: argument --replica: bad replica 'bogus': expected"),
        (["recover", "/dev/shm/p.img", "--from", "nowhere"], r"argument --from: bad replica 'nowhere'"),
        (["promote", "/dev/shm/p.img", "--from", "h:1"], r"argument --from: bad replica 'h:1'"),
        (["replica", "add", "/", "nowhere"], r"bad replica 'nowhere'"),
        (["pools", "127.0.0.1"], r"pools: .*bad address '127.0.0.1': no port \(use HOST:PORT\)"),
        (["evict", "127.0.0.1:0", "app"], r"evict: .*'127.0.0.1:0': port 0 is not a target's port"),
        (["pools", "127.0.0.1:7420", "--timeout", "-1"],
         r"pools: argument --timeout: '-1' is not a positive number of seconds"),
        (["evict", "127.0.0.1:7420", "app", "--timeout", "0"], r"evict: argument --timeout: '0'"),
        (["status", "/", "--timeout", "-1"], r"status: argument --timeout: '-1'"),
        (["umount", "/", "--timeout", "never"], r"umount: argument --timeout: 'never'"),
        (["mkfs", "p.img", "--size", "junk"], r"mkfs: argument --size: bad size 'junk'"),
        (["grow", "p.img", "--size", "12Q"], r"grow: argument --size: bad size '12Q'"),
        (["verify", "/nonexistent.pool", "--chunk", "3"],
         r"verify: argument --chunk: '3' is not a multiple of 4K"),
        (["verify", "/nonexistent.pool", "--chunk", "1G"], r"verify: argument --chunk: '1G'.*at most 64M"),
        (["verify", "/nonexistent.pool", "--chunk", "x"], r"verify: argument --chunk: bad size 'x'"),
    ],
)
def test_a_value_that_cannot_be_right_is_a_usage_error(argv: list[str], pattern: str) -> None:
    """Status 2 (status and pools too: their 0-3 describe what they found, and a command line
    they cannot run found nothing), naming the option as written and nothing internal."""
    res = cli(*argv)
    assert_clean_error(res, pattern, one_line=True)
    assert res.returncode == 2, describe(res)
    assert "`" not in res.stderr, describe(res)  # trio's `seconds`, say


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["verify", "/nonexistent.pool"], r"neither a pool file nor a mount point"),
        (["check", "/nonexistent.pool"], r"does not exist"),
        (["mkfs", "/nonexistent/dir/p.img", "--size", "8M"], None),
        (["demo", "/proc/rpmemfs-demo"], None),
    ],
)
def test_a_command_error_is_one_line(argv: list[str], pattern: str | None) -> None:
    res = cli(*argv)
    assert_clean_error(res, pattern, one_line=True)
    assert res.returncode == 1, describe(res)


# What a command raises, seen at the CLI edge: `rpmemfs status` with its function replaced.
_EDGE = """
import sys
import rpmemfs.cli as cli
from rpmemfs.errors import RpmemfsError

def boom(args):
    raise {raise_}

cli.cmd_status = boom
sys.exit(cli.main(sys.argv[1:]))
"""


def _edge(raise_: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI[0], "-c", _EDGE.format(raise_=raise_), *argv, "status", "/"],
        cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize(
    "raise_",
    [
        "RpmemfsError('the pool is on fire')",
        "cli.CliError('the pool is on fire')",
        "ExceptionGroup('from a task', [RpmemfsError('the pool is on fire')])",
        "__import__('rpmemfs.pmem').pmem.PmemError('the pool is on fire')",
        "FileNotFoundError(2, 'the pool is on fire')",
    ],
)
def test_errors_reported_on_purpose_are_their_message(raise_: str) -> None:
    res = _edge(raise_)
    assert_clean_error(res, r"^rpmemfs: .*the pool is on fire$", one_line=True)
    assert res.returncode == 1
    assert "internal error" not in res.stderr, describe(res)


def test_an_internal_error_is_one_line_with_the_traceback_at_debug() -> None:
    res = _edge("ZeroDivisionError('a bug')")
    assert_clean_error(res, r"internal error: ZeroDivisionError: a bug", one_line=True)
    assert res.returncode == 1
    for where in (["--log-level", "debug"], ["--log-level=debug"]):
        res = _edge("ZeroDivisionError('a bug')", *where)
        assert res.returncode == 1, describe(res)
        assert "Traceback" in res.stderr and "in boom" in res.stderr, describe(res)
        assert res.stderr.splitlines()[-1].startswith("rpmemfs: internal error: "), describe(res)


def test_ctrl_c_is_status_130() -> None:
    res = _edge("KeyboardInterrupt()")
    assert res.returncode == 130, describe(res)
    assert "Traceback" not in res.stderr, describe(res)
