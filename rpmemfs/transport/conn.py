"""One authenticated TCP connection to a target, initiator side: framing, replies, loss.

Replies come back in request order, tagged with the request's id. Several tasks may share a
connection: whoever waits for a reply reads frames until its own arrives and leaves the
others' in a stash. A connection that fails mid-operation (a deadline, a cancellation after
bytes went out, an ERROR frame that closes it, the peer gone) is *lost*, like a queue pair in
the error state: every later operation on it raises TransportError with the first reason.
A record that fails authentication (protected traffic, docs/wire.md) loses it the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import trio

from rpmemfs.native import ffi, lib
from rpmemfs.printable import printable
from rpmemfs.transport.auth import Ephemeral, derive, initiator_proof, same, target_proof
from rpmemfs.transport.base import TransportError
from rpmemfs.transport.protection import has_aes
from rpmemfs.transport.sockio import Buffer, SockIO, connect_socket, tune
from rpmemfs.transport.stream import FrameReader, PeerClosed, advance, send_all, send_nowait
from rpmemfs.transport.tokens import refused_hint
from rpmemfs.transport.wire import (
    F_CLOSE,
    HEADER_SIZE,
    HELLO_F_NO_AES,
    HELLO_F_PLAIN,
    KEY_SIZE,
    MAX_ERROR_TEXT,
    MAX_READ,
    MAX_SEND,
    PROOF_SIZE,
    SESSION_ID_SIZE,
    VERSION,
    Cipher,
    Code,
    Frame,
    Hello,
    Op,
    Role,
    WireError,
    unpack_header,
)

SEND_BUFFER = 4 << 20
_REPLY_LIMITS = {Op.READ_RESP: MAX_READ, Op.SEND_REPLY: MAX_SEND, Op.ERROR: MAX_ERROR_TEXT}
_NETWORK_ERRORS = (OSError, PeerClosed, WireError, trio.ClosedResourceError, trio.BrokenResourceError)
# What may interrupt a step of a connection; Connection._failed turns each into its loss.
_INTERRUPTIONS = (trio.TooSlowError, trio.Cancelled, *_NETWORK_ERRORS)


@dataclass(frozen=True, slots=True)
class _Step:
    """What a connection was doing, in the words its loss is reported with."""

    waiting: str  # "timed out after Ns <waiting>"
    lost: str  # "<lost>: <the error>"
    # The reason a cancellation leaves: part of a frame may be on the wire, or a reply on its
    # way with nobody to consume it, so the stream cannot be trusted to resync. None: the
    # step's caller discards the connection itself.
    cancelled: str | None


_SENDING = _Step("sending to the target", "connection lost while sending",
                 "an operation was cancelled while sending")
_CALLING = _Step("waiting for the target", "connection lost",
                 "an operation was cancelled while waiting for the target")
_REPLYING = _Step("waiting for the target's reply", "connection lost",
                  "an operation was cancelled while waiting for its reply")
_HANDSHAKE = _Step("in the handshake", "connection lost in the handshake", None)


def _error_reason(payload: bytes, code: int) -> str:
    # The target's words, repeated in this side's errors, logs and status: escaped.
    text = printable(payload.decode("utf-8", "replace")) or "no reason given"
    try:
        return f"{text} ({Code(code).name.lower()})"
    except ValueError:
        return f"{text} (code {code})"


class Connection:
    def __init__(self, io: SockIO, peer: str, timeout: float) -> None:
        self.io = io
        self.peer = peer
        self.timeout = timeout
        self.reader = FrameReader(io)
        # A semaphore, not a Lock: a barrier posted by one task may leave the rest of its
        # frames (and the right to send) to the task that waits for it.
        self._send_lock = trio.Semaphore(1, max_value=1)
        self._recv_lock = trio.Lock()
        self._stash: dict[int, tuple[Frame, bytes]] = {}
        self._next_id = 0
        self._lost: str | None = None
        self._lost_code: int | None = None
        self._lost_timed_out = False
        # For rpm_take_reply: the staging buffer as C sees it (renewed if the reader swaps
        # it), and its window in and out of the call.
        self._native_buf: tuple[bytearray, Any] | None = None
        self._window = ffi.new("uint32_t[2]")

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def new_id(self) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF or 1
        return self._next_id

    def new_ids(self, n: int) -> int:
        """The first of ``n`` consecutive request ids (never 0, never wrapping inside)."""
        if self._next_id + n > 0xFFFFFFFF:
            self._next_id = 0
        first = self._next_id + 1
        self._next_id += n
        return first

    def check(self) -> None:
        if self._lost is not None:
            raise TransportError(self.peer, self._lost, code=self._lost_code, lane_lost=True,
                                 timed_out=self._lost_timed_out)

    def lose(self, reason: str, code: int | None = None, timed_out: bool = False) -> None:
        if self._lost is None:
            self._lost = reason
            self._lost_code = code
            self._lost_timed_out = timed_out
        self.io.close()

    def _fail(self, reason: str, code: int | None = None, timed_out: bool = False) -> NoReturn:
        self.lose(reason, code, timed_out)
        self.check()
        raise AssertionError("unreachable")

    def _failed(self, exc: BaseException, step: _Step) -> NoReturn:
        """``exc`` interrupted ``step``: the connection is lost (TransportError), or for a
        cancellation lost and the cancellation goes on."""
        if isinstance(exc, trio.TooSlowError):
            self._fail(f"timed out after {self.timeout:g}s {step.waiting}", timed_out=True)
        if isinstance(exc, trio.Cancelled):
            if step.cancelled is not None:
                self.lose(step.cancelled)
            raise exc
        self._fail(f"{step.lost}: {exc}")  # where it was lost already, the first reason stands

    async def _send(self, bufs: list[Buffer]) -> int:
        # Frames of concurrent senders must not interleave. The lock is taken without a
        # scheduling round trip when it is free, which is the common case.
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            self.check()
            return await send_all(self.io, bufs)
        finally:
            self._send_lock.release()

    async def _await_reply(self, id_: int) -> tuple[Frame, bytes]:
        if id_ not in self._stash:
            try:
                self._recv_lock.acquire_nowait()
            except trio.WouldBlock:
                await self._recv_lock.acquire()
            try:
                while id_ not in self._stash:
                    self.check()
                    await self._read_one()
            finally:
                self._recv_lock.release()
        frame, payload = self._stash.pop(id_)
        if frame.op == Op.ERROR:
            raise TransportError(self.peer, _error_reason(payload, frame.imm), code=frame.imm)
        return frame, payload

    async def post(self, bufs: list[Buffer]) -> int:
        """Send frames that get no reply, in one vectored send; returns the sendmsg calls made."""
        self.check()
        try:
            with trio.fail_after(self.timeout):
                return await self._send(bufs)
        except _INTERRUPTIONS as exc:
            self._failed(exc, _SENDING)

    def send_nowait(self, bufs: list[Buffer]) -> tuple[list[Buffer], int, bool]:
        """Send what the socket takes now, without waiting.

        Returns (the rest, sendmsg calls, locked). When part of the batch went out, the send
        lock stays held (``locked``) so that nothing interleaves with the frame cut in half;
        :meth:`finish_send` must follow whenever a rest remains.
        """
        self.check()
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            return bufs, 0, False
        try:
            rest, calls = send_nowait(self.io, bufs)
        except OSError as exc:
            self._send_lock.release()
            self._failed(exc, _SENDING)
        locked = bool(rest) and calls > 0
        if not locked:
            self._send_lock.release()
        return rest, calls, locked

    def send_native(self, send: Callable[[int], tuple[int, int]], rebuild: Callable[[], list[Buffer]]
                    ) -> tuple[list[Buffer], bool] | None:
        """Like :meth:`send_nowait`, for frames a C function builds and sends itself.

        ``send(fd)`` returns (bytes sent, bytes in all) or raises OSError; ``rebuild()`` gives
        the same frames as buffers, for the rest to go out through :meth:`finish_send` when
        the socket took only part. None when another send holds the lock (nothing was sent).
        """
        self.check()
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            return None
        try:
            sent, total = send(self.io.fileno())
        except OSError as exc:
            self._send_lock.release()
            self._failed(exc, _SENDING)
        if (sent == total and not self.io.pending) or not sent:
            # All out, or nothing: either way no frame is cut in half, so the lock goes.
            self._send_lock.release()
            if sent:
                return [], False
        pending = rebuild()
        # All sealed but some still in the record layer: sending the empty rest pushes it out.
        return pending[advance(pending, 0, sent):] or [b""], bool(sent)

    async def finish_send(self, rest: list[Buffer], locked: bool) -> int:
        """Send the rest that :meth:`send_nowait` left (``locked``: it kept the send lock)."""
        self.check()
        try:
            with trio.fail_after(self.timeout):
                if not locked:
                    return await self._send(rest)
                try:
                    return await send_all(self.io, rest)
                finally:
                    self._send_lock.release()
        except _INTERRUPTIONS as exc:
            self._failed(exc, _SENDING)

    def reply_nowait(self, id_: int) -> tuple[Frame, bytes] | None:
        """The reply to ``id_`` if the socket already holds all of it, else None; never waits."""
        self.check()
        if id_ not in self._stash:
            if self._recv_lock.locked():
                return None
            reader = self.reader
            try:
                while id_ not in self._stash:
                    if not reader.fill_nowait(HEADER_SIZE):
                        return None
                    frame = unpack_header(reader.peek(HEADER_SIZE))
                    self._check_reply(frame)
                    if not reader.fill_nowait(HEADER_SIZE + frame.length):
                        return None  # the waiting path takes it from the buffer
                    reader.take(HEADER_SIZE)
                    self._stash_reply(frame, bytes(reader.take(frame.length)))
            except (OSError, PeerClosed, WireError) as exc:
                self._failed(exc, _REPLYING)
        frame, payload = self._stash.pop(id_)
        if frame.op == Op.ERROR:
            raise TransportError(self.peer, _error_reason(payload, frame.imm), code=frame.imm)
        return frame, payload

    def _take_native(self, id_: int, op: int, length: int) -> int:
        """rpm_take_reply on this connection's staging buffer: 1 taken, 0 not here yet, 2 the
        Python reader must take over (something else is next, or the socket failed)."""
        buf, start, end = self.reader.window()
        held = self._native_buf
        if held is None or held[0] is not buf:
            held = self._native_buf = (buf, ffi.from_buffer("uint8_t[]", buf))
        window = self._window
        window[0], window[1] = start, end
        got = lib.rpm_take_reply(self.io.sec, self.io.fileno(), held[1], len(buf),
                                 window, window + 1, op, id_, length)
        self.reader.set_window(window[0], window[1])
        return int(got)

    def take_reply_nowait(self, id_: int, op: int, length: int) -> int:
        """The reply to ``id_`` when it is an ``op`` of ``length`` bytes with nothing to hand
        out (a barrier's flush), taken in C if it is next and here: 1 taken, 0 not here yet,
        2 use :meth:`reply_nowait` (it is stashed, another task reads, or something else is
        next). The common case of every barrier, without a Python object per reply."""
        if self._lost is not None or id_ in self._stash or self._recv_lock.locked():
            return 2
        return self._take_native(id_, op, length)

    async def take_reply(self, id_: int, op: int, length: int) -> bool:
        """:meth:`take_reply_nowait`, waiting for it under the connection's deadline: True
        once taken, False when :meth:`reply` must take over."""
        self.check()
        if id_ in self._stash:
            return False
        try:
            with trio.fail_after(self.timeout):
                try:
                    self._recv_lock.acquire_nowait()
                except trio.WouldBlock:
                    await self._recv_lock.acquire()
                try:
                    while True:
                        self.check()
                        if id_ in self._stash:
                            return False
                        got = self._take_native(id_, op, length)
                        if got:
                            return got == 1
                        await trio.lowlevel.wait_readable(self.io.sock)
                finally:
                    self._recv_lock.release()
        except _INTERRUPTIONS as exc:
            self._failed(exc, _REPLYING)

    async def call(self, bufs: list[Buffer], id_: int) -> tuple[int, Frame, bytes]:
        """Send frames and wait for the reply to request ``id_``, under one deadline.

        Returns (sendmsg calls, reply frame, payload). TransportError for an ERROR reply (the
        lane survives unless the target closed it) or a lost connection.
        """
        self.check()
        try:
            with trio.fail_after(self.timeout):
                calls = await self._send(bufs)
                frame, payload = await self._await_reply(id_)
        except _INTERRUPTIONS as exc:
            self._failed(exc, _CALLING)
        return calls, frame, payload

    async def reply(self, id_: int) -> tuple[Frame, bytes]:
        """The reply to a request sent earlier with :meth:`post`."""
        self.check()
        try:
            with trio.fail_after(self.timeout):
                return await self._await_reply(id_)
        except _INTERRUPTIONS as exc:
            self._failed(exc, _REPLYING)

    async def _read_one(self) -> None:
        frame = await self.reader.header()
        self._check_reply(frame)
        self._stash_reply(frame, await self.reader.payload(frame.length))

    def _check_reply(self, frame: Frame) -> None:
        limit = _REPLY_LIMITS.get(Op(frame.op))
        if limit is None:
            self._fail(f"target sent an unexpected {Op(frame.op).name} frame")
        if frame.length > limit:
            self._fail(f"target sent a {Op(frame.op).name} of {frame.length} bytes (limit {limit})")

    def _stash_reply(self, frame: Frame, payload: bytes) -> None:
        if frame.op == Op.ERROR and frame.flags & F_CLOSE:
            self._fail("target closed the connection: " + _error_reason(payload, frame.imm), frame.imm)
        self._stash[frame.id] = (frame, payload)

    async def handshake(self, token: bytes, role: Role, session_id: bytes, protect: bool = True
                        ) -> tuple[bytes, dict[str, Any]]:
        """Authenticate both ways and, when ``protect``, seal everything after the AUTH;
        returns the session id and what the target says about itself."""
        mine = Ephemeral()
        flags = 0 if protect else HELLO_F_PLAIN
        if protect and not has_aes():
            flags |= HELLO_F_NO_AES
        hello = Hello(VERSION, role, mine.public, session_id, flags).pack()
        try:
            with trio.fail_after(self.timeout):
                await send_all(self.io, [hello])
                frame, payload = await self._handshake_frame(Op.CHALLENGE, KEY_SIZE + PROOF_SIZE)
                cipher = self._cipher(frame, protect)
                if len(payload) != KEY_SIZE + PROOF_SIZE:
                    self._fail("target's CHALLENGE has the wrong length")
                theirs, proof = payload[:KEY_SIZE], payload[KEY_SIZE:]
                transcript = hello + frame.pack() + theirs
                try:
                    keys = derive(token, mine.shared(theirs), transcript)
                except ValueError:
                    self._fail("the target's public key is not a valid X25519 key", Code.AUTH_FAILED)
                if not same(proof, target_proof(keys, transcript)):
                    # Our own proof is not sent to a peer that could not prove itself.
                    self._fail(
                        "the target could not prove it knows the token: it is not the genuine "
                        "target, it was given a different token, or the handshake was changed "
                        "in transit",
                        Code.AUTH_FAILED,
                    )
                answer = initiator_proof(keys, transcript)
                await send_all(self.io, [Frame(Op.AUTH, length=PROOF_SIZE).pack(), answer])
                if cipher != Cipher.NONE:
                    if self.reader.buffered:
                        self._fail("target sent bytes it had no reason to send during the handshake")
                    self.io.protect(cipher, keys.initiator_to_target, keys.target_to_initiator)
                frame, payload = await self._handshake_frame(Op.OK, MAX_SEND)
        except _INTERRUPTIONS as exc:
            self._failed(exc, _HANDSHAKE)
        if len(payload) < SESSION_ID_SIZE:
            self._fail("target's OK is too short to hold a session id")
        try:
            info = json.loads(payload[SESSION_ID_SIZE:] or b"{}")
        except ValueError:
            self._fail("target's OK carries no valid JSON")
        return payload[:SESSION_ID_SIZE], info

    def _cipher(self, challenge: Frame, protect: bool) -> Cipher:
        """The cipher the target chose in its CHALLENGE, if it fits what we asked for."""
        try:
            cipher = Cipher(challenge.imm)
        except ValueError:
            self._fail(f"target chose cipher {challenge.imm}, unknown here")
        if protect and cipher == Cipher.NONE:
            self._fail("target offered no wire protection, which this initiator requires",
                       Code.PROTECTION)
        if not protect and cipher != Cipher.NONE:
            self._fail("target chose wire protection although this initiator asked for none",
                       Code.PROTECTION)
        return cipher

    async def _handshake_frame(self, want: Op, limit: int) -> tuple[Frame, bytes]:
        frame = await self.reader.header()
        if frame.op == Op.ERROR:
            payload = await self.reader.payload(min(frame.length, MAX_ERROR_TEXT))
            self._fail("target refused the connection: " + _error_reason(payload, frame.imm), frame.imm)
        if frame.op != want or frame.length > limit:
            self._fail(f"target answered the handshake with {Op(frame.op).name}, expected {want.name}")
        return frame, await self.reader.payload(frame.length)


async def open_connection(
    host: str, port: int, peer: str, token: bytes, role: Role, session_id: bytes, timeout: float,
    protect: bool = True,
) -> tuple[Connection, bytes, dict[str, Any]]:
    try:
        with trio.fail_after(timeout):
            sock = await connect_socket(host, port)
    except trio.TooSlowError:
        raise TransportError(peer, f"timed out after {timeout:g}s connecting", lane_lost=True,
                             timed_out=True) from None
    except OSError as exc:
        raise TransportError(peer, f"cannot connect: {exc.strerror or exc}", lane_lost=True) from None
    try:
        tune(sock, send_buffer=SEND_BUFFER)
        conn = Connection(SockIO(sock), peer, timeout)
        session, info = await conn.handshake(token, role, session_id, protect)
    except TransportError as exc:
        sock.close()
        if exc.code != Code.AUTH_FAILED:
            raise
        # Which token file was tried is what a user needs to know to fix it.
        raise TransportError(peer, exc.reason + refused_hint(token), code=exc.code,
                             lane_lost=exc.lane_lost) from None
    except BaseException:
        sock.close()
        raise
    return conn, session, info
