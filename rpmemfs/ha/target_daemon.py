"""This node's target daemon: the process that serves the node's copy of the pool while the
node is not promoted. Started detached (it outlives the agent's action), found again by its
pid file and its command line (a pid alone may have been reused), stopped with SIGTERM and,
past a deadline, SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rpmemfs.ha.config import HaConfig
from rpmemfs.ha.ocf import Ocf, OcfError

READY = "rpmemfs target listening on "


def _pid_file(cfg: HaConfig) -> str:
    return os.path.join(cfg.state_dir, "target.pid")


def log_file(cfg: HaConfig) -> str:
    return os.path.join(cfg.state_dir, "target.log")


def _ours(pid: int, cfg: HaConfig) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    if state == "Z":
        return False
    return "target" in argv and cfg.pool_dir in argv and "--pool-dir" in argv


def running(cfg: HaConfig) -> int | None:
    """The pid of this resource's target daemon, when it runs."""
    try:
        with open(_pid_file(cfg)) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and _ours(pid, cfg) else None


def _tail(path: str, since: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace").strip()[-1500:]
    except OSError:
        return ""


def start(cfg: HaConfig, deadline: float) -> int:
    """Start it (or find it running); returns its pid once it listens."""
    if (pid := running(cfg)) is not None:
        return pid
    os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
    os.makedirs(cfg.pool_dir, mode=0o700, exist_ok=True)
    log = log_file(cfg)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    since = os.fstat(out).st_size
    argv = [sys.executable, "-m", "rpmemfs.cli", "target", "--listen", cfg.mine.address,
            "--pool-dir", cfg.pool_dir, "--token-file", cfg.token_file,
            "--wire-protection", cfg.wire_protection, *cfg.target_options]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(out)
    with open(_pid_file(cfg), "w") as f:
        f.write(f"{proc.pid}\n")
    while time.monotonic() < deadline:
        if READY in _tail(log, since):
            return proc.pid
        if proc.poll() is not None:
            raise OcfError(Ocf.ERR_GENERIC, f"the target daemon exited ({proc.returncode}): "
                           f"{_tail(log, since)}")
        time.sleep(0.05)
    proc.kill()
    raise OcfError(Ocf.ERR_GENERIC, f"the target daemon did not listen on {cfg.mine.address} in "
                   f"time: {_tail(log, since)}")


def _gone(pid: int, cfg: HaConfig, until: float) -> bool:
    while time.monotonic() < until:
        if not _ours(pid, cfg):
            return True
        time.sleep(0.05)
    return not _ours(pid, cfg)


def stop(cfg: HaConfig, deadline: float) -> None:
    """Stop it (nothing to do when it is not running); SIGKILL when SIGTERM is not enough in
    time, since a stop that fails makes Pacemaker fence the node."""
    pid = running(cfg)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    if not _gone(pid, cfg, min(deadline, time.monotonic() + max(1.0, (deadline - time.monotonic()) / 2))):
        os.kill(pid, signal.SIGKILL)
        if not _gone(pid, cfg, deadline):
            raise OcfError(Ocf.ERR_GENERIC, f"the target daemon (pid {pid}) did not stop")
    try:
        os.unlink(_pid_file(cfg))
    except FileNotFoundError:
        pass
