"""The software transport: RDMA RC semantics over TCP, initiator side.

A session is one control connection plus one TCP connection per lane; TCP's ordering is the
lane's ordering. Every operation builds all of its frames first and hands them to one
sendmsg, so a barrier (its writes and its flush) leaves in one vectored send, with the
write payloads taken from the caller's buffers without a copy.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import trio

from rpmemfs.native import ffi, lib
from rpmemfs.printable import printable
from rpmemfs.ranges import merge_ranges
from rpmemfs.transport.address import format_address, parse_address
from rpmemfs.transport.base import (
    DEFAULT_TIMEOUT,
    BytesLike,
    Lane,
    LaneStats,
    LocalPool,
    LocalRanges,
    Method,
    PackedRanges,
    RemoteRegion,
    Session,
    Ticket,
    Transport,
    TransportError,
    Writes,
    check_range,
    nbytes,
    packed_offsets,
    pairs_of,
)
from rpmemfs.transport.conn import Connection, open_connection
from rpmemfs.transport.control_client import ControlClient, SessionControl
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.transport.protection import protects
from rpmemfs.transport.sockio import Buffer
from rpmemfs.transport.tokens import key_id, local_token, no_token
from rpmemfs.transport.wire import (
    ATOMIC_SIZE,
    F_FLUSH,
    FLUSH_COUNT_SIZE,
    FLUSH_RANGE_SIZE,
    FLUSH_READ_SIZE,
    HEADER_SIZE,
    MAX_CONTROL,
    MAX_FLUSH_RANGES,
    MAX_READ,
    MAX_WRITE,
    Frame,
    Op,
    Role,
    SendKind,
    encode_flush,
    pack_header,
)


@dataclass(slots=True)
class TcpTicket:
    """A posted barrier: the flush's request id and what is left to send."""

    id: int
    rest: list[Buffer]
    locked: bool  # the connection's send lock is held until ``rest`` is sent
    apm: bool  # its flush is a READ (answered by a READ_RESP of 8 bytes), else a SEND
    done: bool = False

    @property
    def reply(self) -> tuple[int, int]:
        """The reply its flush gets: (op, length)."""
        return (Op.READ_RESP, FLUSH_READ_SIZE) if self.apm else (Op.SEND_REPLY, 0)


def _bytes_view(data: BytesLike) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class TcpLane:
    """One ordered stream to the target (see rpmemfs.transport.base.Lane)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.peer = conn.peer
        self.stats = LaneStats()
        self._sent: deque[int] = deque()
        self._scratch_ranges = 0  # ranges the lane's barrier buffers hold (see _scratch)
        self._bufs: tuple[Any, Any, Any] = (ffi.NULL, ffi.NULL, ffi.new("uint64_t *"))

    @property
    def closed(self) -> bool:
        return self._conn.lost

    def _write_frames(
        self, region: RemoteRegion, writes: Sequence[tuple[int, BytesLike]], bufs: list[Buffer]
    ) -> list[tuple[int, int]]:
        """Append header + payload per write (split at MAX_WRITE); returns the ranges written."""
        conn = self._conn
        ranges: list[tuple[int, int]] = []
        for off, data in writes:
            n = nbytes(data)
            check_range(self.peer, region, off, n)
            if not n:
                continue
            view = _bytes_view(data)
            for pos in range(0, n, MAX_WRITE):
                chunk = min(MAX_WRITE, n - pos)
                bufs.append(pack_header(Op.WRITE, 0, region.key, off + pos, chunk, conn.new_id(), 0))
                bufs.append(view[pos : pos + chunk] if chunk != n else view)
            ranges.append((off, n))
            self.stats.writes += 1
            self.stats.bytes += n
        return ranges

    def _flush_read_frame(self, region: RemoteRegion, bufs: list[Buffer]) -> int:
        if region.size < FLUSH_READ_SIZE:
            raise TransportError(self.peer, f"pool {region.name!r} is too small for a flush read")
        id_ = self._conn.new_id()
        bufs.append(pack_header(Op.READ, F_FLUSH, region.key, 0, FLUSH_READ_SIZE, id_, 0))
        return id_

    def _flush_send_frame(
        self, region: RemoteRegion, ranges: Sequence[tuple[int, int]], bufs: list[Buffer]
    ) -> int:
        for off, length in ranges:
            check_range(self.peer, region, off, length)
        payload = encode_flush(merge_ranges(ranges, MAX_FLUSH_RANGES))
        id_ = self._conn.new_id()
        bufs.append(pack_header(Op.SEND, 0, region.key, 0, len(payload), id_, SendKind.FLUSH))
        bufs.append(payload)
        return id_

    async def _post(self, bufs: list[Buffer]) -> None:
        self.stats.batches += 1
        self.stats.sendmsgs += await self._conn.post(bufs)

    async def _call(self, bufs: list[Buffer], id_: int) -> tuple[Frame, bytes]:
        self.stats.batches += 1
        calls, frame, payload = await self._conn.call(bufs, id_)
        self.stats.sendmsgs += calls
        return frame, payload

    # Frame-level operations outside the Lane interface: tests use them to send what a
    # barrier never would (writes with no flush behind them, a flush by itself).

    async def post_writes(self, region: RemoteRegion, writes: Sequence[tuple[int, BytesLike]]) -> None:
        """WRITE frames, all in one vectored send; nothing is awaited from the target."""
        bufs: list[Buffer] = []
        self._write_frames(region, writes, bufs)
        if bufs:
            await self._post(bufs)

    async def flush_read(self, region: RemoteRegion) -> None:
        """The appliance flush alone: an 8-byte READ answered after every earlier write."""
        bufs: list[Buffer] = []
        await self._call(bufs, self._flush_read_frame(region, bufs))
        self.stats.flushes += 1

    async def flush_send(self, region: RemoteRegion, ranges: Sequence[tuple[int, int]]) -> None:
        """The general-purpose flush alone: one SEND listing the ranges; returns once persisted."""
        bufs: list[Buffer] = []
        await self._call(bufs, self._flush_send_frame(region, ranges, bufs))
        self.stats.flushes += 1

    # --- the Lane interface -----------------------------------------------------------------

    def post(self, region: RemoteRegion, writes: Writes, method: Method | None = None) -> TcpTicket:
        if isinstance(writes, LocalRanges):
            # Ranges of the local pool, each to the same remote offset: the frames are built
            # and sent in C, with no Python object per range.
            return self._post_native(region, writes.pool, writes.ranges, None, method)
        if isinstance(writes, PackedRanges):
            data, ranges = writes.data, writes.ranges
            packed, src = LocalPool(memoryview(data), ffi.from_buffer(data)), packed_offsets(data, ranges)
            return self._post_native(region, packed, ranges, src, method)
        return self._post_frames(region, writes, method)

    def _post_frames(
        self, region: RemoteRegion, writes: Sequence[tuple[int, BytesLike]], method: Method | None = None
    ) -> TcpTicket:
        method = method or region.method
        if method not in ("apm", "gpspm"):
            raise ValueError(f"unknown persistence method {method!r}")
        bufs: list[Buffer] = []
        ranges = self._write_frames(region, writes, bufs)
        if method == "apm":
            id_ = self._flush_read_frame(region, bufs)
        else:
            id_ = self._flush_send_frame(region, ranges, bufs)
        self.stats.batches += 1
        rest, calls, locked = self._conn.send_nowait(bufs)
        self.stats.sendmsgs += calls
        return TcpTicket(id_, rest, locked, method == "apm")

    def _post_native(
        self, region: RemoteRegion, local: LocalPool, ranges: Sequence[tuple[int, int]],
        src: list[int] | None, method: Method | None,
    ) -> TcpTicket:
        """Range i's bytes at local.buf[src[i]:], or without src at its own offset. Every
        replication barrier comes here: the ranges are checked and the frames built and sent
        in C, from buffers kept per lane."""
        method = method or region.method
        n, size = len(ranges), region.size

        def writes() -> list[tuple[int, BytesLike]]:
            where = src if src is not None else [o for o, _ in ranges]
            return [(o, local.buf[s : s + k]) for (o, k), s in zip(ranges, where, strict=True)]

        if not 0 < n <= MAX_FLUSH_RANGES or method not in ("apm", "gpspm"):
            return self._post_frames(region, writes(), method)
        pairs = pairs_of(ranges)
        if lib.rpm_ranges_bad(pairs, n, size) >= 0:
            return self._post_frames(region, writes(), method)  # checks each, says what is wrong
        apm = method == "apm"
        if apm and size < FLUSH_READ_SIZE:
            raise TransportError(self.peer, f"pool {region.name!r} is too small for a flush read")
        conn = self._conn
        hdrs, flist, total = self._scratch(n)
        first = conn.new_ids(n + 1)
        srcs = ffi.new("uint64_t[]", src) if src is not None else ffi.NULL

        def send(fd: int) -> tuple[int, int]:
            got = lib.rpm_post_barrier(conn.io.sec if fd >= 0 else ffi.NULL, fd, local.base, srcs, pairs, n,
                                       region.key, size, first, apm, hdrs, flist, total)
            if got < 0:
                raise OSError(-got, os.strerror(-got))
            return got, total[0]

        def rebuild() -> list[Buffer]:
            # Copies of the headers and the flush list: the lane's buffers serve its next barrier.
            raw = ffi.buffer(hdrs)
            bufs: list[Buffer] = []
            for i, (_, view) in enumerate(writes()):
                bufs += [raw[HEADER_SIZE * i : HEADER_SIZE * (i + 1)], view]
            bufs.append(raw[HEADER_SIZE * n : HEADER_SIZE * (n + 1)])
            if not apm:
                bufs.append(ffi.buffer(flist)[: FLUSH_COUNT_SIZE + FLUSH_RANGE_SIZE * n])
            return bufs

        sent = conn.send_native(send, rebuild)
        if sent is None:  # another task's frames are half out: ours go after them
            send(-1)  # build them
            rest, locked = rebuild(), False
        else:
            rest, locked = sent
        stats = self.stats
        stats.batches += 1
        stats.sendmsgs += 1
        stats.writes += n
        framing = HEADER_SIZE * (n + 1) + (0 if apm else FLUSH_COUNT_SIZE + FLUSH_RANGE_SIZE * n)
        stats.bytes += total[0] - framing
        return TcpTicket(first + n, rest, locked, apm)

    def _scratch(self, n: int) -> tuple[Any, Any, Any]:
        """The lane's buffers for a barrier of ``n`` ranges: headers, flush list, total."""
        if n > self._scratch_ranges:
            self._scratch_ranges = max(n, 2 * self._scratch_ranges)
            k = self._scratch_ranges
            self._bufs = (ffi.new("uint8_t[]", HEADER_SIZE * (k + 1)),
                          ffi.new("uint8_t[]", FLUSH_COUNT_SIZE + FLUSH_RANGE_SIZE * k), self._bufs[2])
        return self._bufs

    def poll(self, ticket: Ticket) -> bool:
        assert isinstance(ticket, TcpTicket)
        if ticket.done:
            return True
        if ticket.rest:
            return False
        conn = self._conn
        got = conn.take_reply_nowait(ticket.id, *ticket.reply)
        if not got or (got == 2 and conn.reply_nowait(ticket.id) is None):
            return False
        ticket.done = True
        self.stats.flushes += 1
        return True

    async def wait(self, ticket: Ticket) -> None:
        assert isinstance(ticket, TcpTicket)
        if ticket.done:
            return
        conn = self._conn
        if ticket.rest:
            rest, ticket.rest = ticket.rest, []
            self.stats.sendmsgs += await conn.finish_send(rest, ticket.locked)
        if not await conn.take_reply(ticket.id, *ticket.reply):
            await conn.reply(ticket.id)
        ticket.done = True
        self.stats.flushes += 1

    async def read(self, region: RemoteRegion, offset: int, length: int) -> bytes:
        check_range(self.peer, region, offset, length)
        bufs: list[Buffer] = []
        ids: list[tuple[int, int]] = []
        for pos in range(0, length, MAX_READ):
            chunk = min(MAX_READ, length - pos)
            id_ = self._conn.new_id()
            bufs.append(pack_header(Op.READ, 0, region.key, offset + pos, chunk, id_, 0))
            ids.append((id_, chunk))
        if not bufs:
            return b""
        # The first reply under the same deadline as the send, the rest one by one.
        first = await self._call(bufs, ids[0][0])
        parts: list[bytes] = []
        for id_, chunk in ids:
            frame, payload = first if id_ == ids[0][0] else await self._conn.reply(id_)
            if frame.op != Op.READ_RESP or len(payload) != chunk:
                self._conn.lose(f"target answered a read of {chunk} bytes with {len(payload)}")
                self._conn.check()
            parts.append(payload)
        self.stats.reads += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def atomic_write(self, region: RemoteRegion, offset: int, value: int) -> None:
        check_range(self.peer, region, offset, ATOMIC_SIZE)
        if offset % ATOMIC_SIZE:
            raise TransportError(self.peer, f"atomic write offset {offset} is not 8-byte aligned")
        if not 0 <= value < 1 << 64:
            raise TransportError(self.peer, f"atomic write value {value} does not fit 64 bits")
        await self._post([pack_header(Op.ATOMIC_WRITE, 0, region.key, offset, 0, self._conn.new_id(), value)])
        self.stats.atomics += 1

    async def _send_control(self, msg: bytes) -> int:
        if len(msg) > MAX_CONTROL:
            raise TransportError(self.peer, f"message of {len(msg)} bytes exceeds {MAX_CONTROL}")
        id_ = self._conn.new_id()
        await self._post([pack_header(Op.SEND, 0, 0, 0, len(msg), id_, SendKind.CONTROL), msg])
        self.stats.sends += 1
        return id_

    async def send(self, msg: bytes) -> None:
        self._sent.append(await self._send_control(msg))

    async def recv(self) -> bytes:
        if not self._sent:
            raise TransportError(self.peer, "recv() with no message sent to answer it")
        _, payload = await self._conn.reply(self._sent.popleft())
        return payload

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A JSON control request and its reply; a refusal raises TransportError (lane intact)."""
        id_ = await self._send_control(json.dumps(msg).encode())
        _, payload = await self._conn.reply(id_)
        try:
            reply = json.loads(payload)
        except ValueError:
            self._conn.lose("target sent a control reply that is not JSON")
            self._conn.check()
        if not isinstance(reply, dict):
            raise TransportError(self.peer, "target sent a control reply that is not an object")
        if not reply.get("ok"):
            raise TransportError(self.peer, printable(str(reply.get("error", "request refused"))))
        return reply

    async def aclose(self) -> None:
        self._conn.lose("lane closed")


class TcpSession(SessionControl):
    """A session with one target: the control connection and its lanes; the control
    operations go through ``ops`` (control_client.py) on the control connection."""

    def __init__(
        self,
        control: TcpLane,
        host: str,
        port: int,
        token: bytes,
        session_id: bytes,
        info: dict[str, Any],
        timeout: float,
        protect: bool = True,
    ) -> None:
        self._control = control
        self.ops = ControlClient(control)
        self._protect = protect
        self._host = host
        self._port = port
        self._token = token
        self.session_id = session_id
        self.peer = control.peer
        self.info = info
        self.timeout = timeout
        self.lanes: list[TcpLane] = []

    async def open_lane(self) -> TcpLane:
        conn, _, _ = await open_connection(
            self._host, self._port, self.peer, self._token, Role.LANE, self.session_id, self.timeout,
            self._protect,
        )
        lane = TcpLane(conn)
        self.lanes.append(lane)
        return lane

    async def aclose(self) -> None:
        # Closing the control connection ends the session: the target drops its lanes and
        # registrations and persists the pools it closes.
        for lane in self.lanes:
            await lane.aclose()
        await self._control.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()


async def connect(
    address: str, token: bytes | None = None, *, lanes: int = 1, timeout: float = DEFAULT_TIMEOUT,
    wire_protection: str = DEFAULT_PROTECTION,
) -> TcpSession:
    """A session with ``lanes`` lanes open to ``address`` (HOST:PORT), protected as asked."""
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise TransportError(address, str(exc)) from None
    peer = format_address(host, port)
    secret = token if token is not None else local_token()
    if secret is None:
        raise TransportError(peer, no_token())
    try:
        protect = protects(wire_protection)
    except ValueError as exc:
        raise TransportError(peer, str(exc)) from None
    # A control HELLO names the token it proves with where a lane's names its session.
    conn, session_id, info = await open_connection(
        host, port, peer, secret, Role.CONTROL, key_id(secret), timeout, protect
    )
    session = TcpSession(TcpLane(conn), host, port, secret, session_id, info, timeout, protect)
    try:
        for _ in range(lanes):
            await session.open_lane()
    except BaseException:
        await session.aclose()
        raise
    return session


@dataclass
class TcpTransport:
    """The TCP transport as an object, for code that picks a transport at run time."""

    name = "tcp"
    wire_protection: str = DEFAULT_PROTECTION  # what its connections ask for (protection.py)

    async def connect(
        self, address: str, token: bytes | None = None, *, lanes: int = 1, timeout: float = DEFAULT_TIMEOUT
    ) -> TcpSession:
        return await connect(address, token, lanes=lanes, timeout=timeout,
                             wire_protection=self.wire_protection)


if TYPE_CHECKING:
    # The type checker proves here that this transport implements the one interface.
    _transport: Transport = TcpTransport()

    def _is_session(s: TcpSession) -> Session:
        return s

    def _is_lane(lane: TcpLane) -> Lane:
        return lane
