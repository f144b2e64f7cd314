"""A non-blocking socket driven by trio's wait_readable/wait_writable, sealed or not.

trio's own socket wrapper adds a scheduler round trip to every call, and a fail_after per
call costs a cancel scope; on a path whose whole budget is tens of microseconds both show.
Here a call that the kernel can satisfy at once returns at once; only a call that would block
waits, and only then is a deadline armed (see :meth:`SockIO.arm`). So that a peer that never
lets us block cannot starve other tasks, every few calls without a wait yield once anyway.

After a protected handshake, :meth:`SockIO.protect` puts the AEAD record layer between the
socket and its users (native/rpmem_sec.c, the same code the C lane loop and barrier builder
call): what is sent is sealed into records, what is received is verified plaintext. The
users' calls stay the same, so frames are oblivious to it.
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Sequence
from typing import Any

import trio

from rpmemfs.native import ffi, lib
from rpmemfs.transport.wire import RECORD_MAX, Cipher

Buffer = bytes | bytearray | memoryview

# Calls in a row that may complete without yielding to other tasks.
FAIR_EVERY = 16
# What one call of the record layer seals at most (native/rpmem_sec.c's OBUF_SIZE).
SEAL_MAX = 4 * RECORD_MAX


class SockIO:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._streak = 0
        self._scope: trio.CancelScope | None = None
        self._budget = math.inf
        self._armed = False
        self._sec: Any = None  # the record layer's state (struct rpm_sec *), once protected

    def protect(self, cipher: Cipher, tx_key: bytes, rx_key: bytes) -> None:
        """From now on every byte each way is sealed into records under these keys."""
        sec = lib.rpm_sec_new(int(cipher), tx_key, rx_key)
        if sec == ffi.NULL:
            raise OSError(errno.ENOMEM, f"cannot set up {cipher.name} records")
        self._sec = ffi.gc(sec, lib.rpm_sec_free)

    @property
    def sec(self) -> Any:
        """The record layer's state for C callers, or NULL on an unprotected connection."""
        return ffi.NULL if self._sec is None else self._sec

    @property
    def protected(self) -> bool:
        return self._sec is not None

    @property
    def pending(self) -> int:
        """Sealed bytes the socket has not taken yet."""
        return 0 if self._sec is None else int(lib.rpm_sec_pending(self._sec))

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

    def recv_nowait(self, buf: memoryview) -> int:
        """What the socket holds now, into ``buf``; BlockingIOError when it holds nothing."""
        if self._sec is None:
            return self.sock.recv_into(buf)
        got = self._sec_recv(buf, buf.nbytes)
        if got < 0:
            raise record_error(got)
        return int(got)

    async def recv_into(self, buf: memoryview, nbytes: int = 0) -> int:
        if self._sec is not None:
            return await self._recv_sealed(buf, nbytes or buf.nbytes)
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

    def _sec_recv(self, buf: memoryview, nbytes: int) -> int:
        # The export of ``buf`` (maybe a view of a pool mapping) ends with the call: one
        # left to a garbage cycle would keep the view from being released.
        with ffi.from_buffer(buf, require_writable=True) as dest:
            return int(lib.rpm_sec_recv(self._sec, self.sock.fileno(), dest, nbytes))

    async def _recv_sealed(self, buf: memoryview, nbytes: int) -> int:
        while True:
            got = self._sec_recv(buf, nbytes)
            if got == -errno.EAGAIN:
                await self._wait(True)
                continue
            if got < 0:
                raise record_error(got)
            await self._done()
            return int(got)

    def sendv_nowait(self, bufs: Sequence[Buffer]) -> int:
        """Seal and send what the socket takes now: the plaintext bytes taken (a prefix of
        ``bufs``; see :attr:`pending`), BlockingIOError when none."""
        # One call seals at most SEAL_MAX bytes: hand it no more buffers than that takes,
        # so a barrier of many ranges costs time in proportion to it, not to its square.
        n = total = 0
        while n < len(bufs) and total < SEAL_MAX:
            total += _nbytes(bufs[n])
            n += 1
        arr, keep = _rpm_bufs(bufs[:n])
        try:
            got = lib.rpm_sec_sendv(self._sec, self.sock.fileno(), arr, n)
        finally:
            for c in keep:  # the exports end with the call (see _sec_recv)
                ffi.release(c)
        if got < 0:
            raise record_error(got)
        return int(got)

    async def _send_sealed(self, bufs: Sequence[Buffer]) -> int:
        while True:
            try:
                taken = self.sendv_nowait(bufs)
                break
            except BlockingIOError:
                await self._wait(False)
        # What was sealed leaves before this returns: a caller that goes on to wait for a
        # reply must not leave its request in our buffer.
        while True:
            left = lib.rpm_sec_flush(self._sec, self.sock.fileno())
            if left < 0:
                raise record_error(left)
            if not left:
                break
            await self._wait(False)
        await self._done()
        return taken

    async def sendmsg(self, bufs: Sequence[Buffer]) -> int:
        if self._sec is not None:
            return await self._send_sealed(bufs)
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


def record_error(code: int) -> OSError:
    """The OSError of a record layer's -errno (its C code, or a lane loop's ``err``)."""
    err = -int(code)
    if err == errno.EAGAIN:
        return BlockingIOError(err, os.strerror(err))
    if err == errno.EBADMSG:
        return OSError(err, "a record failed authentication: changed, dropped, replayed or "
                            "reordered in transit")
    if err == errno.EPROTO:
        return OSError(err, "the peer sent something that is not a protected record")
    if err == errno.EPIPE:
        return OSError(err, "the connection ended in the middle of a record")
    return OSError(err, os.strerror(err))


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _rpm_bufs(bufs: Sequence[Buffer]) -> tuple[Any, list[Any]]:
    """A struct rpm_buf[] over ``bufs``, and the objects that keep it valid."""
    arr = ffi.new("struct rpm_buf[]", len(bufs))
    keep = []
    for i, b in enumerate(bufs):
        c = ffi.from_buffer(b)
        keep.append(c)
        arr[i].base = c
        arr[i].len = len(c)
    return arr, keep


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
