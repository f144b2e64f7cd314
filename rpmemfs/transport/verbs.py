"""The verbs transport, initiator side: real RDMA through pyverbs (rdma-core).

A session is the software transport's control connection (TCP: version handshake, token
challenge-response, JSON control requests) plus one RC queue pair per lane, connected with
rdmacm. The control plane enables verbs for the session (the target gives it a protection
domain of its own) and, for each pool opened with ``rdma``, registers the pool's mapping in
it and answers with the rkey and the address. A lane's connect request carries the session
id, a 16-byte secret only the authenticated control connection has seen; the target accepts
a queue pair only into a live session, so a queue pair reaches only the pools its session
opened, and only while it lives.

A barrier is one chain of work requests handed to ibv_post_send: unsignaled RDMA WRITEs of
the ranges from the local pool (registered once per session; inline when tiny), then one
flush: a signaled 8-byte RDMA READ (appliance method: the responder answers it only after
every earlier WRITE on the queue pair is placed) or a SEND of the whole range list, which the
target persists and answers with a SEND (general-purpose method); for an appliance target
whose lanes can all post it (rdma-core 45+ and Linux 6.2+ at both ends: method "flush"), a
signaled native RDMA FLUSH of the written span instead of the READ, posted through an
extended queue pair: of the persistent type (IBV_FLUSH_PERSISTENT) where the pool's
registration allows it (the target says so per pool: persistent memory on a device that
grants it) and this end's device has it, else of the global-visibility type. One completion
is awaited per barrier: the READ's, the FLUSH's, or the reply's receive. Waiting is trio
waiting for the completion channel's descriptor, after a short busy poll of the completion
queue.

Why this module is long: a lane is one state machine (send queue slots, request credits,
tickets waiting to be posted, replies by sequence number) whose posting half and completion
half change together, and the session beside it opens those lanes and lends them its
protection domain and registrations; split apart, each half would reach into the other's
state. pyverbs plumbing that does not need that state is in rdma.py already.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import trio

from rpmemfs.printable import printable
from rpmemfs.ranges import merge_ranges
from rpmemfs.transport import rdma
from rpmemfs.transport.address import parse_address
from rpmemfs.transport.base import (
    DEFAULT_TIMEOUT,
    BytesLike,
    Flush,
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
    unpack,
)
from rpmemfs.transport.control_client import SessionControl
from rpmemfs.transport.control_ops import REGION_FLUSH_TYPES
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.transport.tcp import TcpSession
from rpmemfs.transport.tcp import connect as tcp_connect
from rpmemfs.transport.verbs_config import VerbsSettings
from rpmemfs.transport.wire import ATOMIC_SIZE, FLUSH_READ_SIZE

log = logging.getLogger("rpmemfs.transport.verbs")

RESOLVE_MS = 5000


@dataclass(eq=False)
class VerbsTicket:
    """A posted barrier (or read, or writes): what ends it, and what is not posted yet."""

    flush: bool  # its completion counts as a flush
    end_wr: int | None = None  # the work request whose completion ends it (else: a reply)
    rest: list[Any] = field(default_factory=list)  # chains of work requests, or a _Flush, to post
    keep: list[Any] = field(default_factory=list)  # memory its work requests point into
    done: bool = False
    error: TransportError | None = None


@dataclass(frozen=True)
class _Flush:
    """A general-purpose flush not posted yet: it needs a credit (a receive the target keeps
    posted for it), so it is built only when one is free."""

    region: RemoteRegion
    ranges: list[tuple[int, int]]


class _LocalRegions:
    """Local memory registered in the session's protection domain, found by address."""

    def __init__(self, pd: Any) -> None:
        self.pd = pd
        self._mrs: list[tuple[int, int, Any]] = []  # (start, end, MR)

    def register(self, addr: int, length: int) -> Any:
        mr = self.find(addr, length)
        if mr is None:
            # The source of WRITEs (and of nothing else): local access only.
            mr = rdma.MR(self.pd, length, rdma.e.IBV_ACCESS_LOCAL_WRITE, address=addr)
            self._mrs.append((addr, addr + length, mr))
        return mr

    def find(self, addr: int, length: int) -> Any | None:
        for start, end, mr in self._mrs:
            if start <= addr and addr + length <= end:
                return mr
        return None

    def close(self) -> None:
        for _, _, mr in self._mrs:
            mr.close()
        self._mrs.clear()


class VerbsLane:
    """One queue pair to the target (see rpmemfs.transport.base.Lane)."""

    def __init__(self, peer: str, events: rdma.EventChannel, cmid: Any, qp: rdma.QueuePair,
                 local: _LocalRegions, credits: int, timeout: float, spin_us: int) -> None:
        self.peer = peer
        self.stats = LaneStats()
        self._events = events
        self._cmid = cmid
        self._qp = qp
        self._local = local
        self._timeout = timeout
        self._spin_s = spin_us / 1e6
        self._credits = credits
        self._lost: str | None = None
        self._next_wr = 0
        self._seq = 0
        # Posted work requests hold send queue slots until a signaled one at or after them
        # completes (the queue is ordered); every chain posted ends with a signaled one.
        self._sq_used = 0
        self._signaled: dict[int, tuple[int, VerbsTicket | None]] = {}  # wr_id -> (slots, ends)
        self._replies: dict[int, VerbsTicket | None] = {}  # seq -> ticket (None: a recv())
        self._answers: dict[int, tuple[int, bytes]] = {}  # seq -> (errno, payload), for recv()
        self._inflight = 0  # requests not answered yet: at most ``credits``
        self._sent: deque[int] = deque()
        self._waiting: deque[VerbsTicket] = deque()  # in posting order
        # Receive slots for replies, then send slots for requests too large to go inline.
        self._msgs = rdma.MR(local.pd, rdma.MSG_SIZE * 2 * credits, rdma.e.IBV_ACCESS_LOCAL_WRITE)
        self._free_sends = list(range(credits))
        self._send_slot: dict[int, int] = {}  # seq -> send slot it holds until answered
        self._scratch = rdma.MR(local.pd, 64, rdma.e.IBV_ACCESS_LOCAL_WRITE)  # flush READs land here
        for slot in range(credits):
            self._qp.post_recv(self._msgs, slot * rdma.MSG_SIZE, rdma.MSG_SIZE, slot)
        self._read_wrs: dict[int, Any] = {}  # region key -> its flush READ, reused
        # (region key, persistent type?) -> its native FLUSH, re-aimed: the type is part of
        # the request, and a caller may end barriers to one region with either.
        self._flush_wrs: dict[tuple[int, bool], Any] = {}
        self._last_local: tuple[LocalPool, int, Any] | None = None  # (pool, address, MR)

    @property
    def closed(self) -> bool:
        return self._lost is not None

    @property
    def native_flush(self) -> bool:
        """Whether barriers may use method "flush" (native RDMA FLUSH) on this lane."""
        return self._qp.extended

    # --- completions ------------------------------------------------------------------------

    def _lose(self, reason: str) -> TransportError:
        if self._lost is None:
            self._lost = reason
            log.info("lane to %s lost: %s", self.peer, reason)
            try:
                self._qp.to_error()
            except rdma.PyverbsError:
                pass
        err = TransportError(self.peer, self._lost, lane_lost=True)
        pending = [t for _, t in self._signaled.values() if t] + [t for t in self._replies.values() if t]
        for ticket in [*pending, *self._waiting]:
            if not ticket.done:
                ticket.error = err
        return err

    def _check(self) -> None:
        if self._lost is not None:
            raise TransportError(self.peer, self._lost, lane_lost=True)

    def _process(self, wcs: list[Any]) -> None:
        for wc in wcs:
            why = rdma.failed(wc)
            if why is not None:
                self._lose(why)
            elif wc.opcode == rdma.e.IBV_WC_RECV:
                self._on_reply(wc)
            else:
                slots, ticket = self._signaled.pop(wc.wr_id, (0, None))
                self._sq_used -= slots
                if ticket is not None:
                    ticket.done = True
                    if ticket.flush:
                        self.stats.flushes += 1
        self._post_waiting()

    def _on_reply(self, wc: Any) -> None:
        slot = wc.wr_id
        data = self._msgs.read(wc.byte_len, slot * rdma.MSG_SIZE)
        try:
            self._qp.post_recv(self._msgs, slot * rdma.MSG_SIZE, rdma.MSG_SIZE, slot)
            seq, status, payload = rdma.unpack_reply(data)
        except (rdma.VerbsError, rdma.PyverbsError) as exc:
            self._lose(f"bad reply from the target: {exc}")
            return
        if seq not in self._replies:
            self._lose(f"the target answered request {seq}, which is not outstanding")
            return
        ticket = self._replies.pop(seq)
        self._inflight -= 1
        if (used := self._send_slot.pop(seq, None)) is not None:
            self._free_sends.append(used)
        if ticket is None:
            self._answers[seq] = (status, payload)
            return
        if status:
            text = payload.decode(errors="replace") or f"errno {status}"
            ticket.error = TransportError(self.peer, f"the target could not persist the ranges: {text}",
                                          code=status)
        ticket.done = True
        self.stats.flushes += 1

    def _drain(self) -> None:
        try:
            self._process(self._qp.poll())
        except rdma.PyverbsError as exc:
            raise self._lose(f"polling the completion queue failed: {exc}") from None

    async def _until(self, ready: Any, what: str) -> None:
        """Poll, spin briefly, then sleep on the completion channel until ``ready()``; past
        the session timeout the lane is lost (its state is unknown)."""
        self._drain()
        if ready():
            return
        spin_until = time.monotonic() + self._spin_s
        while time.monotonic() < spin_until:
            self._drain()
            if ready():
                return
        try:
            with trio.fail_after(self._timeout):
                while True:
                    try:
                        self._process(self._qp.completions())
                    except rdma.PyverbsError as exc:
                        raise self._lose(f"reading completions failed: {exc}") from None
                    if ready():
                        return
                    self._check_events()
                    await trio.lowlevel.wait_readable(self._qp.fd)
        except trio.TooSlowError:
            raise self._lose(f"no completion for {what} within {self._timeout:g}s") from None

    def _check_events(self) -> None:
        """Any rdmacm event on an established lane (DISCONNECTED, mostly) means it is over."""
        try:
            ev = self._events.next()
        except rdma.PyverbsError as exc:
            raise self._lose(f"reading rdmacm events failed: {exc}") from None
        if ev is not None and ev.kind != rdma.ce.RDMA_CM_EVENT_ESTABLISHED:
            raise self._lose(f"rdmacm event {ev.name}: the target went away")

    # --- posting ----------------------------------------------------------------------------

    def _wr_id(self) -> int:
        self._next_wr += 1
        return self._next_wr

    def _room(self, n: int) -> bool:
        return self._sq_used + n <= rdma.SEND_DEPTH

    def _postable_now(self, writes: int) -> bool:
        """Whether ``writes`` WRITEs and one flush request can be posted at once, in one chain
        (nothing queued ahead, room in the send queue); else they go through _submit."""
        return not self._waiting and self._room(writes + 1) and writes < rdma.SEND_DEPTH // 2

    def _post(self, chain: list[Any], ticket: VerbsTicket) -> None:
        """One ibv_post_send of ``chain``, its last work request signaled."""
        last = chain[-1]
        last.send_flags = last.send_flags | rdma.e.IBV_SEND_SIGNALED
        try:
            self._qp.post_send(chain)
        except rdma.PyverbsError as exc:
            raise self._lose(f"ibv_post_send failed: {exc}") from None
        self._sq_used += len(chain)
        self._signaled[last.wr_id] = (len(chain), ticket if last.wr_id == ticket.end_wr else None)

    def _flush_wr(self, flush: _Flush, ticket: VerbsTicket) -> Any:
        """The SEND of a general-purpose flush: inline when the list is short, else from a
        send slot held until the reply (by then the target has the message whole)."""
        self._seq += 1
        seq = self._seq
        msg = rdma.pack_flush(flush.region.key, seq, merge_ranges(flush.ranges, rdma.MAX_FLUSH_RANGES))
        self._replies[seq] = ticket
        return self._send_wr(seq, msg, ticket)

    def _send_wr(self, seq: int, msg: bytes, ticket: VerbsTicket) -> Any:
        self._inflight += 1
        if len(msg) <= rdma.MAX_INLINE:
            ticket.keep.append(msg)  # copied into the work request when it is posted
            return rdma.send_wr(self._wr_id(), rdma.address_of(msg), len(msg), 0, signaled=True)
        slot = self._free_sends.pop()
        self._send_slot[seq] = slot
        offset = (self._credits + slot) * rdma.MSG_SIZE
        self._msgs.write(msg, len(msg), offset)
        return rdma.send_wr(self._wr_id(), self._msgs.buf + offset, len(msg), self._msgs.lkey, signaled=True)

    def _submit(self, ticket: VerbsTicket, items: list[Any]) -> None:
        """Queue the ticket's chains (and flush) behind earlier ones, and post what fits."""
        ticket.rest = [item for item in items if item]
        self._waiting.append(ticket)
        self._post_waiting()

    def _post_waiting(self) -> None:
        """Post queued work in order while the send queue has room and, for a general-purpose
        flush, a credit is free. A chain followed by its flush goes in one post."""
        half = rdma.SEND_DEPTH // 2
        while self._waiting and self._lost is None:
            ticket = self._waiting[0]
            while ticket.rest:
                item = ticket.rest[0]
                if isinstance(item, _Flush):
                    if self._inflight >= self._credits or not self._room(1):
                        return
                    ticket.rest.pop(0)
                    self._post([self._flush_wr(item, ticket)], ticket)
                    continue
                if len(item) > half:  # longer than the queue could ever take at once
                    ticket.rest[0:1] = [item[i : i + half] for i in range(0, len(item), half)]
                    continue
                if not self._room(len(item)):
                    return
                chain = ticket.rest.pop(0)
                flush = ticket.rest[0] if ticket.rest else None
                credit = self._inflight < self._credits
                if isinstance(flush, _Flush) and credit and self._room(len(chain) + 1):
                    ticket.rest.pop(0)
                    chain = [*chain, self._flush_wr(flush, ticket)]
                self._post(chain, ticket)
            self._waiting.popleft()

    # --- building ---------------------------------------------------------------------------

    def _writes_local(self, region: RemoteRegion, mr: Any, base: int,
                      ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """WRITEs of [base + off, + length) to the same offsets of the remote pool."""
        wrs = []
        for off, length in ranges:
            check_range(self.peer, region, off, length)
            for pos in range(0, length, rdma.MAX_RDMA):
                n = min(rdma.MAX_RDMA, length - pos)
                wrs.append(rdma.write_wr(self._wr_id(), base + off + pos, n, mr.lkey, region.rkey,
                                         region.raddr + off + pos, inline=n <= rdma.MAX_INLINE))
            if length:
                self.stats.writes += 1
                self.stats.bytes += length
        return wrs

    def _writes(self, region: RemoteRegion, writes: Sequence[tuple[int, BytesLike]],
                keep: list[Any]) -> tuple[list[Any], list[tuple[int, int]]]:
        """WRITEs of arbitrary buffers: straight from registered memory (the local pool) when
        they lie in it, else through one staging region for the rest."""
        for off, data in writes:
            check_range(self.peer, region, off, nbytes(data))
        wrs: list[Any] = []
        ranges: list[tuple[int, int]] = []
        staged: list[tuple[int, BytesLike]] = []
        for off, data in writes:
            n = nbytes(data)
            if not n:
                continue
            ranges.append((off, n))
            addr = rdma.address_of(data)
            mr = self._local.find(addr, n)
            if mr is None:
                staged.append((off, data))
            else:
                wrs += self._writes_local(region, mr, addr - off, [(off, n)])
        if staged:
            stage = rdma.MR(self._local.pd, sum(nbytes(d) for _, d in staged), rdma.e.IBV_ACCESS_LOCAL_WRITE)
            keep.append(stage)
            pos = 0
            for off, data in staged:
                n = nbytes(data)
                stage.write(bytes(data), n, pos)
                wrs += self._writes_local(region, stage, stage.buf + pos - off, [(off, n)])
                pos += n
        return wrs, ranges

    def _barrier(self, region: RemoteRegion, wrs: list[Any], ranges: Sequence[tuple[int, int]],
                 method: Method | None) -> VerbsTicket:
        self._check()
        method = method or region.method
        ticket = VerbsTicket(flush=True)
        if method == "apm":
            if region.size < FLUSH_READ_SIZE:
                raise TransportError(self.peer, f"pool {region.name!r} is too small for a flush read")
            # A work request object posted at once may be posted again: reuse the region's.
            at_once = self._postable_now(len(wrs))
            read = self._read_wrs.get(region.key) if at_once else None
            if read is None:
                read = rdma.read_wr(self._wr_id(), self._scratch.buf, FLUSH_READ_SIZE, self._scratch.lkey,
                                    region.rkey, region.raddr)
                if at_once:
                    self._read_wrs[region.key] = read
            else:
                read.wr_id = self._wr_id()
            ticket.end_wr = read.wr_id
            wrs.append(read)
            if at_once:
                self._post(wrs, ticket)
            else:
                self._submit(ticket, [wrs])
        elif method == "gpspm":
            self._submit(ticket, [wrs, _Flush(region, list(ranges))])
        elif method == "flush":
            if not self._qp.extended:
                raise TransportError(self.peer, "no native RDMA FLUSH on this lane (it needs rdma-core 45+ "
                                     "and Linux 6.2+ at both ends)")
            persistent = region.native == "persistent"
            spans = [(off, n) for off, n in ranges if n] or [(0, min(FLUSH_READ_SIZE, region.size))]
            start = min(off for off, _ in spans)
            end = max(off + n for off, n in spans)
            at_once = end - start <= rdma.MAX_RDMA and self._postable_now(len(wrs))
            if at_once:
                # As with the READ: one FLUSH request object per region, re-aimed each time
                # (building a pyverbs work request costs more than posting it).
                flush = self._flush_wrs.get((region.key, persistent))
                if flush is None:
                    flush = self._flush_wrs[region.key, persistent] = rdma.flush_wr(
                        0, region.rkey, region.raddr, 8, persistent)
                rdma.aim_flush(flush, self._wr_id(), region.raddr + start, end - start)
                ticket.end_wr = flush.wr_id
                self._post([*wrs, flush], ticket)
            else:
                flushes = [rdma.flush_wr(self._wr_id(), region.rkey, region.raddr + pos,
                                         min(rdma.MAX_RDMA, end - pos), persistent)
                           for pos in range(start, end, rdma.MAX_RDMA)]
                for wr in flushes[:-1]:
                    wr.send_flags = 0  # completions come in order: the last one's says all
                ticket.end_wr = flushes[-1].wr_id
                self._submit(ticket, [[*wrs, *flushes]])
        else:
            raise ValueError(f"unknown persistence method {method!r}")
        self.stats.batches += 1
        return ticket

    # --- the Lane interface -----------------------------------------------------------------

    def post(self, region: RemoteRegion, writes: Writes, method: Method | None = None) -> VerbsTicket:
        self._check()
        if isinstance(writes, LocalRanges):
            if self._last_local is not None and self._last_local[0] is writes.pool:
                _, base, mr = self._last_local
            else:
                base = rdma.address_of(writes.pool.buf)
                mr = self._local.register(base, len(writes.pool.buf))
                self._last_local = (writes.pool, base, mr)
            return self._barrier(region, self._writes_local(region, mr, base, writes.ranges), writes.ranges,
                                 method)
        if isinstance(writes, PackedRanges):
            writes = unpack(writes.data, writes.ranges)
        keep: list[Any] = []
        wrs, ranges = self._writes(region, writes, keep)
        ticket = self._barrier(region, wrs, ranges, method)
        ticket.keep += keep
        return ticket

    def poll(self, ticket: Ticket) -> bool:
        assert isinstance(ticket, VerbsTicket)
        if not ticket.done and ticket.error is None:
            self._drain()
        if ticket.error is not None:
            raise ticket.error
        return ticket.done

    async def wait(self, ticket: Ticket) -> None:
        assert isinstance(ticket, VerbsTicket)
        await self._until(lambda: ticket.done or ticket.error is not None, "a barrier")
        if ticket.error is not None:
            raise ticket.error

    async def _post_writes(self, region: RemoteRegion, writes: Sequence[tuple[int, BytesLike]]) -> None:
        """The writes, without a flush. Returns once the device has taken them from their
        buffers (the completion of the last one), which says nothing of durability."""
        self._check()
        ticket = VerbsTicket(flush=False)
        wrs, _ = self._writes(region, writes, ticket.keep)
        if not wrs:
            return
        ticket.end_wr = wrs[-1].wr_id
        self._submit(ticket, [wrs])
        self.stats.batches += 1
        await self.wait(ticket)

    async def read(self, region: RemoteRegion, offset: int, length: int) -> bytes:
        check_range(self.peer, region, offset, length)
        self._check()
        if not length:
            return b""
        dest = rdma.MR(self._local.pd, length, rdma.e.IBV_ACCESS_LOCAL_WRITE)
        try:
            ticket = VerbsTicket(flush=False, keep=[dest])
            chain = [rdma.read_wr(self._wr_id(), dest.buf + pos, min(rdma.MAX_RDMA, length - pos), dest.lkey,
                                  region.rkey, region.raddr + offset + pos)
                     for pos in range(0, length, rdma.MAX_RDMA)]
            for wr in chain[:-1]:
                wr.send_flags = 0  # completions come in order: the last one's says all
            ticket.end_wr = chain[-1].wr_id
            self._submit(ticket, [chain])
            await self.wait(ticket)
            self.stats.reads += 1
            return bytes(dest.read(length, 0))
        finally:
            if self._lost is None:
                dest.close()

    async def atomic_write(self, region: RemoteRegion, offset: int, value: int) -> None:
        """An 8-byte aligned store ordered like a write: an inline 8-byte RDMA WRITE (rxe on
        Linux 6.1 has no IBV_WR_ATOMIC_WRITE; it places an aligned 8-byte write whole)."""
        check_range(self.peer, region, offset, ATOMIC_SIZE)
        if offset % ATOMIC_SIZE:
            raise TransportError(self.peer, f"atomic write offset {offset} is not 8-byte aligned")
        if not 0 <= value < 1 << 64:
            raise TransportError(self.peer, f"atomic write value {value} does not fit 64 bits")
        await self._post_writes(region, [(offset, value.to_bytes(8, "little"))])
        self.stats.writes -= 1
        self.stats.bytes -= ATOMIC_SIZE
        self.stats.atomics += 1

    async def send(self, msg: bytes) -> None:
        """A control message (JSON for the target's control service) as a SEND on this lane."""
        self._check()
        if len(msg) > rdma.MAX_MESSAGE:
            raise TransportError(self.peer, f"message of {len(msg)} bytes exceeds {rdma.MAX_MESSAGE}")
        await self._until(lambda: self._inflight < self._credits or self._lost, "a request credit")
        self._check()
        self._seq += 1
        seq = self._seq
        ticket = VerbsTicket(flush=False)
        self._replies[seq] = None
        self._submit(ticket, [[self._send_wr(seq, rdma.pack_control(seq, msg), ticket)]])
        self.stats.sends += 1
        self._sent.append(seq)

    async def recv(self) -> bytes:
        if not self._sent:
            raise TransportError(self.peer, "recv() with no message sent to answer it")
        seq = self._sent.popleft()
        await self._until(lambda: seq in self._answers or self._lost, "a reply")
        if seq not in self._answers:
            self._check()
        return self._answers.pop(seq)[1]

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A JSON control request on this lane and its reply; a refusal raises TransportError."""
        await self.send(json.dumps(msg).encode())
        try:
            reply = json.loads(await self.recv())
        except ValueError:
            raise self._lose("the target sent a control reply that is not JSON") from None
        if not isinstance(reply, dict):
            raise TransportError(self.peer, "the target sent a control reply that is not an object")
        if not reply.get("ok"):
            raise TransportError(self.peer, printable(str(reply.get("error", "request refused"))))
        return reply

    async def aclose(self) -> None:
        if self._lost is None:
            self._lost = "lane closed"
        try:
            self._cmid.disconnect()
        except rdma.PyverbsError:
            pass  # never connected, or already gone
        self._qp.close()
        for obj in (self._msgs, self._scratch):
            try:
                obj.close()
            except rdma.PyverbsError:
                pass
        self._cmid.close()
        self._events.close()


class VerbsSession(SessionControl):
    """A session with one target: the TCP control connection and the queue pairs. The
    control operations go through the TCP session's client (``ops``), pools opened for RDMA."""

    rdma_pools = True

    def __init__(self, control: TcpSession, host: str, port: int, info: dict[str, Any], timeout: float,
                 settings: VerbsSettings) -> None:
        self._control = control
        self.ops = control.ops
        self._host = host
        self._port = port
        self._settings = settings
        self.peer = control.peer
        self.info = {**control.info, "transport": "rdma", **info}
        self.timeout = timeout
        self.lanes: list[VerbsLane] = []
        self._ctx: Any = None
        self.device = ""
        self._pd: Any = None
        self._local: _LocalRegions | None = None
        self._credits = int(info.get("credits", rdma.CREDITS))
        self._persistent = False  # whether this end's device posts FLUSH of the persistent type

    async def _expect(self, events: rdma.EventChannel, kind: int, what: str) -> rdma.Event:
        with trio.move_on_after(self.timeout):
            while True:
                ev = events.next()
                if ev is None:
                    await trio.lowlevel.wait_readable(events.fd)
                    continue
                if ev.kind != kind:
                    if ev.kind == rdma.ce.RDMA_CM_EVENT_REJECTED:
                        raise TransportError(self.peer, f"{what}: the target rejected the queue pair "
                                             "(no such session, or it does not serve verbs)")
                    raise TransportError(self.peer, f"{what}: expected {rdma.CM_NAMES[kind]}, got {ev.name}")
                return ev
        raise TransportError(self.peer, f"{what}: no answer within {self.timeout:g}s", timed_out=True)

    async def open_lane(self) -> VerbsLane:
        events = rdma.EventChannel()
        cmid = events.create_id()
        qp = None
        try:
            rai = rdma.AddrInfo(src=self._settings.src, dst=self._host, dst_service=str(self._port),
                                port_space=rdma.PORT_SPACE)
            cmid.resolve_addr(rai, RESOLVE_MS)
            await self._expect(events, rdma.ce.RDMA_CM_EVENT_ADDR_RESOLVED, "resolving the address")
            cmid.resolve_route(RESOLVE_MS)
            await self._expect(events, rdma.ce.RDMA_CM_EVENT_ROUTE_RESOLVED, "resolving the route")
            dev = rdma.device_name(cmid)
            if self._ctx is None:
                self._ctx = rdma.Context(name=dev)
                self._pd = rdma.PD(self._ctx)
                self._local = _LocalRegions(self._pd)
                self.device = dev
                self._persistent = bool(rdma.persistent_access(self._ctx))
            elif dev != self.device:
                raise TransportError(self.peer, f"lanes of one session on two devices ({self.device}, {dev})")
            qp = None
            flush = self._settings.native_flush and self.info.get("flush") and rdma.qpex_has_flush()
            if flush and rdma.flush_access(self._ctx):
                try:
                    qp = rdma.QueuePair(cmid, self._ctx, self._pd, send_depth=rdma.SEND_DEPTH,
                                        recv_depth=self._credits, flush=True)
                except rdma.PyverbsError as exc:  # a provider older than rdma-core 45
                    log.info("verbs: no native FLUSH on %s: %s", dev, exc)
            if qp is None:
                qp = rdma.QueuePair(cmid, self._ctx, self._pd, send_depth=rdma.SEND_DEPTH,
                                    recv_depth=self._credits)
            hello = rdma.LANE_HELLO.pack(b"RPML", rdma.VERSION, self._control.session_id)
            cmid.connect(rdma.conn_param(qp.qp.qp_num, hello))
            ev = await self._expect(events, rdma.ce.RDMA_CM_EVENT_CONNECT_RESPONSE, "connecting a lane")
            welcome = ev.private.ljust(rdma.LANE_WELCOME.size, b"\0")
            magic, version, credits = rdma.LANE_WELCOME.unpack_from(welcome)
            if magic != b"RPMA" or version != rdma.VERSION:
                raise TransportError(self.peer, f"the target's accept is not ours: {ev.private[:8]!r}")
            qp.to_state(rdma.e.IBV_QPS_RTR)
            qp.to_state(rdma.e.IBV_QPS_RTS)
            cmid.establish()
            assert self._pd is not None and self._local is not None
            lane = VerbsLane(self.peer, events, cmid, qp, self._local, min(credits, self._credits),
                             self.timeout, self._settings.spin_us)
        except BaseException as exc:
            if qp is not None:
                qp.close()
            cmid.close()
            events.close()
            if isinstance(exc, rdma.PyverbsError):
                raise TransportError(self.peer, f"cannot open a verbs lane: {exc}") from None
            raise
        self.lanes.append(lane)
        return lane

    @property
    def native_flush(self) -> bool:
        """Whether this session's barriers to an appliance target end in a native RDMA FLUSH:
        every lane can post one (both ends have it, and the settings allow it)."""
        return bool(self.lanes) and all(lane.native_flush for lane in self.lanes)

    def _native(self, raw: dict[str, Any]) -> Flush | None:
        """The strongest native FLUSH both ends allow for a pool the target just registered,
        or None (the READ)."""
        if not self.native_flush:
            return None
        types = raw.get(REGION_FLUSH_TYPES)
        if types is None:  # a target older than the field: what its "rdma" reply said
            types = ["visibility"] if self.info.get("flush") else []
        if not isinstance(types, list):
            raise TransportError(self.peer, f"the target sent {REGION_FLUSH_TYPES} {types!r}, not a list")
        if "persistent" in types and self._persistent:
            return "persistent"
        return "visibility" if "visibility" in types else None

    def _region(self, reply: RemoteRegion, raw: dict[str, Any]) -> RemoteRegion:
        method = reply.method
        native = self._native(raw) if method == "apm" else None
        if native is not None:
            # A FLUSH of global visibility is the appliance guarantee (placed, ordered after
            # the writes) as the operation made for it; of the persistent type, more: the
            # writes are in the target's persistence domain when it completes.
            method = "flush"
        try:
            return RemoteRegion(reply.name, reply.key, reply.size, reply.uuid, method, reply.pmem,
                                rkey=int(raw["rkey"]), raddr=int(raw["addr"]), native=native or "visibility")
        except (KeyError, TypeError, ValueError):
            raise TransportError(self.peer, "the target registered the pool without an rkey") from None

    def registered(self, reply: dict[str, Any]) -> RemoteRegion:
        return self._region(self.ops.region(reply), reply)

    async def aclose(self) -> None:
        for lane in self.lanes:
            await lane.aclose()
        self.lanes = []
        if self._local is not None:
            self._local.close()
        for obj in (self._pd, self._ctx):
            if obj is not None:
                try:
                    obj.close()
                except rdma.PyverbsError:
                    pass
        self._pd = self._ctx = None
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
    src: str | None = None, settings: VerbsSettings | None = None,
    wire_protection: str = DEFAULT_PROTECTION,
) -> VerbsSession:
    """A session with the target at ``address`` (HOST:PORT): control over TCP (protected as
    ``wire_protection`` says), ``lanes`` queue pairs over rdmacm (from ``src``, a local
    address, when given). Without ``settings`` (a caller that builds no transport, such as
    ``rpmemfs bench verbs``), those of the environment."""
    if settings is None:
        settings = VerbsSettings.from_env(src)
    elif src:
        settings = replace(settings, src=src)
    why = rdma.available()
    if why is not None:
        raise TransportError(address, f"cannot use RDMA here: {why}")
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise TransportError(address, str(exc)) from None
    control = await tcp_connect(address, token, lanes=0, timeout=timeout, wire_protection=wire_protection)
    try:
        info = await control.ops.rdma()
        session = VerbsSession(control, host, int(info.get("port", port)), info, timeout, settings)
    except BaseException:
        await control.aclose()
        raise
    try:
        for _ in range(lanes):
            await session.open_lane()
    except BaseException:
        with trio.CancelScope(shield=True):
            await session.aclose()
        raise
    return session


class VerbsTransport:
    """The verbs transport as an object, running with ``settings`` (its ``src`` picks the
    local address, and so the device); its control connections ask for ``wire_protection``."""

    name = "rdma"

    def __init__(self, settings: VerbsSettings, wire_protection: str = DEFAULT_PROTECTION) -> None:
        self.settings = settings
        self.wire_protection = wire_protection

    async def connect(
        self, address: str, token: bytes | None = None, *, lanes: int = 1, timeout: float = DEFAULT_TIMEOUT
    ) -> VerbsSession:
        return await connect(address, token, lanes=lanes, timeout=timeout, settings=self.settings,
                             wire_protection=self.wire_protection)


if TYPE_CHECKING:
    _transport: Transport = VerbsTransport(VerbsSettings())

    def _is_session(s: VerbsSession) -> Session:
        return s

    def _is_lane(lane: VerbsLane) -> Lane:
        return lane
