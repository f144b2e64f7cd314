"""Shared helpers for the FUSE-level rpmemfs test suite.

Nothing here is a mock: `Mount` runs the real `rpmemfs mount` daemon in its own process,
everything else is ordinary syscalls and real programs.
"""

from __future__ import annotations

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLI: list[str] = [sys.executable, "-m", "rpmemfs.cli"]
MOUNT_TIMEOUT = 30.0
BLOCK = 4096
MiB = 1024 * 1024


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


def _unescape_mountinfo(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether PATH is a mount point per /proc/self/mountinfo (true for dead FUSE mounts too)."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape_mountinfo(fields[4]) == target:
                return True
    return False


def mounts_under(root: str | os.PathLike[str]) -> list[str]:
    """Mount points at or below ROOT, deepest first."""
    base = os.path.realpath(root)
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                mp = _unescape_mountinfo(fields[4])
                if mp == base or mp.startswith(base + "/"):
                    found.append(mp)
    return sorted(found, key=len, reverse=True)


def wait_until(pred: Callable[[], bool], timeout: float = 15.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def fusermount_detach(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["fusermount3", "-u", "-z", os.fspath(path)],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


class Mount:
    """A real `rpmemfs mount POOL MNT -f` daemon process."""

    def __init__(
        self, pool: Path, path: Path, log_dir: Path, options: str = "pmem=force"
    ) -> None:
        self.pool = pool
        self.path = path
        self.log_dir = log_dir
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self.logs: list[Path] = []
        self.starts = 0
        self.path.mkdir(parents=True, exist_ok=True)

    # -- process control -------------------------------------------------------
    def argv(self) -> list[str]:
        argv = [*CLI, "mount", os.fspath(self.pool), os.fspath(self.path), "-f"]
        if self.options:
            argv += ["-o", self.options]
        return argv

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        """Everything the current/last daemon wrote to stdout/stderr."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")

    def internal_errors(self) -> list[str]:
        """Daemon runs (current and earlier) whose output shows a Python traceback."""
        bad = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            if "Traceback" in text:
                bad.append(f"--- {log.name} ---\n{text[-6000:]}")
        return bad

    def _spawn(self) -> subprocess.Popen[bytes]:
        assert not self.running, "daemon already running"
        assert not is_mounted(self.path), f"{self.path} is already a mount point"
        self.starts += 1
        self.log = self.log_dir / f"{self.path.name}-daemon{self.starts}.log"
        self.logs.append(self.log)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        return self.proc

    def start(self) -> None:
        proc = self._spawn()
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while True:
            rc = proc.poll()
            if rc is not None:
                raise AssertionError(
                    f"mount daemon exited with {rc} before {self.path} was mounted\n"
                    f"$ {' '.join(self.argv())}\n--- daemon output ---\n{self.output()}"
                )
            if is_mounted(self.path) and os.path.ismount(self.path):
                return
            if time.monotonic() > deadline:
                out = self.output()
                self.cleanup()
                raise AssertionError(
                    f"{self.path} not mounted {MOUNT_TIMEOUT:.0f} s after starting the daemon\n"
                    f"--- daemon output ---\n{out}"
                )
            time.sleep(0.05)

    def start_expect_failure(self) -> str:
        """Start the daemon on a pool that must be refused; return its output."""
        proc = self._spawn()
        try:
            rc = proc.wait(timeout=MOUNT_TIMEOUT)
        except subprocess.TimeoutExpired:
            mounted = is_mounted(self.path)
            out = self.output()
            self.cleanup()
            raise AssertionError(
                f"mount did not fail (still running after {MOUNT_TIMEOUT:.0f} s, "
                f"mounted={mounted})\n--- daemon output ---\n{out}"
            ) from None
        out = self.output()
        assert rc != 0, f"mount exited 0 on a pool it should refuse\n{out}"
        assert not is_mounted(self.path), f"failed mount left {self.path} mounted\n{out}"
        assert "Traceback" not in out, f"traceback from mount\n{out}"
        assert any(ln.startswith("rpmemfs:") for ln in out.splitlines()), (
            f"no 'rpmemfs: ...' line from the failed mount\n{out}"
        )
        return out

    def unmount(self, sig: int = signal.SIGTERM) -> None:
        """Clean unmount: signal the daemon, expect exit 0, no mount left, no traceback."""
        assert self.proc is not None and self.running, f"daemon not running\n{self.output()}"
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            out = self.output()
            self.cleanup()
            raise AssertionError(f"daemon did not exit 60 s after signal {sig}\n{out}") from None
        out = self.output()
        assert rc == 0, f"daemon exited with {rc} after signal {sig}\n{out}"
        assert not is_mounted(self.path), f"{self.path} still mounted after daemon exit\n{out}"
        assert "Traceback" not in out, f"traceback in daemon output\n{out}"

    def kill_daemon(self) -> None:
        """SIGKILL the daemon (the dead FUSE mount stays attached until detach())."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def detach(self) -> None:
        if is_mounted(self.path):
            res = fusermount_detach(self.path)
            assert res.returncode == 0, f"fusermount3 -u -z failed: {res.stderr}"
        assert not is_mounted(self.path)

    def kill9(self) -> None:
        self.kill_daemon()
        self.detach()

    def remount(self) -> None:
        if self.running:
            self.unmount()
        self.start()

    def cleanup(self) -> None:
        """Best effort, never raises: stop the daemon and detach the mount."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=15)
        except Exception:
            pass
        try:
            if is_mounted(self.path):
                fusermount_detach(self.path)
        except Exception:
            pass


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
    res = cli("status", mnt, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def write_fsync(path: Path, data: bytes) -> None:
    """Create or truncate ``path``, write ``data`` and fsync it."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
