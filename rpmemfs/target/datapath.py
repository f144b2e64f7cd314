"""The target's receive loop for one authenticated connection: the part a NIC would do.

Frames are taken in order. A WRITE is checked (key, bounds, size) from its header alone and
its payload placed into the pool mapping: out of the staging buffer when it came in with
other frames, straight from the socket into the mapping when it is large. A READ is answered
only after everything before it on the connection is placed, because this loop places
frames one after another. Control logic is not on this path: only JSON control requests and
GPSPM flush messages leave it, and they are replied to in order like everything else.

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
from rpmemfs.ranges import merge_ranges
from rpmemfs.target.control import ControlService
from rpmemfs.target.lane_native import NativeLane
from rpmemfs.target.pools import Pool
from rpmemfs.target.sessions import Region, TargetSession
from rpmemfs.transport.sockio import SockIO, record_error
from rpmemfs.transport.stream import STAGING_SIZE, FrameReader, PeerClosed, send_all
from rpmemfs.transport.wire import (
    ATOMIC_SIZE,
    F_CLOSE,
    F_FLUSH,
    FLUSH_COUNT,
    FLUSH_COUNT_SIZE,
    FLUSH_RANGE,
    FLUSH_RANGE_SIZE,
    HEADER_SIZE,
    MAX_CONTROL,
    MAX_READ,
    MAX_SEND,
    MAX_WRITE,
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

log = logging.getLogger("rpmemfs.target.datapath")

# With the appliance method the lane's placed writes are written back before a READ is
# answered; past this many pending ranges they are written back early to bound the list.
MAX_DIRTY = 1024
ERROR_SEND_TIMEOUT = 1.0
# A flush's range list is read this many ranges at a time (what the staging buffer holds).
FLUSH_CHUNK_RANGES = STAGING_SIZE // FLUSH_RANGE_SIZE


class Violation(Exception):
    def __init__(self, code: Code, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Deadline(Exception):
    """The C loop met a deadline; FrameLoop._phase says which."""


class FrameLoop:
    def __init__(
        self,
        io: SockIO,
        reader: FrameReader,
        peer: str,
        session: TargetSession,
        role: Role,
        control: ControlService,
        *,
        apm: bool,
        idle_timeout: float,
        frame_timeout: float,
        native: NativeLane | None = None,
        empty_timeout: float = math.inf,
    ) -> None:
        self._io = io
        self._native = native
        self._reader = reader
        self._peer = peer
        self._session = session
        self._role = role
        self._control = control
        self._apm = apm
        self._idle_timeout = idle_timeout
        # A control connection whose session holds no pool serves nobody while it waits (a
        # mount's always holds its pool): it is closed sooner, so it cannot keep a slot.
        self._empty_timeout = min(empty_timeout, idle_timeout)
        self._waited = idle_timeout  # the idle deadline of the current wait, for the log
        self._frame_timeout = frame_timeout
        self._dirty: list[tuple[Pool, int, int]] = []
        self._last_id = 0
        self._what = "lane" if role == Role.LANE else "control connection"
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
                self._persist_dirty()
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
        """Let the C loop serve frames until it leaves one to this loop."""
        assert self._native is not None
        while True:
            status = await self._native.serve()
            if status == lib.RPM_LANE_HANDOFF:
                return
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
        op = frame.op
        if self._role == Role.CONTROL and not (op == Op.SEND and frame.imm == SendKind.CONTROL):
            raise Violation(Code.NOT_ALLOWED, f"{Op(op).name} on a control connection (only control SENDs)")
        if op == Op.WRITE:
            await self._write(frame)
        elif op == Op.READ:
            await self._read(frame)
        elif op == Op.ATOMIC_WRITE:
            self._atomic_write(frame)
        elif op == Op.SEND:
            await self._send(frame)
        else:
            raise Violation(Code.NOT_ALLOWED, f"{Op(op).name} is not something an initiator sends")

    def _region(self, frame: Frame, length: int) -> Region:
        region = self._session.regions.get(frame.key)
        if region is None:
            raise Violation(Code.BAD_KEY, f"{Op(frame.op).name} with unregistered key 0x{frame.key:08x}")
        if frame.offset + length > region.size:
            raise Violation(
                Code.OUT_OF_BOUNDS,
                f"{Op(frame.op).name} of {length} bytes at offset {frame.offset} is outside "
                f"pool {region.pool.name!r} of {region.size} bytes",
            )
        return region

    def _writable(self, frame: Frame, length: int) -> Region:
        region = self._region(frame, length)
        if not region.writable:
            raise Violation(Code.NOT_ALLOWED, f"{Op(frame.op).name} to pool {region.pool.name!r}, which "
                            "this session opened without claiming it while another initiator owns it")
        return region

    async def _write(self, frame: Frame) -> None:
        length = frame.length
        if length > MAX_WRITE:
            raise Violation(Code.TOO_LARGE, f"WRITE of {length} bytes exceeds the limit of {MAX_WRITE}")
        pool = self._writable(frame, length).pool
        off = frame.offset
        reader = self._reader
        if length <= reader.buffered:
            pool.buf[off : off + length] = reader.take(length)
        else:
            pool.acquire()
            try:
                with pool.buf[off : off + length] as dest:
                    await reader.read_into(dest)
            finally:
                pool.release()
        pool.counters.add("writes")
        pool.counters.add("bytes", length)
        if self._apm:
            self._mark_dirty(pool, off, length)

    async def _read(self, frame: Frame) -> None:
        length = frame.length
        if length > MAX_READ:
            raise Violation(Code.TOO_LARGE, f"READ of {length} bytes exceeds the limit of {MAX_READ}")
        pool = self._region(frame, length).pool
        # Under the appliance method a READ is the flush: a NIC with DDIO off would have
        # placed the writes in the persistence domain, and this loop plays that NIC.
        self._persist_dirty()
        data = bytes(pool.buf[frame.offset : frame.offset + length])
        if frame.flags & F_FLUSH:
            pool.counters.add("flushes")
        else:
            pool.counters.add("reads")
        await self._reply(Op.READ_RESP, frame.id, data)

    def _atomic_write(self, frame: Frame) -> None:
        if frame.length:
            raise Violation(Code.BAD_FRAME, f"ATOMIC_WRITE with length {frame.length} (it has no payload)")
        if frame.offset % ATOMIC_SIZE:
            raise Violation(Code.MISALIGNED, f"ATOMIC_WRITE at offset {frame.offset} is not 8-byte aligned")
        pool = self._writable(frame, ATOMIC_SIZE).pool
        # One aligned 8-byte store through a 'Q' view: no reader can see half of it.
        with pool.buf[frame.offset : frame.offset + ATOMIC_SIZE] as raw, raw.cast("Q") as word:
            word[0] = frame.imm
        pool.counters.add("atomics")
        if self._apm:
            self._mark_dirty(pool, frame.offset, ATOMIC_SIZE)

    async def _send(self, frame: Frame) -> None:
        if frame.imm == SendKind.FLUSH:
            await self._flush(frame)
        elif frame.imm == SendKind.CONTROL:
            await self._control_request(frame)
        else:
            raise Violation(Code.BAD_FRAME, f"SEND of unknown kind {frame.imm}")

    async def _payload(self, frame: Frame, limit: int) -> bytes:
        if frame.length > limit:
            name = Op(frame.op).name
            raise Violation(Code.TOO_LARGE, f"{name} of {frame.length} bytes exceeds the limit of {limit}")
        return await self._reader.payload(frame.length)

    async def _flush(self, frame: Frame) -> None:
        region = self._region(frame, 0)
        pool = region.pool
        # Held across the awaits below, so a close from the control connection cannot unmap
        # the pool between reading the range list and persisting it.
        pool.acquire()
        try:
            await self._flush_pool(frame, region, pool)
        finally:
            pool.release()

    async def _flush_pool(self, frame: Frame, region: Region, pool: Pool) -> None:
        # The range list is read and persisted a staging buffer at a time as it arrives, so
        # what a flush costs the target in memory never depends on what its header claims,
        # and each piece is bounds-checked before any of it is persisted.
        if frame.length > MAX_SEND:
            raise Violation(Code.TOO_LARGE, f"SEND of {frame.length} bytes exceeds the limit of {MAX_SEND}")
        reader = self._reader
        await reader.fill(FLUSH_COUNT_SIZE)
        (count,) = FLUSH_COUNT.unpack(reader.take(FLUSH_COUNT_SIZE))
        if frame.length != FLUSH_COUNT_SIZE + count * FLUSH_RANGE_SIZE:
            raise Violation(
                Code.BAD_FRAME,
                f"flush message of {frame.length} bytes does not hold the {count} ranges it claims",
            )
        failed: OSError | None = None
        left = count
        while left:
            n = min(left, FLUSH_CHUNK_RANGES)
            await reader.fill(n * FLUSH_RANGE_SIZE)
            ranges = list(FLUSH_RANGE.iter_unpack(reader.take(n * FLUSH_RANGE_SIZE)))
            left -= n
            for off, length in ranges:
                if off + length > region.size:
                    raise Violation(
                        Code.OUT_OF_BOUNDS,
                        f"flush range ({off}, {length}) is outside pool {pool.name!r} of {region.size} bytes",
                    )
            if failed is None:
                try:
                    await self._persist_ranges(pool, ranges)
                except OSError as exc:
                    failed = exc  # the rest of the list is still read: the stream stays intact
        if failed is not None:
            # The initiator learns this flush failed and may go on.
            log.error("peer %s: persisting pool %s failed: %s", self._peer, pool.name, failed)
            await self._error(frame.id, Code.IO, f"persist failed on the target: {failed}", close=False)
            return
        pool.counters.add("flushes")
        await self._reply(Op.SEND_REPLY, frame.id, b"")

    async def _persist_ranges(self, pool: Pool, ranges: list[tuple[int, int]]) -> None:
        merged = merge_ranges(ranges)
        if pool.needs_thread(merged):
            self._io.arm(math.inf)  # a slow disk is not a stalled peer
            try:
                await trio.to_thread.run_sync(pool.persist, merged, len(ranges))
            finally:
                self._frame_phase()
        else:
            pool.persist(merged, len(ranges))

    async def _control_request(self, frame: Frame) -> None:
        payload = await self._payload(frame, MAX_CONTROL)
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

    def _mark_dirty(self, pool: Pool, off: int, length: int) -> None:
        self._dirty.append((pool, off, length))
        if len(self._dirty) >= MAX_DIRTY:
            self._persist_dirty()

    def _persist_dirty(self) -> None:
        if not self._dirty:
            return
        by_pool: dict[Pool, list[tuple[int, int]]] = {}
        for pool, off, length in self._dirty:
            by_pool.setdefault(pool, []).append((off, length))
        self._dirty.clear()
        for pool, ranges in by_pool.items():
            if pool.buf.nbytes:  # a pool closed meanwhile was written back at close
                pool.persist(merge_ranges(ranges), len(ranges))
