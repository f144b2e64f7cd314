"""The mount daemon's control socket: `rpmemfs status` asks it, whatever the mount options.

One Unix socket per mount, named after the mountpoint, in a directory only root (or the
user) can write. The protocol is a line in ("status", "verify [CHUNK]", "sync", "flush"), JSON lines
back: any number of progress lines ({"progress": bytes done, "total": bytes}) for long
requests, then the answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

log = logging.getLogger("rpmemfs.mountd.control")
MAX_REQUEST = 256


def socket_dir() -> str:
    if os.geteuid() == 0:
        return "/run/rpmemfs"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"rpmemfs-{os.geteuid()}")


def socket_path(mountpoint: str) -> str:
    key = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(socket_dir(), key + ".sock")


Send = Callable[[dict[str, Any]], Awaitable[None]]
# A request's handler: its argument words and a way to send progress lines; the answer.
Handler = Callable[[list[str], Send], Awaitable[dict[str, Any]]]


async def serve(path: str, handlers: Mapping[str, Handler],
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
        async def answer(stream: trio.SocketStream) -> None:
            await _answer(stream, handlers)

        await trio.serve_listeners(answer, [listener])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _answer(stream: trio.SocketStream, handlers: Mapping[str, Handler]) -> None:
    async with stream:
        request = b""
        with trio.move_on_after(5):
            while b"\n" not in request and len(request) < MAX_REQUEST:
                chunk = await stream.receive_some(MAX_REQUEST)
                if not chunk:
                    break
                request += chunk

        async def send(doc: dict[str, Any]) -> None:
            await stream.send_all(json.dumps(doc).encode() + b"\n")

        words = request.decode(errors="replace").split()
        handler = handlers.get(words[0]) if words else None
        if handler is None:
            log.info("control socket: unknown request %r", request[:40])
            await send({"error": "unknown request"})
            return
        try:
            await send(await handler(words[1:], send))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the asker went away; what it asked for was done anyway


def query(mountpoint: str, request: str = "status", timeout: float | None = 10.0,
          progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Ask the daemon serving mountpoint; OSError when none answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path(mountpoint))
        s.sendall(request.encode() + b"\n")
        with s.makefile("rb") as f:
            for line in f:
                doc = json.loads(line)
                if isinstance(doc, dict) and "progress" in doc and len(doc) == 2:
                    if progress is not None:
                        progress(int(doc["progress"]), int(doc["total"]))
                    continue
                return doc  # type: ignore[no-any-return]
    raise OSError(f"the daemon serving {mountpoint} closed the control socket without an answer")
