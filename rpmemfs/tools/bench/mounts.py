"""Bringing FUSE daemons up and, above all, reliably down again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import rpmemfs

# The repository root, so `python -m rpmemfs...` in a child finds this very checkout
# whatever the child's working directory is.
PROJECT_ROOT = Path(rpmemfs.__file__).resolve().parent.parent


class MountError(RuntimeError):
    """A filesystem did not come up; the message says why, with the daemon's stderr."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def python_module(module: str, *args: str) -> list[str]:
    # The running interpreter, so the venv's pyfuse3 and rpmemfs are the ones used.
    return [sys.executable, "-m", module, *args]


def unescape_mount_field(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def is_mounted(path: Path) -> bool:
    """Whether *path* is a mount point, without touching the filesystem on it.

    os.path.ismount stats the mount point, which hangs while a daemon is stuck and
    says False once it died (ENOTCONN); the kernel's mount table says neither.
    """
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return any(unescape_mount_field(line.split()[4]) == target for line in f)


def wait_until_mounted(path: Path, proc: subprocess.Popen[bytes] | None, timeout: float,
                       what: str, stderr_file: Path | None = None) -> None:
    """Poll until *path* is a working mount; fail early if the daemon exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # ismount on purpose here: it also proves the daemon answers requests.
        if os.path.ismount(path):
            return
        if proc is not None and proc.poll() is not None:
            raise MountError(
                f"{what} exited with status {proc.returncode} before {path} was mounted"
                + log_tail(stderr_file)
            )
        time.sleep(0.02)
    raise MountError(f"{what}: {path} not mounted after {timeout:.0f} s"
                     + log_tail(stderr_file))


def log_tail(stderr_file: Path | None, limit: int = 4000) -> str:
    """The end of a daemon's output, formatted to be appended to an error message."""
    if stderr_file is None:
        return ""
    try:
        text = stderr_file.read_text(errors="replace").strip()
    except OSError:
        return ""
    if not text:
        return "\n  (the daemon printed nothing)"
    if len(text) > limit:
        text = "..." + text[-limit:]
    return "\n  daemon output:\n    " + text.replace("\n", "\n    ")


def mounts_under(directory: Path) -> list[Path]:
    prefix = os.path.realpath(directory) + os.sep
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = [unescape_mount_field(line.split()[4]) for line in f]
    return [Path(p) for p in points if p.startswith(prefix)]


def detach_all_under(directory: Path) -> None:
    """Belt and braces before a work directory is deleted: rmtree would otherwise
    descend into a live mount and delete through it."""
    # Deepest first, in case one mount sits inside another.
    for mnt in sorted(mounts_under(directory), key=lambda p: len(p.parts), reverse=True):
        lazy_unmount(mnt)


def lazy_unmount(path: Path) -> None:
    """Last resort: detach the mount even if the daemon is dead or hung."""
    if not is_mounted(path):
        return
    subprocess.run(["fusermount3", "-u", "-z", str(path)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_daemon(proc: subprocess.Popen[bytes], mountpoint: Path, timeout: float = 15.0) -> None:
    """SIGTERM and wait; escalate to SIGKILL and a lazy unmount if that is not enough."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            # A daemon blocked on its own mount only finishes dying once the
            # mount is detached.
            lazy_unmount(mountpoint)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"warning: daemon {proc.pid} for {mountpoint} did not exit",
                      file=sys.stderr)
    lazy_unmount(mountpoint)


def wait_until_unmounted(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while is_mounted(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
