"""The target's loop for one authenticated connection: the part a NIC would do.

A lane's frames are checked and served by the C loop (``NativeLane`` over
native/rpmem_lane.c: the one data path): WRITEs placed into the pool mapping, READs answered
after everything before them on the lane is placed, flushes persisted. It returns here only
for what is not data: a control SEND (a JSON request for the control service, answered in
order like everything else), a refused frame, a failed persist, a deadline or the end of the
stream. A control connection carries control SENDs only, read here.

Anything a well-behaved initiator never sends is a violation: it is logged, answered with an
ERROR frame that says the connection closes, and the connection is closed. Other
connections are untouched.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os

import trio

from rpmemfs.native import lib
from rpmemfs.target.control import ControlService
from rpmemfs.target.lane_native import NativeLane
from rpmemfs.target.sessions import TargetSession
from rpmemfs.transport.sockio import SockIO, record_error
from rpmemfs.transport.stream import FrameReader, PeerClosed, send_all
from rpmemfs.transport.wire import (
    F_CLOSE,
    HEADER_SIZE,
    MAX_CONTROL,
    Code,
    Frame,
    Op,
    Role,
    SendKind,
    WireError,
    error_text,
    pack_header,
    unpack_header,
)

log = logging.getLogger("rpmemfs.target.frame_loop")

ERROR_SEND_TIMEOUT = 1.0


class Violation(Exception):
    def __init__(self, code: Code, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Deadline(Exception):
    """The C loop met a deadline; FrameLoop._phase says which."""


class FrameLoop:
    """One connection: a lane (``native``, its C loop) or a control connection (None)."""

    def __init__(
        self,
        io: SockIO,
        reader: FrameReader,
        peer: str,
        session: TargetSession,
        control: ControlService,
        native: NativeLane | None,
        *,
        idle_timeout: float,
        frame_timeout: float,
        empty_timeout: float = math.inf,
    ) -> None:
        self._io = io
        self._native = native
        self._reader = reader
        self._peer = peer
        self._session = session
        self._role = Role.LANE if native is not None else Role.CONTROL
        self._control = control
        self._idle_timeout = idle_timeout
        # A control connection whose session holds no pool serves nobody while it waits (a
        # mount's always holds its pool): it is closed sooner, so it cannot keep a slot.
        self._empty_timeout = min(empty_timeout, idle_timeout)
        self._waited = idle_timeout  # the idle deadline of the current wait, for the log
        self._frame_timeout = frame_timeout
        self._last_id = 0
        self._what = "lane" if native is not None else "control connection"
        # What a passing deadline interrupted: "idle" (between frames), "frame", "error".
        self._phase = "idle"

    async def run(self) -> None:
        """Serve frames until the peer leaves, a violation, a deadline, or cancellation."""
        # One scope for the connection's life; SockIO moves its deadline only when a call
        # has to wait, so frames that arrive whole cost no deadline bookkeeping.
        with trio.CancelScope() as scope:
            self._io.bind_scope(scope)
            try:
                await self._serve()
            finally:
                self._io.bind_scope(None)
        if scope.cancelled_caught:
            self._log_deadline()

    def _empty(self) -> bool:
        return self._role == Role.CONTROL and not self._session.regions

    def idle_and_empty(self) -> bool:
        """Whether this connection holds nothing now: a control connection whose session has
        no pool open, waiting for a request (what may be closed to make room)."""
        return self._phase == "idle" and self._empty()

    def _log_deadline(self) -> None:
        if self._phase == "idle":
            empty = " holding no pool" if self._waited < self._idle_timeout else ""
            log.info("peer %s: closing %s%s idle for %gs", self._peer, self._what, empty, self._waited)
        elif self._phase == "frame":
            log.warning(
                "peer %s: closing %s: frame not completed within %gs (truncated or stalled)",
                self._peer, self._what, self._frame_timeout,
            )

    async def _serve(self) -> None:
        try:
            while True:
                if self._native is not None:
                    # The C loop keeps its own deadlines; one armed for a frame this loop
                    # waited on must not outlive that frame.
                    self._io.arm(math.inf)
                    await self._serve_native()
                await self._serve_one()
        except _Deadline:
            self._log_deadline()
        except (Violation, WireError) as exc:
            log.warning("peer %s: closing %s: %s", self._peer, self._what, exc.reason)
            await self._error(self._last_id, exc.code, exc.reason, close=True)
        except PeerClosed as exc:
            if exc.mid_frame:
                log.warning("peer %s: closing %s: truncated frame (closed mid-frame)", self._peer, self._what)
            else:
                log.info("peer %s: %s closed by the peer", self._peer, self._what)
        except OSError as exc:
            if exc.errno in (errno.EBADMSG, errno.EPROTO):
                # Nothing of the bad record was placed; the initiator sees the lane lost.
                log.warning("peer %s: closing %s: %s; nothing of it was placed", self._peer,
                            self._what, exc.strerror)
            else:
                log.info("peer %s: %s lost: %s", self._peer, self._what, exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("peer %s: %s lost: %s", self._peer, self._what, exc)

    async def _serve_native(self) -> None:
        """Let the C loop serve frames until it leaves a control SEND to this loop."""
        assert self._native is not None
        while True:
            status = await self._native.serve()
            if status == lib.RPM_LANE_HANDOFF:
                return
            if status == lib.RPM_LANE_REFUSED:
                code, refused = self._native.refused()
                self._last_id = refused.id
                raise Violation(code, refused.reason(self._session.regions))
            if status == lib.RPM_LANE_PERSIST_FAILED:
                frame = self._native.frame()
                reason = os.strerror(self._native.err)
                log.error("peer %s: persisting a flush failed: %s", self._peer, reason)
                await self._error(frame.id, Code.IO, f"persist failed on the target: {reason}", close=False)
                continue
            if status == lib.RPM_LANE_IDLE:
                self._phase = "idle"
                raise _Deadline
            if status == lib.RPM_LANE_STALLED:
                self._phase = "frame"
                raise _Deadline
            if status == lib.RPM_LANE_SOCKET:
                raise record_error(-self._native.err)
            # CLOSED, TRUNCATED, or STOPPED (only after a cancellation, which the nursery
            # inside serve() has re-raised before we get here).
            raise PeerClosed(mid_frame=status == lib.RPM_LANE_TRUNCATED)

    def _frame_phase(self) -> None:
        self._phase = "frame"
        self._io.arm(self._frame_timeout)

    async def _serve_one(self) -> None:
        """One control SEND: the C loop handed it over on a lane, or a control connection
        carries it (and nothing else)."""
        reader = self._reader
        if reader.buffered >= HEADER_SIZE:
            self._frame_phase()
            frame = unpack_header(reader.take(HEADER_SIZE))
        else:
            if not reader.buffered:
                self._phase = "idle"
                self._waited = self._empty_timeout if self._empty() else self._idle_timeout
                self._io.arm(self._waited)
                await reader.fill(1)
            self._frame_phase()
            frame = await reader.header()
        self._last_id = frame.id
        if not (frame.op == Op.SEND and frame.imm == SendKind.CONTROL):
            raise Violation(Code.NOT_ALLOWED,
                            f"{Op(frame.op).name} on a control connection (only control SENDs)")
        await self._control_request(frame)

    async def _control_request(self, frame: Frame) -> None:
        if frame.length > MAX_CONTROL:
            raise Violation(Code.TOO_LARGE,
                            f"control SEND of {frame.length} bytes exceeds the limit of {MAX_CONTROL}")
        payload = await self._reader.payload(frame.length)
        try:
            request = json.loads(payload)
        except (ValueError, RecursionError):
            reply: dict[str, object] = {"ok": False, "error": "control message is not JSON"}
        else:
            self._io.arm(math.inf)  # creating a large pool takes a while; the peer is not stalled
            reply = await self._control.handle(self._session, request)
            self._frame_phase()
        await self._reply(Op.SEND_REPLY, frame.id, json.dumps(reply).encode())

    async def _reply(self, op: Op, id_: int, payload: bytes) -> None:
        header = pack_header(op, 0, 0, 0, len(payload), id_, 0)
        await send_all(self._io, [header, payload] if payload else [header])

    async def _error(self, id_: int, code: Code, reason: str, *, close: bool) -> None:
        text = error_text(reason)
        header = pack_header(Op.ERROR, F_CLOSE if close else 0, 0, 0, len(text), id_, code)
        if not close:
            await send_all(self._io, [header, text])
            return
        # Best effort: the connection is going away whether or not the peer hears why.
        self._phase = "error"
        self._io.arm(ERROR_SEND_TIMEOUT)
        try:
            await send_all(self._io, [header, text])
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
