"""A non-blocking socket driven by trio's wait_readable/wait_writable, and nothing more.

trio's own socket wrapper adds a scheduler round trip to every call, and a fail_after per
call costs a cancel scope; on a path whose whole budget is tens of microseconds both show.
Here a call that the kernel can satisfy at once returns at once; only a call that would block
waits, and only then is a deadline armed (see :meth:`SockIO.arm`). So that a peer that never
lets us block cannot starve other tasks, every few calls without a wait yield once anyway.
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Sequence
from typing import Any

import trio

Buffer = bytes | bytearray | memoryview

# Calls in a row that may complete without yielding to other tasks.
FAIR_EVERY = 16


class SockIO:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._streak = 0
        self._scope: trio.CancelScope | None = None
        self._budget = math.inf
        self._armed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def bind_scope(self, scope: trio.CancelScope | None) -> None:
        """The cancel scope whose deadline :meth:`arm` sets."""
        self._scope = scope

    def arm(self, seconds: float) -> None:
        """From now on, waits may take ``seconds`` in total (until the next arm()).

        The deadline is only written into the scope when a wait actually happens, so an
        operation the kernel completes at once costs no deadline bookkeeping.
        """
        self._budget = seconds
        if self._armed and self._scope is not None:
            self._armed = False
            self._scope.deadline = math.inf

    async def _wait(self, readable: bool) -> None:
        self._streak = 0
        if not self._armed and self._scope is not None:
            self._armed = True
            self._scope.deadline = trio.current_time() + self._budget
        if readable:
            await trio.lowlevel.wait_readable(self.sock)
        else:
            await trio.lowlevel.wait_writable(self.sock)

    async def _done(self) -> None:
        self._streak += 1
        if self._streak >= FAIR_EVERY:
            self._streak = 0
            await trio.lowlevel.checkpoint()

    async def recv_into(self, buf: memoryview, nbytes: int = 0) -> int:
        while True:
            try:
                got = self.sock.recv_into(buf, nbytes)
            except BlockingIOError:
                await self._wait(True)
                continue
            except InterruptedError:
                continue
            await self._done()
            return got

    async def sendmsg(self, bufs: Sequence[Buffer]) -> int:
        while True:
            try:
                sent = self.sock.sendmsg(bufs)
            except BlockingIOError:
                await self._wait(False)
                continue
            except InterruptedError:
                continue
            await self._done()
            return sent

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            # Tasks blocked on this socket get ClosedResourceError instead of hanging.
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()


AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]


async def resolve(host: str, port: int) -> list[AddrInfo]:
    return list(await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))


async def connect_socket(host: str, port: int, infos: Sequence[AddrInfo] | None = None) -> socket.socket:
    """A connected non-blocking TCP socket to the first address of ``host`` that answers
    (of ``infos`` when given: the caller resolved ``host`` already)."""
    if infos is None:
        infos = await resolve(host, port)
    last: OSError | None = None
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            err = sock.connect_ex(addr)
            if err == errno.EINPROGRESS:
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
        except OSError as exc:
            sock.close()
            last = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise last or OSError(errno.EHOSTUNREACH, f"no address for {host}")


def tune(sock: socket.socket, *, send_buffer: int = 0) -> None:
    """Latency over batching (frames are already batched by the sender), and dead-peer detection.

    ``send_buffer`` asks for a send buffer that large (the kernel caps it at wmem_max), so a
    whole barrier fits into the socket in one sendmsg instead of trickling out as the
    autotuned buffer grows.
    """
    if send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
