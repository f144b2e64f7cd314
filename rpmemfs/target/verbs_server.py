"""The target's verbs service: an rdmacm listener beside the TCP one, a protection domain per
session, the session's pools registered in it, and the requests lanes SEND.

The TCP control connection stays the control plane (handshake, token, create/open/close).
A session asks for verbs with the control op ``rdma``; from then on every pool it opens with
``"rdma": true`` is registered once in the session's protection domain for remote read and
write, and the reply carries the rkey and the address. A queue pair is accepted only when its
connect request names a live session that asked for verbs (the session id is a 16-byte
secret known only to that authenticated control connection), so what it can reach is what
its session opened. When the session ends, its queue pairs, registrations and protection
domain go before its pools are unmapped.

RDMA WRITEs and READs are placed and answered by the device, as on hardware, without this
code. What it serves is what needs the CPU: the general-purpose flush (a SEND with the whole
range list: persist them, answer with one SEND) and control requests sent on a lane. A
malformed request, an unknown key or a range outside the pool moves that queue pair to the
error state, with the reason logged; the session and its other lanes go on.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rpmemfs.native import ffi
from rpmemfs.ranges import merge_ranges
from rpmemfs.target.sessions import SessionTable, TargetSession
from rpmemfs.transport.control_ops import NATIVE_FLUSHES, REGION_FLUSH_TYPES

log = logging.getLogger("rpmemfs.target.verbs")

# Answers a control request a lane SENDs (ControlService.handle). Passed in, so that this
# module need not know the control service, which knows this one.
ControlHandler = Callable[[TargetSession, object], Awaitable[dict[str, Any]]]


class Violation(Exception):
    """A lane broke the protocol; it is closed, the reason logged."""


@dataclass(eq=False)
class _Lane:
    peer: str
    cmid: Any
    qp: Any
    msgs: Any  # receive slots, then reply slots
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    closed: bool = False


@dataclass(eq=False)
class _SessionVerbs:
    pd: Any
    mrs: dict[int, Any] = field(default_factory=dict)  # region key -> memory region
    lanes: list[_Lane] = field(default_factory=list)


class VerbsService:
    """Verbs for one target; :meth:`start` returns None (and says why) where it cannot run."""

    def __init__(self, rdma: Any, host: str, port: int, sessions: SessionTable, control: ControlHandler,
                 events: Any, listen_id: Any, ctx: Any, spin_s: float) -> None:
        self._rdma = rdma
        self.host = host
        self.port = port
        self._sessions = sessions
        self._control = control
        self._events = events
        self._listen_id = listen_id
        self._ctx = ctx
        self.device = rdma.device_name(listen_id)
        # Pools are registered for native RDMA FLUSH too where pyverbs and the device have it
        # (0 elsewhere: Linux 6.1 refuses the access flag); pools on persistent memory for
        # FLUSH of the persistent type as well, where the device grants it (see register).
        self.flush_access = rdma.flush_access(ctx)
        self.persistent_access = rdma.persistent_access(ctx)
        self._told: set[tuple[str, tuple[str, ...]]] = set()  # registrations whose outcome was logged
        self._state: dict[bytes, _SessionVerbs] = {}
        self._nursery: trio.Nursery | None = None
        self.spin_s = spin_s  # how long a lane polls after a request before it sleeps
        sessions.hooks.append(self)

    @classmethod
    def start(cls, host: str, port: int, sessions: SessionTable, control: ControlHandler,
              spin_s: float = 0.0) -> VerbsService | None:
        try:
            from rpmemfs.transport import rdma
        except ImportError as exc:
            log.info("verbs: not served (pyverbs is not importable: %s)", exc)
            return None
        why = rdma.available()
        if why is not None:
            log.info("verbs: not served (%s)", why)
            return None
        if host in ("", "0.0.0.0", "::"):
            log.warning("verbs: not served: listening on a wildcard address does not name an RDMA "
                        "device; give --listen the address of the device's interface")
            return None
        events = rdma.EventChannel()
        listen_id = events.create_id()
        try:
            listen_id.bind_addr(rdma.AddrInfo(src=host, src_service=str(port), port_space=rdma.PORT_SPACE,
                                              flags=rdma.ce.RAI_PASSIVE))
            dev = rdma.device_name(listen_id)
            if not dev or dev == "None":
                raise rdma.VerbsError(f"{host} is not the address of an RDMA device's interface")
            ctx = rdma.Context(name=dev)
            listen_id.listen(64)
        except (rdma.PyverbsError, rdma.VerbsError) as exc:
            log.info("verbs: not served on %s:%d: %s", host, port, exc)
            listen_id.close()
            events.close()
            return None
        service = cls(rdma, host, port, sessions, control, events, listen_id, ctx, spin_s)
        log.info("verbs: serving on %s port %d (device %s%s)", host, port, service.device,
                 ", native FLUSH" + (" (persistent type on pmem)" if service.persistent_access else "")
                 if service.flush_access else "")
        return service

    # --- control plane ----------------------------------------------------------------------

    def enable(self, session: TargetSession) -> dict[str, Any]:
        """The control op ``rdma``: a protection domain for the session."""
        if session.id not in self._state:
            self._state[session.id] = _SessionVerbs(self._rdma.PD(self._ctx))
        return {"ok": True, "port": self.port, "device": self.device, "credits": self._rdma.CREDITS,
                "flush": bool(self.flush_access)}

    def register(self, session: TargetSession, key: int) -> dict[str, Any]:
        """Register a pool the session just opened; its rkey and address for the reply."""
        state = self._state.get(session.id)
        if state is None:
            raise LookupError("this session has not enabled rdma (control op 'rdma' first)")
        region = session.regions[key]
        addr = int(ffi.cast("uintptr_t", region.pool.mapping.base))  # a cffi pointer, not a buffer
        rdma = self._rdma
        # A reader of a pool another initiator claimed gets no remote write access (fencing).
        access = rdma.POOL_ACCESS if region.writable else rdma.READ_ACCESS
        # The strongest FLUSH the kernel grants this memory: rxe refuses the persistent type
        # (EINVAL) unless every page is persistent memory, so ask, then step down.
        tries: list[tuple[int, tuple[str, ...]]] = []
        if self.persistent_access and region.pool.mapping.is_pmem:
            tries.append((self.flush_access | self.persistent_access, NATIVE_FLUSHES))
        if self.flush_access:
            tries.append((self.flush_access, NATIVE_FLUSHES[1:]))
        tries.append((0, ()))
        refused: list[str] = []
        for extra, types in tries:
            try:
                mr = rdma.MR(state.pd, region.size, access | extra, address=addr)
            except rdma.PyverbsError as exc:
                if extra == 0:
                    raise
                refused.append(f"FLUSH {' and '.join(types)} refused ({exc})")
                continue
            break
        self._tell(region.pool.name, types, refused)
        state.mrs[key] = mr
        return {"rkey": mr.rkey, "addr": addr, REGION_FLUSH_TYPES: list(types)}

    def _tell(self, pool: str, types: tuple[str, ...], refused: list[str]) -> None:
        """Log once per pool and outcome which FLUSH types its registration allows, and what
        was refused on the way (each open registers the pool again, the same way)."""
        if (pool, types) in self._told:
            return
        self._told.add((pool, types))
        got = f"FLUSH {' and '.join(types)}" if types else "no native FLUSH"
        log.info("verbs: pool %s registered with %s%s", pool, got,
                 f" ({'; '.join(refused)})" if refused else "")

    def unregistered(self, session: TargetSession, key: int) -> None:
        """Before the pool behind ``key`` may be unmapped: no remote access to it any more."""
        state = self._state.get(session.id)
        if state is not None and (mr := state.mrs.pop(key, None)) is not None:
            self._close(mr)

    def ended(self, session: TargetSession) -> None:
        state = self._state.pop(session.id, None)
        if state is None:
            return
        for lane in state.lanes:
            self._close_lane(lane, "session ended")
        for mr in state.mrs.values():
            self._close(mr)
        self._close(state.pd)

    def _close(self, obj: Any) -> None:
        try:
            obj.close()
        except self._rdma.PyverbsError as exc:
            log.warning("verbs: closing %s failed: %s", type(obj).__name__, exc)

    def _close_lane(self, lane: _Lane, why: str) -> None:
        if lane.closed:
            return
        lane.closed = True
        lane.scope.cancel()
        log.info("verbs: lane from %s closed: %s", lane.peer, why)
        trio.lowlevel.notify_closing(lane.qp.fd)
        try:
            lane.cmid.disconnect()
        except self._rdma.PyverbsError:
            pass
        lane.qp.close()
        self._close(lane.msgs)
        self._close(lane.cmid)

    # --- rdmacm -----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as self._nursery:
                await self._events_loop()
        finally:
            for sid in list(self._state):
                session = self._sessions.get(sid)
                if session is not None:
                    self.ended(session)
            trio.lowlevel.notify_closing(self._events.fd)
            self._close(self._listen_id)
            self._close(self._ctx)
            self._events.close()

    async def _events_loop(self) -> None:
        rdma = self._rdma
        while True:
            ev = self._events.next(self._listen_id)
            if ev is None:
                await trio.lowlevel.wait_readable(self._events.fd)
                continue
            if ev.kind == rdma.ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                self._connect_request(ev)
            elif ev.kind in (rdma.ce.RDMA_CM_EVENT_ESTABLISHED, rdma.ce.RDMA_CM_EVENT_DISCONNECTED):
                log.debug("verbs: %s", ev.name)
            else:
                log.info("verbs: rdmacm event %s", ev.name)

    def _connect_request(self, ev: Any) -> None:
        rdma = self._rdma
        cmid = ev.cmid
        peer = "an initiator"
        try:
            hello = ev.private[: rdma.LANE_HELLO.size]
            if len(hello) < rdma.LANE_HELLO.size:
                raise Violation(f"connect request without our hello ({len(ev.private)} bytes of "
                                "private data)")
            magic, version, sid = rdma.LANE_HELLO.unpack(hello)
            if magic != b"RPML" or version != rdma.VERSION:
                raise Violation(f"connect request with hello {hello[:6]!r}, not rpmemfs lane version "
                                f"{rdma.VERSION}")
            session = self._sessions.get(sid)
            state = self._state.get(sid)
            if session is None or state is None:
                raise Violation("connect request for no live session with rdma enabled")
            peer = session.peer
            qp = rdma.QueuePair(cmid, self._ctx, state.pd, send_depth=2 * rdma.CREDITS,
                                recv_depth=rdma.CREDITS,
                                qp_access=self.flush_access | self.persistent_access)
        except (Violation, rdma.PyverbsError, rdma.VerbsError) as exc:
            log.warning("verbs: refused a queue pair from %s: %s", peer, exc)
            try:
                cmid.reject()
            except rdma.PyverbsError:
                pass
            self._close(cmid)
            return
        try:
            msgs = rdma.MR(state.pd, 2 * rdma.CREDITS * rdma.MSG_SIZE, rdma.e.IBV_ACCESS_LOCAL_WRITE)
        except rdma.PyverbsError as exc:
            log.error("verbs: no memory for a lane from %s: %s", peer, exc)
            qp.close()
            cmid.reject()
            self._close(cmid)
            return
        lane = _Lane(peer, cmid, qp, msgs)
        try:
            for slot in range(rdma.CREDITS):
                qp.post_recv(msgs, slot * rdma.MSG_SIZE, rdma.MSG_SIZE, slot)
            qp.to_state(rdma.e.IBV_QPS_RTR)
            qp.to_state(rdma.e.IBV_QPS_RTS)
            welcome = rdma.LANE_WELCOME.pack(b"RPMA", rdma.VERSION, rdma.CREDITS)
            cmid.accept(rdma.conn_param(qp.qp.qp_num, welcome))
        except rdma.PyverbsError as exc:
            log.warning("verbs: accepting a lane from %s failed: %s", peer, exc)
            lane.closed = True
            qp.close()
            self._close(msgs)
            self._close(cmid)
            return
        state.lanes.append(lane)
        log.info("verbs: lane from %s accepted (session %s)", peer, sid.hex()[:8])
        assert self._nursery is not None
        self._nursery.start_soon(self._serve_lane, session, state, lane)

    # --- a lane -----------------------------------------------------------------------------

    async def _serve_lane(self, session: TargetSession, state: _SessionVerbs, lane: _Lane) -> None:
        rdma = self._rdma
        pending: dict[int, int] = {}  # reply wr_id -> receive slot to post again once it left
        next_wr = 1 << 32
        spin_until = 0.0
        with lane.scope:
            try:
                while not lane.closed:
                    wcs = lane.qp.poll()
                    if not wcs:
                        # After a request, poll a while before sleeping: the next barrier of
                        # an fsync-heavy writer comes soon, and a wake-up costs more than it.
                        if time.monotonic() < spin_until:
                            await trio.lowlevel.checkpoint()
                            continue
                        wcs = lane.qp.completions()  # re-arms the channel first
                        if not wcs:
                            await trio.lowlevel.wait_readable(lane.qp.fd)
                            continue
                    for wc in wcs:
                        why = rdma.failed(wc)
                        if why is not None:
                            raise Violation(why)
                        if wc.opcode != rdma.e.IBV_WC_RECV:
                            if (slot := pending.pop(wc.wr_id, None)) is not None:
                                lane.qp.post_recv(lane.msgs, slot * rdma.MSG_SIZE, rdma.MSG_SIZE, slot)
                            continue
                        slot = wc.wr_id
                        data = lane.msgs.read(wc.byte_len, slot * rdma.MSG_SIZE)
                        seq, status, body = await self._answer(session, state, data)
                        reply = rdma.pack_reply(seq, status, body)
                        next_wr += 1
                        if len(reply) <= rdma.MAX_INLINE:
                            lane.qp.post_recv(lane.msgs, slot * rdma.MSG_SIZE, rdma.MSG_SIZE, slot)
                            wr = rdma.send_wr(next_wr, rdma.address_of(reply), len(reply), 0, signaled=True)
                        else:
                            # Its slot is posted again only when the reply has left the buffer.
                            offset = (rdma.CREDITS + slot) * rdma.MSG_SIZE
                            lane.msgs.write(reply, len(reply), offset)
                            wr = rdma.send_wr(next_wr, lane.msgs.buf + offset, len(reply), lane.msgs.lkey,
                                              signaled=True)
                            pending[next_wr] = slot
                        lane.qp.post_send([wr])
                        spin_until = time.monotonic() + self.spin_s
            except Violation as exc:
                log.warning("verbs: closing a lane from %s: %s", lane.peer, exc)
                self._close_lane(lane, str(exc))
            except rdma.PyverbsError as exc:
                log.warning("verbs: lane from %s failed: %s", lane.peer, exc)
                self._close_lane(lane, str(exc))
            except trio.ClosedResourceError:
                pass  # closed with its session while waiting
        if lane in state.lanes and lane.closed:
            state.lanes.remove(lane)

    async def _answer(self, session: TargetSession, state: _SessionVerbs,
                      data: bytes) -> tuple[int, int, bytes]:
        rdma = self._rdma
        try:
            request = rdma.unpack_request(data)
        except rdma.VerbsError as exc:
            raise Violation(str(exc)) from None
        if request.kind == rdma.KIND_CONTROL:
            try:
                msg = json.loads(request.body)
            except ValueError:
                raise Violation("a control request that is not JSON") from None
            reply = await self._control(session, msg)
            body = json.dumps(reply).encode()
            if len(body) > rdma.MAX_MESSAGE:
                body = json.dumps({"ok": False, "error": "reply too large for a lane",
                                   "code": "request"}).encode()
            return request.seq, 0, body
        region = session.regions.get(request.key)
        if region is None or request.key not in state.mrs:
            raise Violation(f"flush for key {request.key:#x}, which this session has not registered for rdma")
        for off, length in request.ranges:
            if off + length > region.size:
                raise Violation(f"flush range ({off}, {length}) is outside pool {region.pool.name!r} "
                                f"of {region.size} bytes")
        pool = region.pool
        pool.acquire()
        try:
            merged = merge_ranges(request.ranges)
            if pool.needs_thread(merged):
                await trio.to_thread.run_sync(pool.persist, merged, len(request.ranges))
            else:
                pool.persist(merged, len(request.ranges))
        except OSError as exc:
            log.error("verbs: persisting pool %s failed: %s", pool.name, exc)
            return request.seq, exc.errno or errno.EIO, f"persist failed on the target: {exc}".encode()[:1000]
        finally:
            pool.release()
        pool.counters.add("flushes")
        return request.seq, 0, b""
