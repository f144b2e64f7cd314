"""Starting a mount daemon: in the foreground, or forked off with a readiness pipe, so that
`rpmemfs mount` returns only once the pool is mounted (or says, in one line, why it is not)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import trio

from rpmemfs import logs, safeopen
from rpmemfs.mountd import control
from rpmemfs.mountd.daemon import Mounted
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountd.options import MountOptions, parse_options
from rpmemfs.sdnotify import notify

log = logging.getLogger("rpmemfs.mount")


def run(pool: str, mountpoint: str, opts: list[str], foreground: bool,
        wire_protection: str | None = None) -> int:
    """Mount ``pool``; ``wire_protection`` is the command's --wire-protection, which the
    mount option of that name overrides."""
    mo = parse_options(opts)
    if mo.wire_protection is None:
        mo.wire_protection = wire_protection  # carried in the options, to the forked daemon too
    logs.setup(mo.log_level, _log_file(mo.log_file) if mo.log_file else None)
    if foreground:
        m = Mounted(pool, mountpoint, mo)

        def ready() -> None:
            # A Type=notify unit (mount/rpmemfs@.service) is started once the pool is mounted.
            notify("READY=1", f"STATUS=serving {m.pool} at {m.mountpoint}")

        try:
            trio.run(m.serve, ready)
        finally:
            notify("STOPPING=1")
            m.finish()
        return 0
    return _daemonize(pool, mountpoint, mo)


def _log_file(path: str) -> TextIO:
    """The file of `-o log=`, appended to: never through a link, nor into another's file (its
    name may be in /tmp, where anyone can put something first)."""
    try:
        return os.fdopen(safeopen.append(path), "a")
    except OSError as e:
        why = e if isinstance(e, safeopen.RefusedPath) else e.strerror
        raise MountError(f"-o log={path}: {why}") from None


def _daemonize(pool: str, mountpoint: str, mo: MountOptions) -> int:
    """Fork; the parent returns once the child has mounted (or says why it could not)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            msg = r.read().decode(errors="replace")
        if msg == "ok":
            return 0
        sys.stderr.write(f"rpmemfs: {msg or 'mount daemon died while starting'}\n")
        return 1
    os.close(rfd)
    os.setsid()
    code = 1
    try:
        try:
            m = Mounted(pool, mountpoint, mo)
        except MountError as e:
            os.write(wfd, str(e).encode())
            os._exit(1)

        def ready() -> None:
            os.write(wfd, b"ok")
            os.close(wfd)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1) if mo.log_file else (0, 1, 2):
                os.dup2(devnull, fd)
            # Forked off by mount(8), fstab or a shell: stderr is nobody's from here on.
            if not mo.log_file and not logs.to_syslog(mo.log_level, "rpmemfs-mount"):
                _log_beside_socket(m, mo.log_level)

        try:
            trio.run(m.serve, ready)
            code = 0
        except MountError as e:
            os.write(wfd, str(e).encode())
        finally:
            m.finish()
    finally:
        os._exit(code)


def _log_beside_socket(m: Mounted, level: str) -> None:
    """No syslog socket (a container, a minimal system): the log goes to a file beside the
    control socket, in a directory of the mount's user alone, rather than nowhere; `rpmemfs
    status` and umount's messages name it, and its first line from this mount says whose it is."""
    path = control.log_path(m.control_path)
    try:
        logs.to_file(level, path)
    except OSError:
        return  # nowhere to say so: status and umount's messages say it logs nowhere
    log.warning("no syslog socket: the mount of %s at %s (pid %d) logs here, %s", m.pool,
                m.mountpoint, os.getpid(), path)
