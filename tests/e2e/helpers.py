"""Shared helpers for the FUSE-level rpmemfs test suite.

Nothing here is a mock: `Mount` runs the real `rpmemfs mount` daemon in its own process,
everything else is ordinary syscalls and real programs.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import random
import re
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rpmemfs.mountinfo import is_mounted as is_mounted  # the tests ask helpers for it
from rpmemfs.tools.processes import MountProcess, SpawnError, TargetProcess, detach

REPO = Path(__file__).resolve().parents[2]
CLI: list[str] = [sys.executable, "-m", "rpmemfs.cli"]
MOUNT_TIMEOUT = 30.0
BLOCK = 4096
MiB = 1024 * 1024


# --------------------------------------------------------------------------- pytest


@pytest.fixture(autouse=bool(os.environ.get("RXE_VM")))
def collect_garbage_in_vm() -> Iterator[None]:
    """In the VM: collect each test's garbage right after it. Once in three runs, pyverbs
    objects (closed already) left in reference cycles until pytest's final collection
    crashed the interpreter there, after every test had passed; collecting per test has not
    crashed. Not understood yet (pyverbs 44 freeing dependents in dealloc order?).

    Here, not in a conftest, so that both the end-to-end tier (its test_lanes.py runs in the
    VM) and the verbs tier (tests/verbs) import it into theirs."""
    import gc

    yield
    gc.collect()


# --------------------------------------------------------------------------- CLI


def cli(*args: str | os.PathLike[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run `rpmemfs ARGS...` (the venv's copy) and capture its output."""
    return subprocess.run(
        [*CLI, *(os.fspath(a) for a in args)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def describe(res: subprocess.CompletedProcess[str]) -> str:
    cmd = " ".join(str(a) for a in res.args)
    return f"$ {cmd}\nexit {res.returncode}\n--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr}"


def assert_clean_error(
    res: subprocess.CompletedProcess[str], pattern: str | None = None, *, one_line: bool = False
) -> str:
    """The command failed the way the contract says: non-zero, `rpmemfs: ...`, no traceback."""
    assert res.returncode != 0, f"expected failure\n{describe(res)}"
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, describe(res)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert any(ln.startswith("rpmemfs:") for ln in lines), f"no 'rpmemfs: ...' line\n{describe(res)}"
    if one_line:
        assert len(lines) == 1, f"expected a one-line error\n{describe(res)}"
    if pattern is not None:
        assert re.search(pattern, res.stderr, re.IGNORECASE), (
            f"error message does not match /{pattern}/\n{describe(res)}"
        )
    return res.stderr


def mkfs(pool: Path, size: str = "64M", *extra: str) -> None:
    res = cli("mkfs", pool, "--size", size, *extra)
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr, describe(res)


def mkfs_replicated(pool: Path, targets: Sequence[TargetProcess], *extra: str, size: str = "64M") -> None:
    """`rpmemfs mkfs POOL` with a replica named "app" on each of the target daemons."""
    mkfs(pool, size, *extra, *(a for t in targets for a in ("--replica", f"{t.address}/app")))


def check_json(pool: Path) -> tuple[int, dict[str, Any]]:
    """`rpmemfs check POOL --json` -> (exit code, parsed report)."""
    res = cli("check", pool, "--json")
    assert "Traceback" not in res.stderr, describe(res)
    try:
        report = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"check --json did not print JSON ({exc})\n{describe(res)}") from exc
    assert isinstance(report, dict), describe(res)
    return res.returncode, report


def assert_check_clean(pool: Path) -> dict[str, Any]:
    res = cli("check", pool)
    assert res.returncode == 0, f"check is not clean\n{describe(res)}"
    assert "Traceback" not in res.stderr, describe(res)
    rc, report = check_json(pool)
    assert rc == 0 and report.get("clean") is True and report.get("problems") == [], report
    return report


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ mount state


def wait_until(pred: Callable[[], bool], timeout: float = 15.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def internal_error_in(text: str) -> bool:
    """Whether a daemon's output shows an internal error: a Python traceback, or the one line
    the CLI prints in its place (the traceback itself only at --log-level debug)."""
    return "Traceback" in text or "rpmemfs: internal error" in text


class Mount:
    """A real `rpmemfs mount POOL MNT -f` daemon process (processes.MountProcess), each start
    logging to a file of its own in ``log_dir``, with the test suite's assertions."""

    def __init__(
        self, pool: Path, path: Path, log_dir: Path, options: str = "pmem=force"
    ) -> None:
        self.pool = pool
        self.path = path
        self.log_dir = log_dir
        self.options = options
        self.daemon: MountProcess | None = None
        self.log: Path | None = None
        self.logs: list[Path] = []
        self.starts = 0
        self.path.mkdir(parents=True, exist_ok=True)

    # -- process control -------------------------------------------------------
    def argv(self) -> list[str]:
        return MountProcess.rpmemfs(self.pool, self.path, self.options).argv

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.daemon.proc if self.daemon is not None else None

    @property
    def running(self) -> bool:
        return self.daemon is not None and self.daemon.running

    def output(self) -> str:
        """Everything the current/last daemon wrote to stdout/stderr."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")

    def internal_errors(self) -> list[str]:
        """Daemon runs (current and earlier) whose output shows an internal error."""
        bad = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            if internal_error_in(text):
                bad.append(f"--- {log.name} ---\n{text[-6000:]}")
        return bad

    def _spawn(self) -> MountProcess:
        assert not self.running, "daemon already running"
        assert not is_mounted(self.path), f"{self.path} is already a mount point"
        self.starts += 1
        self.log = self.log_dir / f"{self.path.name}-daemon{self.starts}.log"
        self.logs.append(self.log)
        self.daemon = MountProcess.rpmemfs(self.pool, self.path, self.options, log_path=self.log)
        self.daemon.spawn()
        return self.daemon

    def start(self) -> None:
        daemon = self._spawn()
        try:
            daemon.wait_mounted(MOUNT_TIMEOUT)
        except SpawnError as exc:
            daemon.stop()
            raise AssertionError(f"{exc}\n$ {' '.join(daemon.argv)}") from None

    def start_expect_failure(self) -> str:
        """Start the daemon on a pool that must be refused; return its output."""
        daemon = self._spawn()
        rc = daemon.wait(MOUNT_TIMEOUT)
        if rc is None:
            mounted = is_mounted(self.path)
            out = self.output()
            self.cleanup()
            raise AssertionError(
                f"mount did not fail (still running after {MOUNT_TIMEOUT:.0f} s, "
                f"mounted={mounted})\n--- daemon output ---\n{out}"
            )
        out = self.output()
        assert rc != 0, f"mount exited 0 on a pool it should refuse\n{out}"
        assert not is_mounted(self.path), f"failed mount left {self.path} mounted\n{out}"
        assert not internal_error_in(out), f"internal error from mount\n{out}"
        assert any(ln.startswith("rpmemfs:") for ln in out.splitlines()), (
            f"no 'rpmemfs: ...' line from the failed mount\n{out}"
        )
        return out

    def unmount(self, sig: int = signal.SIGTERM) -> None:
        """Clean unmount: signal the daemon, expect exit 0, no mount left, no internal error."""
        assert self.daemon is not None and self.running, f"daemon not running\n{self.output()}"
        try:
            rc = self.daemon.unmount(sig, timeout=60)
        except SpawnError as exc:
            raise AssertionError(str(exc)) from None
        out = self.output()
        assert rc == 0, f"daemon exited with {rc} after signal {sig}\n{out}"
        assert not is_mounted(self.path), f"{self.path} still mounted after daemon exit\n{out}"
        assert not internal_error_in(out), f"internal error in daemon output\n{out}"

    def kill_daemon(self) -> None:
        """SIGKILL the daemon (the dead FUSE mount stays attached until detach())."""
        assert self.daemon is not None
        self.daemon.kill()

    def detach(self) -> None:
        assert detach(self.path), f"could not detach {self.path}"

    def kill9(self) -> None:
        self.kill_daemon()
        self.detach()

    def remount(self) -> None:
        if self.running:
            self.unmount()
        self.start()

    def cleanup(self) -> None:
        """Best effort, never raises: stop the daemon and detach the mount."""
        if self.daemon is not None:
            self.daemon.stop()
        else:
            detach(self.path)


# ------------------------------------------------------------------- tree tools


@dataclass(frozen=True)
class Entry:
    kind: str  # "file" | "dir" | "symlink"
    data: str  # sha256 of content, symlink target, or "" for dirs
    size: int
    mode: int = 0
    uid: int = 0
    gid: int = 0
    nlink: int = 0
    mtime_ns: int = 0
    link_group: str = ""  # first path (sorted) sharing this inode, for hard links
    xattrs: tuple[tuple[str, bytes], ...] = ()


def snapshot(root: Path, *, meta: bool = True) -> dict[str, Entry]:
    """Describe every entry below ROOT: content checksums, and with meta=True also
    permissions, owner, link counts, mtimes, hard-link groups and user.* xattrs."""
    out: dict[str, Entry] = {}
    first_by_ino: dict[int, str] = {}
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            paths.append(os.path.relpath(os.path.join(dirpath, name), root))
    for rel in sorted(paths):
        p = root / rel
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            kind, data, size = "symlink", os.readlink(p), st.st_size
        elif stat.S_ISDIR(st.st_mode):
            kind, data, size = "dir", "", 0
        elif stat.S_ISREG(st.st_mode):
            kind, data, size = "file", file_sha256(p), st.st_size
        else:
            kind, data, size = f"other:{stat.S_IFMT(st.st_mode):o}", "", 0
        if not meta:
            out[rel] = Entry(kind, data, size)
            continue
        group = ""
        if kind == "file":
            group = first_by_ino.setdefault(st.st_ino, rel)
        xattrs: tuple[tuple[str, bytes], ...] = ()
        if kind != "symlink":
            names = sorted(n for n in os.listxattr(p) if n.startswith("user."))
            xattrs = tuple((n, os.getxattr(p, n)) for n in names)
        out[rel] = Entry(
            kind,
            data,
            size,
            mode=st.st_mode,
            uid=st.st_uid,
            gid=st.st_gid,
            nlink=st.st_nlink,
            mtime_ns=st.st_mtime_ns if kind != "dir" else 0,
            link_group=group,
            xattrs=xattrs,
        )
    return out


def diff_snapshots(a: dict[str, Entry], b: dict[str, Entry], limit: int = 20) -> str:
    lines: list[str] = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            lines.append(f"{k}:\n   before {a.get(k)}\n   after  {b.get(k)}")
    more = f"\n... and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


def make_tree(root: Path, rng: random.Random, nfiles: int = 60, max_size: int = 200_000) -> None:
    """A nested tree of files with random content (some empty, some large), plus symlinks."""
    dirs = [root]
    root.mkdir(parents=True, exist_ok=True)
    for i in range(max(1, nfiles // 8)):
        d = rng.choice(dirs) / f"dir{i}"
        d.mkdir()
        dirs.append(d)
    for i in range(nfiles):
        d = rng.choice(dirs)
        r = rng.random()
        if r < 0.1:
            size = 0
        elif r < 0.6:
            size = rng.randrange(1, 5000)
        else:
            size = rng.randrange(5000, max_size)
        (d / f"file{i}.bin").write_bytes(rng.randbytes(size))
    for i in range(max(1, nfiles // 10)):
        d = rng.choice(dirs)
        os.symlink(f"../target-{i}", d / f"link{i}")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory below ROOT (and ROOT itself)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if not os.path.islink(p):
                fsync_path(p)
        fsync_path(Path(dirpath))


# ------------------------------------------------------------------ syscalls

_libc = ctypes.CDLL(None, use_errno=True)
SYS_renameat2 = 316  # x86_64
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(old: str | os.PathLike[str], new: str | os.PathLike[str], flags: int) -> None:
    res = _libc.syscall(
        ctypes.c_long(SYS_renameat2),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(old)),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(new)),
        ctypes.c_uint(flags),
    )
    if res != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(old), None, os.fspath(new))


# ------------------------------------------------------- self-describing data

STAMP_MAGIC = b"RPMB"
_STAMP = struct.Struct("<4sIQI")  # magic, file id, file offset of the block, version


def stamp_block(fid: int, off: int, ver: int) -> bytes:
    """4 KiB whose every 52-byte unit names its origin: (file id, file offset, version)."""
    head = _STAMP.pack(STAMP_MAGIC, fid, off, ver)
    unit = head + hashlib.sha256(head).digest()
    return (unit * (BLOCK // len(unit) + 1))[:BLOCK]


def stamp_data(fid: int, off: int, nblocks: int, ver: int) -> bytes:
    return b"".join(stamp_block(fid, off + i * BLOCK, ver) for i in range(nblocks))


def identify(chunk: bytes) -> str:
    """Best-effort description of where some bytes came from (for failure messages)."""
    if not any(chunk):
        return "all zeros"
    i = chunk.find(STAMP_MAGIC)
    if i >= 0 and i + _STAMP.size <= len(chunk):
        _m, fid, off, ver = _STAMP.unpack_from(chunk, i)
        return f"stamped data of file id {fid}, file offset {off}, version {ver} (found at +{i})"
    return f"unrecognised bytes {chunk[:32].hex()}..."


def pool_content(path: Path) -> bytes:
    """What replicas of a pool hold: the pool without its node-local sync map."""
    from rpmemfs.pool.layout import Header

    raw = path.read_bytes()
    return raw[: Header.decode(raw[:4096]).map_off]


def replica_file(target: Any, name: str = "app") -> Path:
    """The pool file ``name`` of a TargetProcess, in its --pool-dir."""
    argv = target.argv
    return Path(argv[argv.index("--pool-dir") + 1]) / name


def status_json(mnt: Path) -> dict[str, Any]:
    """The mount's status; its exit status says its health (0 healthy, 1 degraded, 2 failing)."""
    res = cli("status", mnt, "--json")
    assert res.returncode in (0, 1, 2), res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    assert ["healthy", "degraded", "failing"][res.returncode] == doc["health"], doc
    return doc


def write_fsync(path: Path, data: bytes) -> None:
    """Create or truncate ``path``, write ``data`` and fsync it."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- CPU contention


def stop_process(pid: int) -> None:
    """SIGSTOP, and wait until every thread of the process is stopped. Delivery is not
    immediate: the thread that takes the signal starts the group stop only when it next runs,
    and a busy machine may run another thread of the process for tens of milliseconds first
    (a target's lane thread kept acknowledging barriers meanwhile: test_async once saw four
    times max_lag acknowledged "past" a stopped replica)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        tasks = Path(f"/proc/{pid}/task")
        return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT" for t in tasks.iterdir())

    assert wait_until(stopped, timeout=10), f"process {pid} did not stop within 10 s of SIGSTOP"


def pin_process(pid: int, *cpus: int) -> None:
    """Every thread of ``pid`` (and the threads they start later) on ``cpus`` only."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User plus system CPU time ``pid`` (or its thread ``tid``) has used so far."""
    stat = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_wanted(cpu: int) -> Iterator[None]:
    """A process on ``cpu`` that runs for 20 us, sleeps for 50 and so on: what a program doing
    short requests looks like to the scheduler. A thread spinning on that CPU is preempted
    by it, though a yield rarely finds it runnable."""
    script = (f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n"
              "    t = time.perf_counter()\n    while time.perf_counter() - t < 2e-5:\n        pass\n"
              "    time.sleep(5e-5)\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(0.2)  # started and pinned
        yield
    finally:
        proc.kill()
        proc.wait()
