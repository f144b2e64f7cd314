"""Who holds a file's lock: the process behind "in use", read from /proc/locks.

A pool is opened with an exclusive flock (pmem.PoolMapping.open): a mount daemon, a target
daemon serving it as a replica, or an offline tool. When a second opener is refused, an
operator needs to know which of those holds it and since when, not just that someone does.
"""

from __future__ import annotations

import os
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


def describe_process(pid: int) -> str:
    """'pid N (command line) since HH:MM:SS', as far as /proc tells."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
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
