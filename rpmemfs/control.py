"""The mount daemon's control socket: `rpmemfs status` asks it, whatever the mount options.

One Unix socket per mount, named after the mountpoint, in a directory only root (or the
user) can write. The protocol is a line in ("status"), one JSON document back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger("rpmemfs.control")
MAX_REQUEST = 256


def socket_dir() -> str:
    if os.geteuid() == 0:
        return "/run/rpmemfs"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"rpmemfs-{os.geteuid()}")


def socket_path(mountpoint: str) -> str:
    key = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(socket_dir(), key + ".sock")


async def serve(path: str, describe: Callable[[], dict[str, Any]],
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer on the socket at path (from socket_path, taken BEFORE mounting: resolving
    the mountpoint afterwards would ask this very daemon, which is busy right here)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left behind by a daemon that was killed
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(8)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        await trio.serve_listeners(lambda s: _answer(s, describe), [listener])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _answer(stream: trio.SocketStream, describe: Callable[[], dict[str, Any]]) -> None:
    async with stream:
        with trio.move_on_after(5):
            request = b""
            while b"\n" not in request and len(request) < MAX_REQUEST:
                chunk = await stream.receive_some(MAX_REQUEST)
                if not chunk:
                    break
                request += chunk
            if request.strip() == b"status":
                await stream.send_all(json.dumps(describe()).encode() + b"\n")
            else:
                log.info("control socket: unknown request %r", request[:40])
                await stream.send_all(b'{"error": "unknown request"}\n')


def query(mountpoint: str, request: str = "status", timeout: float = 10.0) -> dict[str, Any]:
    """Ask the daemon serving mountpoint; OSError when none answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path(mountpoint))
        s.sendall(request.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
