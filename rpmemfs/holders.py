"""Who holds a file's lock: the process behind "in use", read from /proc/locks.

A pool is opened with an exclusive flock (pmem.PoolMapping.open): a mount daemon, a target
daemon serving it as a replica, or an offline tool. When a second opener is refused, an
operator needs to know which of those holds it and since when, not just that someone does.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time


def lock_holders(fd: int) -> list[int]:
    """PIDs holding a flock or POSIX lock on the file open at ``fd`` (this process excluded)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 18353 00:1b:18484 0 EOF" ("->" marks a waiter)
                if len(parts) >= 6 and parts[1] != "->" and parts[5] == want and parts[4].isdigit():
                    pid = int(parts[4])
                    if pid != os.getpid() and pid not in pids:
                        pids.append(pid)
    except OSError:
        return []
    return pids


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def rpmemfs_command(pid: int) -> str | None:
    """The rpmemfs command process ``pid`` runs ("target", "mount", "sync", ...) as its command
    line says (`rpmemfs CMD`, `python -m rpmemfs.cli CMD`, `python -m rpmemfs.target`); None
    for another program."""
    argv = _argv(pid)
    for i, arg in enumerate(argv):
        if arg == "rpmemfs.target":
            return "target"
        if arg == "rpmemfs.cli" or os.path.basename(arg) == "rpmemfs":
            rest = iter(argv[i + 1:])
            for word in rest:
                if word in ("--log-level", "--wire-protection"):
                    next(rest, None)  # the global option's value
                elif not word.startswith("-"):
                    return word
            return None
    return None


def describe_process(pid: int) -> str:
    """'pid N (command line) since HH:MM:SS', as far as /proc tells."""
    cmd = " ".join(_argv(pid))
    since = ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
        since = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started))
    except (OSError, ValueError, IndexError):
        pass
    shown = cmd if len(cmd) <= 160 else cmd[:157] + "..."
    return f"pid {pid}{f' ({shown})' if shown else ''}{since}"


def busy(path: str) -> str | None:
    """Who has the pool file or device DAX at ``path`` open (every writer holds an exclusive
    lock on it, a reader a shared one), described; None when nobody, or when no regular file
    or character device is there (a link is not followed). What mkfs, recover and promote ask
    before they replace a pool: one that is mounted, served or read must not lose its name, or
    its bytes, under the process using it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "; ".join(map(describe_process, lock_holders(fd))) or "holder not visible from here"
        return None
    finally:
        os.close(fd)
