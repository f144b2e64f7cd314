"""Frames over a socket: a buffered reader and a vectored writer, used by both ends.

The reader keeps one staging buffer. Small frames arrive many to a recv() and are parsed out
of it; a large payload is received straight into the caller's destination (for the target:
a slice of the pool mapping), so the bytes are copied once, by the kernel, as a NIC would.
On a protected connection that copy is the record layer's, from the buffer it opened the
record in, once the record's tag verified (SockIO.protect). Neither applies deadlines: the
caller bounds the waits (SockIO.arm, or a cancel scope).
"""

from __future__ import annotations

import os

from rpmemfs.transport.sockio import Buffer, SockIO
from rpmemfs.transport.wire import HEADER_SIZE, Frame, unpack_header

STAGING_SIZE = 64 << 10
# A payload remainder up to this size is pulled through the staging buffer, which may bring
# the following frames in with it; a larger one goes straight to its destination.
STRAIGHT_MIN = 16 << 10
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class PeerClosed(Exception):
    """The peer closed the stream; ``mid_frame`` says whether it left a frame unfinished."""

    def __init__(self, mid_frame: bool) -> None:
        super().__init__("peer closed the connection" + (" in the middle of a frame" if mid_frame else ""))
        self.mid_frame = mid_frame


class FrameReader:
    def __init__(self, sock: SockIO, size: int = STAGING_SIZE) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def resize(self, size: int) -> None:
        """Switch to a staging buffer of ``size`` bytes, keeping what is buffered."""
        have = self._end - self._start
        if size < have:
            raise ValueError(f"cannot shrink staging below the {have} bytes it holds")
        buf = bytearray(size)
        buf[:have] = self._view[self._start : self._end]
        self._buf = buf
        self._view = memoryview(buf)
        self._start, self._end = 0, have

    def window(self) -> tuple[bytearray, int, int]:
        """The staging buffer and the [start, end) of its unconsumed bytes, for a C reader."""
        return self._buf, self._start, self._end

    def set_window(self, start: int, end: int) -> None:
        """What a C reader left unconsumed in the staging buffer."""
        if not 0 <= start <= end <= len(self._buf):
            raise ValueError(f"bad staging window [{start}, {end}) of {len(self._buf)}")
        self._start, self._end = start, end

    def fill_nowait(self, n: int) -> bool:
        """Buffer at least ``n`` bytes from what the socket holds now; False if it holds fewer."""
        if self._end - self._start >= n:
            return True
        if n > len(self._buf):
            return False
        self._make_room(n)
        sock = self.sock
        while self._end - self._start < n:
            try:
                got = sock.recv_nowait(self._view[self._end :])
            except BlockingIOError:
                return False
            except InterruptedError:
                continue
            if not got:
                raise PeerClosed(mid_frame=self._end > self._start)
            self._end += got
        return True

    def peek(self, n: int) -> memoryview:
        """The next ``n`` buffered bytes, left in the buffer."""
        return self._view[self._start : self._start + n]

    def _make_room(self, n: int) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start + n > len(self._buf):
            have = self._end - self._start
            self._view[:have] = self._view[self._start : self._end]
            self._start, self._end = 0, have

    async def fill(self, n: int) -> None:
        """Wait until at least ``n`` bytes (at most the staging size) are buffered."""
        if self._end - self._start >= n:
            return
        if n > len(self._buf):
            raise ValueError(f"cannot buffer {n} bytes in a staging buffer of {len(self._buf)}")
        self._make_room(n)
        while self._end - self._start < n:
            got = await self.sock.recv_into(self._view[self._end :])
            if not got:
                raise PeerClosed(mid_frame=self._end > self._start)
            self._end += got

    async def header(self) -> Frame:
        """The next frame header (WireError if it is not one)."""
        await self.fill(HEADER_SIZE)
        frame = unpack_header(self._buf, self._start)
        self._start += HEADER_SIZE
        return frame

    def take(self, n: int) -> memoryview:
        """``n`` buffered bytes; the view is valid only until the next read."""
        view = self._view[self._start : self._start + n]
        self._start += n
        return view

    async def payload(self, n: int) -> bytes:
        """The next ``n`` bytes as an object the caller may keep."""
        if n <= len(self._buf):
            await self.fill(n)
            return bytes(self.take(n))
        out = bytearray(n)
        await self.read_into(memoryview(out))
        return bytes(out)

    async def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: first from the staging buffer, then from the socket."""
        total = dest.nbytes
        pos = min(total, self._end - self._start)
        if pos:
            dest[:pos] = self._view[self._start : self._start + pos]
            self._start += pos
        while pos < total:
            rest = total - pos
            if rest < STRAIGHT_MIN:
                await self.fill(rest)
                dest[pos:] = self._view[self._start : self._start + rest]
                self._start += rest
                return
            got = await self.sock.recv_into(dest[pos:], rest)
            if not got:
                raise PeerClosed(mid_frame=True)
            pos += got

    async def skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                await self.fill(1)
            step = min(n, self._end - self._start)
            self._start += step
            n -= step


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def advance(pending: list[Buffer], i: int, sent: int) -> int:
    """Skip ``sent`` bytes of pending[i:]; returns the index of the first unsent buffer."""
    while i < len(pending):
        n = _nbytes(pending[i])
        if sent >= n:
            sent -= n
            i += 1
        else:
            if sent:
                pending[i] = memoryview(pending[i])[sent:]
            break
    return i


# The rest of a send whose bytes were all sealed but not all taken by the socket yet:
# sending it (send_all) pushes them out.
SEALED_REST: list[Buffer] = [b""]


def send_nowait(sock: SockIO, bufs: list[Buffer]) -> tuple[list[Buffer], int]:
    """Send what the socket takes now; returns (what is left, sendmsg calls)."""
    pending = list(bufs)
    if sock.protected:
        calls = i = 0
        # One call seals what fits the record layer's buffer; go on while the socket takes it.
        while i < len(pending) and not sock.pending:
            try:
                taken = sock.sendv_nowait(pending[i:])
            except BlockingIOError:
                break
            calls += 1
            i = advance(pending, i, taken)
        rest = pending[i:]
        return rest or (list(SEALED_REST) if sock.pending else []), calls
    raw = sock.sock
    calls = i = 0
    while i < len(pending):
        try:
            sent = raw.sendmsg(pending[i : i + IOV_MAX])
        except BlockingIOError:
            break
        except InterruptedError:
            continue
        calls += 1
        i = advance(pending, i, sent)
    return pending[i:], calls


async def send_all(sock: SockIO, bufs: list[Buffer]) -> int:
    """Send the buffers in order with sendmsg; returns how many sendmsg calls it took.

    One call, unless the kernel takes only part of the batch (a full socket buffer) or there
    are more buffers than one sendmsg accepts (IOV_MAX).
    """
    calls = 0
    pending = list(bufs)
    i = 0
    while i < len(pending):
        sent = await sock.sendmsg(pending[i : i + IOV_MAX])
        calls += 1
        i = advance(pending, i, sent)
    return calls
