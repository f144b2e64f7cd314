"""pyverbs plumbing shared by both ends of the verbs transport: devices, rdmacm event
channels, queue pairs with their completion channels, work requests, and the few messages
that travel as SENDs or in rdmacm private data.

Nothing here blocks. rdmacm events and completions are read from non-blocking descriptors
that the caller waits for with trio (pyverbs' blocking calls hold the GIL, which would stop
every other task of the daemon). pyverbs (rdma-core 44) keeps those descriptors to itself,
so :func:`with_new_fd` finds each in /proc/self/fd right after it is opened.

Importing this module needs pyverbs; :func:`available` says whether it can be used here
without importing it.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

try:
    import pyverbs.cm_enums as ce
    import pyverbs.enums as e
except ImportError:  # rdma-core 50+ (PyPI's pyverbs 59) names them after their libraries
    import pyverbs.libibverbs_enums as e  # type: ignore[no-redef]
    import pyverbs.librdmacm_enums as ce  # type: ignore[no-redef]
from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
from pyverbs.cq import CQ, WC, CompChannel
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from rpmemfs.native import ffi
from rpmemfs.transport.verbs_config import rdma_devices

T = TypeVar("T")

PORT_SPACE = ce.RDMA_PS_TCP
MAX_INLINE = 64  # bytes a WRITE or SEND may carry inside its work request
RETRY_COUNT = 3  # transport retries before a dead peer fails a work request
RNR_RETRY = 3  # retries while the peer has no receive posted (7 would mean forever)
READS_IN_FLIGHT = 4  # RDMA READs outstanding per queue pair, each way
MSG_SIZE = 4096  # largest message a lane SENDs (flush request, control request or reply)
CREDITS = 16  # requests a lane may have outstanding: the receives the target keeps posted
SEND_DEPTH = 1024  # work requests an initiator's lane may have in its send queue
CQ_DEPTH = SEND_DEPTH + 2 * CREDITS
MAX_RDMA = 1 << 30  # one WRITE or READ moves at most this much
POOL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
READ_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
FLUSH_ACCESS = getattr(e, "IBV_ACCESS_FLUSH_GLOBAL", 0)  # rdma-core 45+; absent from 44
# IB_UVERBS_DEVICE_FLUSH_GLOBAL (the kernel's uapi), a bit of device_cap_flags_ex that
# rdma-core names nowhere; rxe sets it from Linux 6.2 on. A kernel without it refuses an MR
# with IBV_ACCESS_FLUSH_GLOBAL (EINVAL, measured on 6.1), so the flag is used only where set.
DEVICE_FLUSH_GLOBAL = 1 << 38
# FLUSH to the persistence domain: rxe grants it (Linux 6.2+, bit 39) only to registrations of
# persistent memory (rxe_mr.c checks every page lies in a persistent-memory resource).
FLUSH_PERSISTENT_ACCESS = getattr(e, "IBV_ACCESS_FLUSH_PERSISTENT", 0)
DEVICE_FLUSH_PERSISTENT = 1 << 39

# --- messages --------------------------------------------------------------------------------
# In rdmacm private data (at most 56 bytes with a connect, 196 with an accept):
LANE_HELLO = struct.Struct("<4sH16s")  # b"RPML", version, session id (from the control plane)
LANE_WELCOME = struct.Struct("<4sHH")  # b"RPMA", version, credits
VERSION = 1
# As SENDs on a lane:
REQUEST_HEAD = struct.Struct("<4sIIIQ")  # kind, region key, count or length, 0, sequence
FLUSH_RANGE = struct.Struct("<QQ")  # offset, length
REPLY_HEAD = struct.Struct("<4sIIIQ")  # b"RPMR", errno (0: done), payload length, 0, sequence
KIND_FLUSH = b"RPMF"  # payload: count x FLUSH_RANGE; the target persists them, then replies
KIND_CONTROL = b"RPMC"  # payload: a JSON control request; the reply carries the JSON answer
KIND_REPLY = b"RPMR"
MAX_FLUSH_RANGES = (MSG_SIZE - REQUEST_HEAD.size) // FLUSH_RANGE.size
MAX_MESSAGE = MSG_SIZE - REQUEST_HEAD.size

WC_NAMES = {
    getattr(e, name): name for name in dir(e) if name.startswith("IBV_WC_") and name.endswith("_ERR")
} | {e.IBV_WC_SUCCESS: "IBV_WC_SUCCESS"}
CM_NAMES = {getattr(ce, name): name for name in dir(ce) if name.startswith("RDMA_CM_EVENT_")}

__all__ = [
    "CMID", "MR", "PD", "WC", "AddrInfo", "Context", "PyverbsError", "PyverbsRDMAError", "SendWR", "ce", "e",
]


class VerbsError(Exception):
    """A verbs call failed, a work request completed in error, or a message was malformed."""


def available() -> str | None:
    """None when verbs can be used here, else why not (a sentence for a log or an error)."""
    if not rdma_devices():
        return "no RDMA device (/sys/class/infiniband is empty or missing)"
    return None


def qpex_has_flush() -> bool:
    """Whether this pyverbs can post native FLUSH: rdma-core 45+ (QPEx.wr_flush)."""
    from pyverbs.qp import QPEx

    return bool(FLUSH_ACCESS) and hasattr(e, "IBV_QP_EX_WITH_FLUSH") and hasattr(QPEx, "wr_flush")


def _device_caps(ctx: Context) -> int:
    try:
        return int(ctx.query_device_ex().device_cap_flags_ex)
    except PyverbsError:
        return 0


def flush_access(ctx: Context) -> int:
    """IBV_ACCESS_FLUSH_GLOBAL when both this pyverbs and the device have native RDMA FLUSH,
    else 0: the access flags to add to a pool's registration."""
    if not FLUSH_ACCESS:
        return 0
    return FLUSH_ACCESS if _device_caps(ctx) & DEVICE_FLUSH_GLOBAL else 0


def persistent_access(ctx: Context) -> int:
    """IBV_ACCESS_FLUSH_PERSISTENT when this pyverbs names it and the device has FLUSH of the
    persistent type (and of the global one, which every FLUSH needs here), else 0."""
    if not (FLUSH_PERSISTENT_ACCESS and flush_access(ctx)):
        return 0
    return FLUSH_PERSISTENT_ACCESS if _device_caps(ctx) & DEVICE_FLUSH_PERSISTENT else 0


# --- descriptors -----------------------------------------------------------------------------


def _open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used, closed by now
    return fds


def with_new_fd(make: Callable[[], T], link_contains: str) -> tuple[T, int]:
    """``make()``, and the one descriptor it opened whose /proc link contains
    ``link_contains``, made non-blocking so that reading from it never waits."""
    before = set(_open_fds())
    obj = make()
    found = [fd for fd, link in _open_fds().items() if fd not in before and link_contains in link]
    if len(found) != 1:
        raise VerbsError(f"cannot tell which new descriptor is the {link_contains!r} one: {found}")
    os.set_blocking(found[0], False)
    return obj, found[0]


def again(exc: PyverbsRDMAError) -> bool:
    return getattr(exc, "error_code", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


def address_of(buf: Any) -> int:
    """Where a bytes-like object's memory starts, for a scatter-gather entry."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))


# --- rdmacm ----------------------------------------------------------------------------------


@dataclass
class Event:
    kind: int
    private: bytes
    cmid: CMID | None  # the new connection's id, for a CONNECT_REQUEST on a listening id
    status: int = 0

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
        """The next event if one is queued (acknowledged already), else None.

        Every event is acknowledged at once: rdma_destroy_id waits for the events it
        reported to be acknowledged, and must never wait here.
        """
        try:
            raw = CMEvent(self.channel)
        except PyverbsRDMAError as exc:
            if again(exc):
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
        resources=READS_IN_FLIGHT, depth=READS_IN_FLIGHT, retry=RETRY_COUNT, rnr_retry=RNR_RETRY,
        qp_num=qp_num, data_len=len(private),
    )
    if private:
        param.set_private_data(private)
    return param


def device_name(cmid: CMID) -> str:
    name = cmid.dev_name
    return name.decode() if isinstance(name, bytes) else str(name)


# --- queue pairs -----------------------------------------------------------------------------


class QueuePair:
    """One RC queue pair with its own completion queue and completion channel.

    The queue pair is ours, not librdmacm's: it lives on our context and protection domain,
    and rdmacm only computes the attributes of each state change (:meth:`to_state`).

    ``flush``: an extended queue pair (QPEx) that can post native RDMA FLUSH (rdma-core 45+,
    a provider that takes IBV_QP_EX_WITH_FLUSH); every chain is then posted through the
    ibv_wr_* API (:meth:`post_send`), never mixed with ibv_post_send. Creating it raises
    PyverbsError where the provider refuses.
    """

    qp_access = 0  # access flags added to rdmacm's at INIT (a subclass's own __init__ keeps it)

    def __init__(self, cmid: CMID, ctx: Context, pd: PD, *, send_depth: int, recv_depth: int,
                 flush: bool = False, qp_access: int = 0) -> None:
        self.cmid = cmid
        self.extended = flush
        self.qp_access = qp_access
        self.channel, self.fd = with_new_fd(lambda: CompChannel(ctx), "infinibandevent")
        try:
            self.cq = CQ(ctx, send_depth + recv_depth + 2, None, self.channel, 0)
            self.cq.req_notify()
            cap = QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1, max_recv_sge=1,
                        max_inline_data=MAX_INLINE)
            if flush:
                from pyverbs.qp import QPEx, QPInitAttrEx

                ops = (e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_READ | e.IBV_QP_EX_WITH_SEND
                       | e.IBV_QP_EX_WITH_FLUSH)
                mask = e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
                init_ex = QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0,
                                       pd=pd, comp_mask=mask, send_ops_flags=ops)
                self.qp = QPEx(ctx, init_ex)
            else:
                init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
                self.qp = QP(pd, init)
            self.to_state(e.IBV_QPS_INIT)
        except BaseException:
            self.channel.close()
            raise

    def to_state(self, state: int) -> None:
        attr, mask = self.cmid.init_qp_attr(state)
        if state == e.IBV_QPS_INIT and self.qp_access:
            # rxe's responder checks the queue pair's access flags for each FLUSH type too
            # (check_qp_attr_access), and rdmacm's INIT attributes name no FLUSH type.
            attr.qp_access_flags = attr.qp_access_flags | self.qp_access
        self.qp.modify(attr, mask)

    def to_error(self) -> None:
        """Error state: every outstanding work request completes with IBV_WC_WR_FLUSH_ERR."""
        self.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def poll(self, limit: int = 64) -> list[WC]:
        """Completions queued now, without touching the channel (the busy-poll path)."""
        out: list[WC] = []
        while True:
            n, wcs = self.cq.poll(limit)
            out.extend(wcs[:n])
            if n < limit:
                return out

    def completions(self) -> list[WC]:
        """The completions queued now; consumes and re-arms the channel's notification first,
        so that one arriving after this call makes :attr:`fd` readable again."""
        try:
            self.channel.get_cq_event(self.cq)
        except PyverbsRDMAError as exc:
            if not again(exc):
                raise
        else:
            self.cq.ack_events(1)
        self.cq.req_notify()
        return self.poll()

    def post_send(self, wrs: Sequence[SendWR]) -> None:
        """One ibv_post_send of the whole chain: the device sees it at once, in this order.
        (On an extended queue pair: one ibv_wr_start .. ibv_wr_complete of it.)"""
        if self.extended:
            self._post_ex(wrs)
            return
        for a, b in zip(wrs, wrs[1:], strict=False):
            a.next_wr = b
        self.qp.post_send(wrs[0])

    def _post_ex(self, wrs: Sequence[SendWR]) -> None:
        qp = self.qp
        qp.wr_start()
        try:
            for wr in wrs:
                kind, addr, length, lkey, rkey, raddr = wr.desc  # type: ignore[attr-defined]
                flags = wr.send_flags
                qp.wr_id = wr.wr_id
                # IBV_SEND_INLINE stays in the flags: rxe's wr_set_inline_data (rdma-core 59)
                # copies the data but does not set it, and without it the kernel ignores the data.
                qp.wr_flags = flags
                if kind in ("flush", "pflush"):
                    ftype = e.IBV_FLUSH_PERSISTENT if kind == "pflush" else e.IBV_FLUSH_GLOBAL
                    qp.wr_flush(rkey, raddr, length, ftype, e.IBV_FLUSH_RANGE)
                    continue
                if kind == "write":
                    qp.wr_rdma_write(rkey, raddr)
                elif kind == "read":
                    qp.wr_rdma_read(rkey, raddr)
                else:
                    qp.wr_send()
                if flags & e.IBV_SEND_INLINE:
                    qp.wr_set_inline_data(addr, length)
                else:
                    qp.wr_set_sge(SGE(addr, length, lkey))
        except BaseException:
            qp.wr_abort()
            raise
        qp.wr_complete()

    def post_recv(self, mr: MR, offset: int, length: int, wr_id: int) -> None:
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(mr.buf + offset, length, mr.lkey)]))

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.channel):
            try:
                obj.close()
            except PyverbsError:
                pass  # already gone with its device or protection domain


def failed(wc: WC) -> str | None:
    """Why a completion reports failure, or None for success."""
    if wc.status == e.IBV_WC_SUCCESS:
        return None
    return f"completion {WC_NAMES.get(wc.status, wc.status)} (wr_id {wc.wr_id})"


# --- work requests ---------------------------------------------------------------------------


class _WR(SendWR):
    """A SendWR that also remembers what it does (``desc``: kind, local address, length, lkey,
    rkey, remote address), which pyverbs does not read back, for extended queue pairs."""

    desc: tuple[str, int, int, int, int, int]


def _wr(desc: tuple[str, int, int, int, int, int], **kwargs: Any) -> SendWR:
    wr = _WR(**kwargs)
    wr.desc = desc
    return wr


def flush_wr(wr_id: int, rkey: int, raddr: int, length: int, persistent: bool = False) -> SendWR:
    """A signaled native RDMA FLUSH of remote [raddr, raddr+length), of the global-visibility
    type or (``persistent``) the persistent one; only an extended queue pair
    (``QueuePair(flush=True)``) can post it."""
    # pyverbs wants an SGE in every SendWR; this one is never posted with ibv_post_send.
    return _wr(("pflush" if persistent else "flush", 0, length, 0, rkey, raddr), wr_id=wr_id,
               opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(0, 0, 0)], send_flags=e.IBV_SEND_SIGNALED)


def aim_flush(wr: SendWR, wr_id: int, raddr: int, length: int) -> None:
    """Point a FLUSH made by :func:`flush_wr` at remote [raddr, raddr+length) under a new id."""
    kind, addr, _, lkey, rkey, _ = wr.desc  # type: ignore[attr-defined]
    wr.desc = (kind, addr, length, lkey, rkey, raddr)  # type: ignore[attr-defined]
    wr.wr_id = wr_id


def write_wr(wr_id: int, addr: int, length: int, lkey: int, rkey: int, raddr: int,
             signaled: bool = False, inline: bool = False) -> SendWR:
    """An RDMA WRITE of local [addr, addr+length) to remote raddr; inline when it is tiny
    (the data is copied into the work request, so the source may change right after)."""
    flags = (e.IBV_SEND_SIGNALED if signaled else 0) | (e.IBV_SEND_INLINE if inline else 0)
    wr = _wr(("write", addr, length, lkey, rkey, raddr), wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE,
             num_sge=1, sg=[SGE(addr, length, lkey)], send_flags=flags)
    wr.set_wr_rdma(rkey, raddr)
    return wr


def read_wr(wr_id: int, addr: int, length: int, lkey: int, rkey: int, raddr: int) -> SendWR:
    """A signaled RDMA READ of remote raddr into local [addr, addr+length)."""
    wr = _wr(("read", addr, length, lkey, rkey, raddr), wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ,
             num_sge=1, sg=[SGE(addr, length, lkey)], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, raddr)
    return wr


def send_wr(wr_id: int, addr: int, length: int, lkey: int, *, signaled: bool) -> SendWR:
    flags = (e.IBV_SEND_SIGNALED if signaled else 0) | (e.IBV_SEND_INLINE if length <= MAX_INLINE else 0)
    return _wr(("send", addr, length, lkey, 0, 0), wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1,
               sg=[SGE(addr, length, lkey)], send_flags=flags)


# --- messages --------------------------------------------------------------------------------


def pack_flush(key: int, seq: int, ranges: Sequence[tuple[int, int]]) -> bytes:
    if len(ranges) > MAX_FLUSH_RANGES:
        raise ValueError(f"{len(ranges)} ranges do not fit one flush message (max {MAX_FLUSH_RANGES})")
    return REQUEST_HEAD.pack(KIND_FLUSH, key, len(ranges), 0, seq) + b"".join(
        FLUSH_RANGE.pack(o, n) for o, n in ranges
    )


def pack_control(seq: int, body: bytes) -> bytes:
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"a control message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return REQUEST_HEAD.pack(KIND_CONTROL, 0, len(body), 0, seq) + body


@dataclass(frozen=True)
class Request:
    kind: bytes
    key: int
    seq: int
    ranges: list[tuple[int, int]]
    body: bytes


def unpack_request(data: bytes) -> Request:
    """A lane's request; VerbsError says what is wrong with a malformed one."""
    if len(data) < REQUEST_HEAD.size:
        raise VerbsError(f"a request of {len(data)} bytes is shorter than its header")
    kind, key, count, _, seq = REQUEST_HEAD.unpack_from(data)
    rest = data[REQUEST_HEAD.size:]
    if kind == KIND_FLUSH:
        if count > MAX_FLUSH_RANGES or len(rest) < count * FLUSH_RANGE.size:
            raise VerbsError(f"a flush request claims {count} ranges in {len(rest)} bytes")
        ranges = [FLUSH_RANGE.unpack_from(rest, i * FLUSH_RANGE.size) for i in range(count)]
        return Request(kind, key, seq, ranges, b"")
    if kind == KIND_CONTROL:
        if count > len(rest):
            raise VerbsError(f"a control request claims {count} bytes in {len(rest)}")
        return Request(kind, key, seq, [], rest[:count])
    raise VerbsError(f"unknown request kind {kind!r}")


def pack_reply(seq: int, status: int, body: bytes = b"") -> bytes:
    return REPLY_HEAD.pack(KIND_REPLY, status, len(body), 0, seq) + body


def unpack_reply(data: bytes) -> tuple[int, int, bytes]:
    """(sequence, errno, payload) of a reply; VerbsError when it is not one."""
    if len(data) < REPLY_HEAD.size:
        raise VerbsError(f"a reply of {len(data)} bytes is shorter than its header")
    kind, status, length, _, seq = REPLY_HEAD.unpack_from(data)
    if kind != KIND_REPLY or length > len(data) - REPLY_HEAD.size:
        raise VerbsError(f"malformed reply {data[:REPLY_HEAD.size]!r}")
    return seq, status, data[REPLY_HEAD.size : REPLY_HEAD.size + length]
