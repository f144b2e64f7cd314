"""The promoted side: this node's copy mounted as the primary, asked how it is, unmounted.

The mount and the unmount run as `rpmemfs` commands (the mount forks its daemon and returns
once the pool is mounted; the unmount returns once that daemon has closed the pool), so the
agent holds nothing of the daemon's: an agent killed at its timeout leaves a daemon that the
next action finds again by its mount point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rpmemfs.ha.config import HaConfig
from rpmemfs.ha.ocf import Ocf, OcfError
from rpmemfs.mountd import control
from rpmemfs.mountd.status import Health, health
from rpmemfs.mountd.unmount import kernel_path
from rpmemfs.mountinfo import MountEntry, mount_at


def _rpmemfs(cfg: HaConfig, *args: str, deadline: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rpmemfs.cli", "--wire-protection", cfg.wire_protection, *args]
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=max(1.0, deadline - time.monotonic()), check=False)
    except subprocess.TimeoutExpired:
        raise OcfError(Ocf.ERR_GENERIC, f"`rpmemfs {' '.join(args)}` did not end in time") from None


def _entry(cfg: HaConfig) -> MountEntry | None:
    """The mount at ``directory``, if any; OcfError when it is another file system's."""
    entry = mount_at(kernel_path(cfg.directory))
    if entry is not None and entry.fstype != "fuse.rpmemfs":
        raise OcfError(Ocf.ERR_GENERIC, f"{cfg.directory} is a {entry.fstype} mount, not this pool's")
    return entry


def mounted(cfg: HaConfig) -> bool:
    return _entry(cfg) is not None


def mount_health(cfg: HaConfig, timeout: float = 10.0) -> tuple[Health, str] | None:
    """The mount's health (mountd/status.py) and why; None when it is not mounted."""
    entry = _entry(cfg)
    if entry is None:
        return None
    try:
        st = control.query(entry.mountpoint, timeout=timeout)
    except (OSError, ValueError) as e:
        return Health.UNKNOWN, f"its daemon does not answer ({e})"
    return health(st)


def mount(cfg: HaConfig, deadline: float) -> None:
    os.makedirs(cfg.directory, mode=0o755, exist_ok=True)
    opts = [f"min_replicas={cfg.min_replicas}", f"replica_timeout={cfg.replica_timeout:g}",
            f"token_file={cfg.token_file}", *cfg.mount_options]
    done = _rpmemfs(cfg, "mount", cfg.pool_path, cfg.directory, "-o", ",".join(opts),
                    deadline=deadline)
    if done.returncode != 0:
        raise OcfError(Ocf.ERR_GENERIC, f"mount failed: {(done.stderr or done.stdout).strip()}")


def wait_writable(cfg: HaConfig, deadline: float) -> Health:
    """Wait until an fsync would succeed (enough replicas in sync: the new primary compares
    the others with itself first), or the deadline; the health then."""
    while True:
        found = mount_health(cfg, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
        if found is None:
            raise OcfError(Ocf.ERR_GENERIC, f"{cfg.directory} is no longer mounted")
        if found[0] in (Health.HEALTHY, Health.DEGRADED) or time.monotonic() >= deadline:
            return found[0]
        time.sleep(0.1)


def _holders(point: str) -> list[int]:
    """Processes with a file, directory or root under ``point`` (read from /proc: no call
    reaches the mount, whose daemon may be stuck)."""
    inside = point.rstrip("/") + "/"
    pids: list[int] = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == os.getpid():
            continue
        links = [f"/proc/{pid}/cwd", f"/proc/{pid}/root"]
        try:
            links += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            pass
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target == point or target.startswith(inside):
                pids.append(pid)
                break
    return pids


def unmount(cfg: HaConfig, deadline: float) -> None:
    """Unmount cleanly (the daemon persists and closes the pool); with force_unmount, the
    processes holding files in it get SIGTERM and, 3 s later, SIGKILL."""
    killed_at: float | None = None
    why = ""
    while mounted(cfg):
        done = _rpmemfs(cfg, "umount", cfg.directory, deadline=deadline)
        if done.returncode == 0 or not mounted(cfg):
            return
        why = (done.stderr or done.stdout).strip()
        if time.monotonic() >= deadline:
            break
        holders = _holders(kernel_path(cfg.directory))
        if holders and cfg.force_unmount:
            sig = signal.SIGKILL if killed_at and time.monotonic() - killed_at > 3 else signal.SIGTERM
            killed_at = killed_at or time.monotonic()
            for pid in holders:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.3)
    if mounted(cfg):
        raise OcfError(Ocf.ERR_GENERIC, f"{cfg.directory} could not be unmounted: {why}")
