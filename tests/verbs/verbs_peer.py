"""Both ends of an RDMA connection for the verbs tests, on pyverbs (rdma-core 44).

The test process is the initiator and imports this module; the target is this file run as a
script in a process of its own (pyverbs' blocking calls hold the GIL, and a vanishing peer
must be a process that dies):

    python verbs_peer.py target IP PORT POOL_FILE

The target maps POOL_FILE, registers the mapping once with remote read and write access,
prints ``ready`` and serves one connection after another. It tells each initiator where the
pool is (rkey, address, size) in the private data of its rdmacm accept. It answers a flush
request (a SEND listing (offset, length) ranges: the general-purpose method) by msync-ing
those ranges and SENDing a reply. It exits when its standard input closes.

Nothing here blocks: rdmacm events and completions are read from non-blocking file
descriptors, and the callers wait for those descriptors (the target with poll(2), the tests
with trio), which is how a trio daemon has to drive verbs too. pyverbs 44 does not expose
those descriptors, so :func:`with_new_fd` finds them in /proc/self/fd.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import pyverbs.cm_enums as ce
import pyverbs.enums as e
from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
from pyverbs.cq import CQ, WC, CompChannel
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

T = TypeVar("T")

PORT_SPACE = ce.RDMA_PS_TCP
CQ_DEPTH = 256
MAX_SEND_WR = 128
MAX_RECV_WR = 16
MAX_INLINE = 64  # bytes a WRITE may carry inside its work request
RETRY_COUNT = 3  # transport retries before a dead peer fails a work request
RNR_RETRY = 3  # retries while the peer has no receive posted (7 would mean forever)
READS_IN_FLIGHT = 4  # RDMA READs outstanding per queue pair, each way
MSG_SIZE = 4096  # largest flush request or reply
RECV_SLOTS = 4  # flush requests a target connection can have queued
POOL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
PAGE = mmap.PAGESIZE

# Wire formats: the pool description travels in the accept's private data (at most 196 bytes
# for RDMA_PS_TCP); the flush request and its reply travel as SENDs.
POOL_INFO = struct.Struct("<4sIQQ")  # b"POOL", rkey, address, size
FLUSH_HEAD = struct.Struct("<4sI")  # b"FLSH", number of ranges
FLUSH_RANGE = struct.Struct("<QQ")  # offset, length
FLUSH_REPLY = struct.Struct("<4sIQ")  # b"DONE", errno (0: persisted), bytes msync-ed
MAX_RANGES = (MSG_SIZE - FLUSH_HEAD.size) // FLUSH_RANGE.size

WC_NAMES = {
    getattr(e, name): name for name in dir(e) if name.startswith("IBV_WC_") and name.endswith("_ERR")
} | {e.IBV_WC_SUCCESS: "IBV_WC_SUCCESS"}
CM_NAMES = {getattr(ce, name): name for name in dir(ce) if name.startswith("RDMA_CM_EVENT_")}


class VerbsError(Exception):
    """A work request failed, or the connection went away."""


@dataclass(frozen=True)
class PoolInfo:
    rkey: int
    addr: int
    size: int

    def pack(self) -> bytes:
        return POOL_INFO.pack(b"POOL", self.rkey, self.addr, self.size)

    @classmethod
    def unpack(cls, data: bytes) -> PoolInfo:
        if len(data) < POOL_INFO.size:
            raise VerbsError(f"private data too short for a pool description: {data!r}")
        magic, rkey, addr, size = POOL_INFO.unpack_from(data)
        if magic != b"POOL":
            raise VerbsError(f"private data is not a pool description: {data[: POOL_INFO.size]!r}")
        return cls(rkey, addr, size)


def pack_flush(ranges: Sequence[tuple[int, int]]) -> bytes:
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"{len(ranges)} ranges do not fit one {MSG_SIZE}-byte flush request")
    return FLUSH_HEAD.pack(b"FLSH", len(ranges)) + b"".join(FLUSH_RANGE.pack(o, n) for o, n in ranges)


def unpack_flush(data: bytes) -> list[tuple[int, int]]:
    magic, count = FLUSH_HEAD.unpack_from(data)
    if magic != b"FLSH" or FLUSH_HEAD.size + count * FLUSH_RANGE.size > len(data):
        raise VerbsError(f"bad flush request of {len(data)} bytes")
    return [FLUSH_RANGE.unpack_from(data, FLUSH_HEAD.size + i * FLUSH_RANGE.size) for i in range(count)]


def rdma_devices() -> list[str]:
    """Names of the RDMA devices the kernel shows (without opening any)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


# --- file descriptors ------------------------------------------------------------------------


def _open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used, closed by now
    return fds


def with_new_fd(make: Callable[[], T], link_contains: str) -> tuple[T, int]:
    """``make()``, and the one descriptor it opened whose /proc link contains ``link_contains``,
    switched to non-blocking so that reading an event never waits.

    pyverbs 44 keeps the descriptors of rdmacm event channels (``/dev/infiniband/rdma_cm``)
    and completion channels (``anon_inode:[infinibandevent]``) to itself.
    """
    before = set(_open_fds())
    obj = make()
    new = {fd: link for fd, link in _open_fds().items() if fd not in before}
    found = [fd for fd, link in new.items() if link_contains in link]
    if len(found) != 1:
        raise VerbsError(f"cannot tell the {link_contains!r} descriptor among new ones: {new}")
    os.set_blocking(found[0], False)
    return obj, found[0]


def _again(exc: PyverbsRDMAError) -> bool:
    return getattr(exc, "error_code", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


def wait_readable(fds: Sequence[int], timeout: float | None) -> set[int]:
    """poll(2): the descriptors of ``fds`` that are readable (or hung up) within ``timeout``."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000))
    return {fd for fd, _ in poller.poll(ms)}


# --- rdmacm ----------------------------------------------------------------------------------


@dataclass
class Event:
    kind: int
    private: bytes
    cmid: CMID | None  # the new connection's id, for a CONNECT_REQUEST on a listening id

    @property
    def name(self) -> str:
        return CM_NAMES.get(self.kind, str(self.kind))


class EventChannel:
    """An rdmacm event channel with a known, non-blocking descriptor."""

    def __init__(self) -> None:
        self.channel, self.fd = with_new_fd(CMEventChannel, "rdma_cm")

    def create_id(self) -> CMID:
        return CMID(creator=self.channel, port_space=PORT_SPACE)

    def next(self, listen_id: CMID | None = None) -> Event | None:
        """The next event if one is queued (acknowledged already), else None."""
        try:
            raw = CMEvent(self.channel)
        except PyverbsRDMAError as exc:
            if _again(exc):
                return None
            raise
        try:
            kind = raw.event_type
            private = bytes(raw.private_data or b"")
            cmid = None
            if kind == ce.RDMA_CM_EVENT_CONNECT_REQUEST and listen_id is not None:
                # The new id must be taken over before the event is acknowledged.
                cmid = CMID(creator=raw, listen_id=listen_id)
        finally:
            raw.ack_cm_event()
        return Event(kind, private, cmid)

    def close(self) -> None:
        self.channel.close()


def conn_param(qp_num: int, private: bytes = b"") -> ConnParam:
    param = ConnParam(
        resources=READS_IN_FLIGHT,
        depth=READS_IN_FLIGHT,
        retry=RETRY_COUNT,
        rnr_retry=RNR_RETRY,
        qp_num=qp_num,
        data_len=len(private),
    )
    if private:
        param.set_private_data(private)
    return param


def device_name(cmid: CMID) -> str:
    name = cmid.dev_name
    return name.decode() if isinstance(name, bytes) else str(name)


# --- one connection --------------------------------------------------------------------------


class Conn:
    """The queue pair of one connection, with its own completion queue and channel.

    The queue pair belongs to us, not to librdmacm (an "external" QP): it lives on our own
    device context and protection domain, rdmacm only computes the attributes of each state
    change (:meth:`to_state`). That keeps QPs, CQs and memory regions under our control.
    """

    def __init__(self, cmid: CMID, ctx: Context, pd: PD) -> None:
        self.cmid = cmid
        self.ctx = ctx
        self.pd = pd
        self.channel, self.fd = with_new_fd(lambda: CompChannel(ctx), "infinibandevent")
        self.cq = CQ(ctx, CQ_DEPTH, None, self.channel, 0)
        self.cq.req_notify()
        cap = QPCap(
            max_send_wr=MAX_SEND_WR,
            max_recv_wr=MAX_RECV_WR,
            max_send_sge=1,
            max_recv_sge=1,
            max_inline_data=MAX_INLINE,
        )
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = QP(pd, init)
        self.to_state(e.IBV_QPS_INIT)

    def to_state(self, state: int) -> None:
        attr, mask = self.cmid.init_qp_attr(state)
        self.qp.modify(attr, mask)

    def to_error(self) -> None:
        """Error state: every outstanding work request completes with IBV_WC_WR_FLUSH_ERR."""
        self.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def completions(self) -> list[WC]:
        """The completions queued now; consumes and re-arms the channel's notification first,
        so that a completion arriving after this call makes :attr:`fd` readable again."""
        try:
            self.channel.get_cq_event(self.cq)
        except PyverbsRDMAError as exc:
            if not _again(exc):
                raise
        else:
            self.cq.ack_events(1)
            self.cq.req_notify()
        out: list[WC] = []
        while True:
            n, wcs = self.cq.poll(16)
            out.extend(wcs[:n])
            if n < 16:
                return out

    def post_send_chain(self, wrs: Sequence[SendWR]) -> None:
        """One ibv_post_send of the whole chain: the device sees it at once, in this order."""
        for a, b in zip(wrs, wrs[1:], strict=False):
            a.next_wr = b
        self.qp.post_send(wrs[0])

    def post_recv(self, mr: MR, offset: int, length: int, wr_id: int) -> None:
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(mr.buf + offset, length, mr.lkey)]))

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.channel):
            obj.close()


def check(wc: WC, what: str) -> WC:
    if wc.status != e.IBV_WC_SUCCESS:
        raise VerbsError(f"{what}: completion {WC_NAMES.get(wc.status, wc.status)} (wr_id {wc.wr_id})")
    return wc


# --- work requests ---------------------------------------------------------------------------


def write_wr(wr_id: int, mr: MR, offset: int, length: int, rkey: int, raddr: int) -> SendWR:
    """An unsignaled RDMA WRITE of mr[offset:offset+length]; inline when it is tiny."""
    flags = e.IBV_SEND_INLINE if length <= MAX_INLINE else 0
    wr = SendWR(
        wr_id=wr_id,
        opcode=e.IBV_WR_RDMA_WRITE,
        num_sge=1,
        sg=[SGE(mr.buf + offset, length, mr.lkey)],
        send_flags=flags,
    )
    wr.set_wr_rdma(rkey, raddr)
    return wr


def read_wr(wr_id: int, mr: MR, offset: int, length: int, rkey: int, raddr: int) -> SendWR:
    """A signaled RDMA READ into mr[offset:offset+length]."""
    wr = SendWR(
        wr_id=wr_id,
        opcode=e.IBV_WR_RDMA_READ,
        num_sge=1,
        sg=[SGE(mr.buf + offset, length, mr.lkey)],
        send_flags=e.IBV_SEND_SIGNALED,
    )
    wr.set_wr_rdma(rkey, raddr)
    return wr


def send_wr(wr_id: int, mr: MR, offset: int, length: int, *, signaled: bool) -> SendWR:
    flags = e.IBV_SEND_SIGNALED if signaled else 0
    if length <= MAX_INLINE:
        flags |= e.IBV_SEND_INLINE
    return SendWR(
        wr_id=wr_id,
        opcode=e.IBV_WR_SEND,
        num_sge=1,
        sg=[SGE(mr.buf + offset, length, mr.lkey)],
        send_flags=flags,
    )


# --- the target ------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[target {os.getpid()}] {msg}", file=sys.stderr, flush=True)


class Target:
    """Serves one pool file to one initiator at a time."""

    def __init__(self, ip: str, port: int, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        self.size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.map)  # pins the mapping while registered
        addr = ctypes.addressof(self._anchor)

        self.events = EventChannel()
        self.listen_id = self.events.create_id()
        self.listen_id.bind_addr(
            AddrInfo(src=ip, src_service=str(port), port_space=PORT_SPACE, flags=ce.RAI_PASSIVE)
        )
        # Our own context and protection domain on the device the address belongs to; the
        # pool is registered once, here, for every connection to come.
        self.ctx = Context(name=device_name(self.listen_id))
        self.pd = PD(self.ctx)
        self.pool_mr = MR(self.pd, self.size, POOL_ACCESS, address=addr)
        self.msgs = MR(self.pd, MSG_SIZE * (RECV_SLOTS + 1), e.IBV_ACCESS_LOCAL_WRITE)
        self.info = PoolInfo(self.pool_mr.rkey, addr, self.size)
        self.conn: Conn | None = None
        self.listen_id.listen(4)

    def reply_offset(self) -> int:
        return MSG_SIZE * RECV_SLOTS

    def run(self) -> int:
        print("ready", flush=True)
        log(f"listening on {device_name(self.listen_id)}, pool rkey {self.info.rkey:#x} size {self.size}")
        while True:
            fds = [0, self.events.fd] + ([self.conn.fd] if self.conn else [])
            ready = wait_readable(fds, None)
            if 0 in ready and not os.read(0, 4096):
                log("standard input closed: exiting")
                return 0
            if self.events.fd in ready:
                while (ev := self.events.next(self.listen_id)) is not None:
                    self.on_event(ev)
            if self.conn is not None and self.conn.fd in ready:
                for wc in self.conn.completions():
                    self.on_completion(wc)

    def on_event(self, ev: Event) -> None:
        if ev.kind == ce.RDMA_CM_EVENT_CONNECT_REQUEST:
            assert ev.cmid is not None
            if self.conn is not None:
                log("second initiator rejected: one at a time")
                ev.cmid.reject()
                return
            conn = Conn(ev.cmid, self.ctx, self.pd)
            for slot in range(RECV_SLOTS):
                conn.post_recv(self.msgs, slot * MSG_SIZE, MSG_SIZE, slot)
            conn.to_state(e.IBV_QPS_RTR)
            conn.to_state(e.IBV_QPS_RTS)
            ev.cmid.accept(conn_param(conn.qp.qp_num, self.info.pack()))
            self.conn = conn
            log("connection request accepted")
        elif ev.kind == ce.RDMA_CM_EVENT_ESTABLISHED:
            log("connection established")
        elif ev.kind == ce.RDMA_CM_EVENT_DISCONNECTED and self.conn is not None:
            log("initiator disconnected")
            conn, self.conn = self.conn, None
            try:
                conn.cmid.disconnect()
            except PyverbsRDMAError as exc:
                log(f"disconnect: {exc}")
            conn.close()
            conn.cmid.close()
        else:
            log(f"event {ev.name} ignored")

    def on_completion(self, wc: WC) -> None:
        assert self.conn is not None
        if wc.status != e.IBV_WC_SUCCESS:
            # Receives are flushed when the initiator goes away; the DISCONNECTED event says so.
            log(f"completion {WC_NAMES.get(wc.status, wc.status)} for wr_id {wc.wr_id}")
            return
        if wc.opcode != e.IBV_WC_RECV:
            return  # our reply went out
        slot = wc.wr_id
        request = self.msgs.read(wc.byte_len, slot * MSG_SIZE)
        status, synced = self.flush(request)
        self.conn.post_recv(self.msgs, slot * MSG_SIZE, MSG_SIZE, slot)
        self.msgs.write(FLUSH_REPLY.pack(b"DONE", status, synced), FLUSH_REPLY.size, self.reply_offset())
        self.conn.post_send_chain(
            [send_wr(1000 + slot, self.msgs, self.reply_offset(), FLUSH_REPLY.size, signaled=True)]
        )

    def flush(self, request: bytes) -> tuple[int, int]:
        """msync every range of the request (page-aligned, as msync wants); (errno, bytes)."""
        try:
            ranges = unpack_flush(request)
        except (VerbsError, struct.error) as exc:
            log(str(exc))
            return errno.EPROTO, 0
        synced = 0
        for offset, length in ranges:
            if offset + length > self.size:
                return errno.ERANGE, synced
            start = offset - offset % PAGE
            end = min(self.size, -(-(offset + length) // PAGE) * PAGE)
            self.map.flush(start, end - start)
            synced += end - start
        return 0, synced


def main(argv: Sequence[str]) -> int:
    if len(argv) != 5 or argv[1] != "target":
        print(f"usage: {argv[0]} target IP PORT POOL_FILE", file=sys.stderr)
        return 2
    return Target(argv[2], int(argv[3]), argv[4]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
