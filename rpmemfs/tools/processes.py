"""Starting and stopping our own processes: target daemons, mounts, `rpmemfs` commands.

The tests, `rpmemfs demo`, `rpmemfs soak` and `rpmemfs bench` all bring up the same things
(target daemons on loopback, a pool mounted by a foreground `rpmemfs mount`) and must bring
them down again whatever happened in between; this module is where that is done, once.

- TargetProcess: `python -m rpmemfs.target` on a port of its choice; it is ready when it
  prints its listening line.
- MountProcess: a FUSE daemon in the foreground (`rpmemfs mount -f`, or the benchmark's
  pass-through); it is ready when the kernel lists the mount point and a stat of it answers,
  and a SIGTERM or SIGINT unmounts cleanly (exit 0): at once when no file is open there, else
  when the last one is closed, or at a second signal. kill() is SIGKILL, for crash tests: the
  dead mount stays attached until detach().
- detach(), unmount(), detach_all_under(): mounts whose daemon is gone or not ours; unmount()
  of an rpmemfs mount returns once its daemon has closed the pool and exited.

Every child runs this interpreter with this checkout first on its path (child_env), so the
venv's pyfuse3 and this rpmemfs are the ones used whatever the child's working directory.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import rpmemfs
from rpmemfs import safeopen
from rpmemfs.errors import RpmemfsError
from rpmemfs.mountd.unmount import kernel_path
from rpmemfs.mountinfo import is_mounted, mount_at, mounts_under

READY_PREFIX = "rpmemfs target listening on "
# The repository root (or site-packages), put first on a child's path.
PROJECT_ROOT = Path(rpmemfs.__file__).resolve().parent.parent
MOUNT_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
LOG_TAIL = 4000

PathLike = str | os.PathLike[str]


class SpawnError(RpmemfsError):
    """One of our processes (a target daemon, a mount, an rpmemfs command) did not start or
    did not do what it was started for; the message says why, with the end of its log. The
    one base error of the tools."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def python_module(module: str, *args: PathLike) -> list[str]:
    return [sys.executable, "-m", module, *(os.fspath(a) for a in args)]


def rpmemfs_command(*args: PathLike) -> list[str]:
    return python_module("rpmemfs.cli", *args)


def run_rpmemfs(*args: PathLike, check: bool = True, timeout: float = 300.0
                ) -> subprocess.CompletedProcess[str]:
    """`rpmemfs ARGS...` to its end, output captured; SpawnError if it fails and ``check``."""
    done = subprocess.run(rpmemfs_command(*args), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, env=child_env(), check=False)
    if check and done.returncode != 0:
        output = (done.stderr or done.stdout).strip()
        raise SpawnError(f"rpmemfs {' '.join(os.fspath(a) for a in args)} failed "
                         f"(status {done.returncode}):\n  {output}")
    return done


def log_tail(log: Path | None, limit: int = LOG_TAIL) -> str:
    """The end of a daemon's output (in the file ``log``), formatted to be appended to an
    error message; "" without a log file."""
    if log is None:
        return ""
    try:
        text = log.read_text(errors="replace").strip()
    except OSError:
        return ""
    if not text:
        return "\n  (the daemon printed nothing)"
    if len(text) > limit:
        text = "..." + text[-limit:]
    return "\n  daemon output:\n    " + text.replace("\n", "\n    ")


# ------------------------------------------------------------------------- targets


class TargetProcess:
    """``python -m rpmemfs.target`` with the given options, listening on a port of its choice.

    ``prefix`` runs it through another command first (``ip netns exec NS``, say). Its log
    (stderr) goes to ``log_path``, or to a scratch file read by :meth:`log_text`.
    """

    def __init__(
        self,
        pool_dir: PathLike,
        *,
        listen: str = "127.0.0.1:0",
        token_file: PathLike | None = None,
        persist: str | None = None,
        pmem: str | None = None,
        extra: Sequence[str] = (),
        prefix: Sequence[str] = (),
        log_level: str = "info",
        log_path: PathLike | None = None,
    ) -> None:
        argv = [*prefix, *python_module("rpmemfs.target"), "--listen", listen,
                "--pool-dir", os.fspath(pool_dir), "--log-level", log_level]
        if token_file is not None:
            argv += ["--token-file", os.fspath(token_file)]
        if persist is not None:
            argv += ["--persist", persist]
        if pmem is not None:
            argv += ["--pmem", pmem]
        self.argv = [*argv, *extra]
        self.pool_dir = Path(pool_dir)
        self._log_path = os.fspath(log_path) if log_path is not None else None
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise SpawnError("the target daemon was not started")
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> str:
        """Start it and wait for its listening line; returns HOST:PORT. SpawnError if it fails."""
        if self.running:
            # A second daemon would be started and the first one leaked (`with` starts it).
            raise SpawnError(f"the target on {self.address} is already running")
        if self._log_path is not None:
            # Never through a symlink: a log in a directory someone else could write to would
            # have this process (root, say) write wherever the link points.
            fd = safeopen.overwrite(self._log_path, 0o666, os.O_RDWR)
            self._log = os.fdopen(fd, "w+b")  # lives as long as the process
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
            start_new_session=True, env=child_env(),
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.kill()
                raise SpawnError(f"target did not start within {timeout:g}s\n{self.log_text()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                code = self.proc.wait()
                raise SpawnError(f"target exited with {code} before listening\n{self.log_text()}")
            line += chunk
        text = line.decode().strip()
        if not text.startswith(READY_PREFIX):
            self.kill()
            raise SpawnError(f"unexpected first line from the target: {text!r}")
        self.address = text[len(READY_PREFIX) :]
        return self.address

    def respawn(self, log_path: PathLike | None = None) -> TargetProcess:
        """The same daemon again (options, prefix), listening where this one did; not started."""
        again = TargetProcess.__new__(TargetProcess)
        argv = list(self.argv)
        argv[argv.index("--listen") + 1] = self.address
        again.argv = argv
        again.pool_dir = self.pool_dir
        again._log_path = os.fspath(log_path) if log_path is not None else None
        again._log = None
        again.proc = None
        again.address = ""
        return again

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, and SIGKILL if it has not exited within ``timeout``; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        if self._log is None:
            return ""
        # pread, not seek + read: the daemon's stderr shares this file's offset, and a line it
        # wrote between a seek(0) and the read landed over the start of its log.
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def close(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self.close()


# -------------------------------------------------------------------------- mounts


def detach(path: PathLike) -> bool:
    """Detach the mount at ``path`` even if its daemon is dead or hung (a lazy unmount);
    True once nothing is mounted there."""
    if not is_mounted(path):
        return True
    _quietly("fusermount3", "-u", "-z", os.fspath(path))
    if is_mounted(path):  # not a FUSE mount, or not ours to unmount as this user
        _quietly("umount", "-l", os.fspath(path))
    return not is_mounted(path)


def _quietly(*argv: str, timeout: float = 30.0) -> None:
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=timeout, check=False)


def wait_unmounted(path: PathLike, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while is_mounted(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def unmount(path: PathLike, timeout: float = 30.0) -> bool:
    """Unmount a background daemon's mount the way umount(8) would: for an rpmemfs mount
    `rpmemfs umount`, which returns once the daemon has closed the pool and exited; detached
    lazily if that does not finish within ``timeout``."""
    entry = mount_at(kernel_path(os.fspath(path)))
    if entry is not None and entry.fstype == "fuse.rpmemfs":
        try:
            run_rpmemfs("umount", path, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    else:
        _quietly("fusermount3", "-u", os.fspath(path), timeout=timeout)
    return wait_unmounted(path, timeout) or detach(path)


def detach_all_under(directory: PathLike) -> None:
    """Before a work directory is deleted: rmtree would otherwise descend into a live mount
    and delete through it. Deepest first, in case one mount sits inside another."""
    for mountpoint in mounts_under(directory):
        detach(mountpoint)


class MountProcess:
    """A FUSE daemon in the foreground that we own: started, waited for, stopped.

    ``argv`` runs it (see :meth:`rpmemfs` for `rpmemfs mount`); its stdout and stderr go to
    ``log_path``, or stay the caller's when None. ``what`` names it in error messages.
    """

    def __init__(self, argv: Sequence[str], mountpoint: PathLike, *,
                 log_path: PathLike | None = None, what: str = "") -> None:
        self.argv = list(argv)
        self.mountpoint = Path(mountpoint)
        self.log_path = Path(log_path) if log_path is not None else None
        self.what = what or " ".join(self.argv)
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def rpmemfs(cls, pool: PathLike, mountpoint: PathLike, options: str = "", *,
                log_path: PathLike | None = None) -> MountProcess:
        """`rpmemfs mount POOL MOUNTPOINT -f [-o OPTIONS]`."""
        argv = rpmemfs_command("mount", pool, mountpoint, "-f", *(["-o", options] if options else []))
        what = "rpmemfs mount" + (f" -o {options}" if options else "")
        return cls(argv, mountpoint, log_path=log_path, what=what)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise SpawnError(f"{self.what} was not started")
        return self.proc.pid

    def log_text(self) -> str:
        """Everything the daemon wrote (when it writes to a log file)."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for its mount (see :meth:`start`)."""
        assert not self.running, f"{self.what} at {self.mountpoint} is already running"
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if self.log_path is None:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, env=child_env())
        else:
            with os.fdopen(safeopen.overwrite(os.fspath(self.log_path)), "wb") as log:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=child_env())
        return self.proc

    def start(self, timeout: float = MOUNT_TIMEOUT) -> None:
        """Spawn it and wait until it is mounted and answering; SpawnError if it exits first
        or is not mounted within ``timeout`` (it is stopped then)."""
        self.spawn()
        try:
            self.wait_mounted(timeout)
        except SpawnError:
            self.stop()
            raise

    def wait_mounted(self, timeout: float = MOUNT_TIMEOUT) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise SpawnError(f"{self.what} exited with status {rc} before {self.mountpoint} "
                                 f"was mounted" + log_tail(self.log_path))
            # The table first: os.path.ismount alone would stat the directory underneath before
            # the mount, and stats the mount itself after, which proves the daemon answers.
            if is_mounted(self.mountpoint) and os.path.ismount(self.mountpoint):
                return
            if time.monotonic() > deadline:
                raise SpawnError(f"{self.what}: {self.mountpoint} not mounted {timeout:.0f} s "
                                 f"after starting the daemon" + log_tail(self.log_path))
            time.sleep(0.02)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once it has exited, None if it still runs after ``timeout``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def unmount(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """A clean unmount: ``sig`` (SIGTERM or SIGINT) and the daemon's exit status. If it has
        not exited within ``timeout`` it is stopped the hard way and SpawnError says so."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.wait(timeout)
        if rc is None:
            self.stop()
            raise SpawnError(f"{self.what} did not exit {timeout:.0f} s after signal {sig}"
                             + log_tail(self.log_path))
        return rc

    def kill(self) -> None:
        """SIGKILL, as a crash would; the dead mount stays attached until :func:`detach`."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """Best effort, never raises: SIGTERM and wait; SIGTERM again (an rpmemfs daemon then
        stops serving files still open) and wait; then SIGKILL and a lazy detach; and nothing
        left mounted. The exit status, None if the process would not die (or was never
        started: then the mount point is not ours to touch)."""
        if self.proc is None:
            return None
        rc: int | None = None
        try:
            for _ in range(2):
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGTERM)
                rc = self.wait(timeout / 2)
                if rc is not None:
                    break
            if rc is None:
                self.proc.kill()
                # A daemon blocked on its own mount finishes dying once the mount is detached.
                detach(self.mountpoint)
                rc = self.wait(timeout)
                if rc is None:
                    print(f"warning: {self.what} (pid {self.proc.pid}) for {self.mountpoint} "
                          "did not exit", file=sys.stderr)
        except OSError:
            pass
        try:
            detach(self.mountpoint)
        except (OSError, subprocess.SubprocessError):
            pass
        return rc

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
