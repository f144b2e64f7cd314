"""Starting a mount daemon: in the foreground, or forked off with a readiness pipe, so that
`rpmemfs mount` returns only once the pool is mounted (or says, in one line, why it is not)."""

from __future__ import annotations

import os
import sys

import trio

from rpmemfs import logs
from rpmemfs.mountd.daemon import Mounted
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountd.options import MountOptions, parse_options
from rpmemfs.sdnotify import notify
from rpmemfs.transport import protection


def run(pool: str, mountpoint: str, opts: list[str], foreground: bool) -> int:
    mo = parse_options(opts)
    if mo.wire_protection is not None:
        protection.set_initiator(mo.wire_protection)  # every connection of this mount, and its children
    logs.setup(mo.log_level, open(mo.log_file, "a") if mo.log_file else None)  # noqa: SIM115
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
            if not mo.log_file:
                # Forked off by mount(8), fstab or a shell: stderr is nobody's from here on.
                logs.to_syslog(mo.log_level, "rpmemfs-mount")
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1) if mo.log_file else (0, 1, 2):
                os.dup2(devnull, fd)

        try:
            trio.run(m.serve, ready)
            code = 0
        except MountError as e:
            os.write(wfd, str(e).encode())
        finally:
            m.finish()
    finally:
        os._exit(code)
