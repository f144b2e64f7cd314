"""Both ends of an RDMA connection for the verbs tests, on pyverbs (rdma-core 44 or 59).

The test process is the initiator and imports this module; the target is this file run as a
script in a process of its own (pyverbs' blocking calls hold the GIL, and a vanishing peer
must be a process that dies):

    python verbs_peer.py target IP PORT POOL_FILE [flush]

The target maps POOL_FILE, registers the mapping once with remote read and write access
(with ``flush``, also IBV_ACCESS_FLUSH_GLOBAL on the MR and on each connection's queue pair:
native RDMA FLUSH, rdma-core 45+ and Linux 6.2+; see test_verbs_flush.py), prints ``ready``
and serves one connection after another. It tells each initiator where the pool is (rkey,
address, size) in the private data of its rdmacm accept. It answers a flush request (a SEND
listing (offset, length) ranges: the general-purpose method) by msync-ing those ranges and
SENDing a reply. It exits when its standard input closes.

Nothing here blocks: rdmacm events and completions are read from non-blocking file
descriptors, and the callers wait for those descriptors (the target with poll(2), the tests
with trio), which is how a trio daemon has to drive verbs too. pyverbs 44 does not expose
those descriptors; the product's rpmemfs.transport.rdma (used here) finds them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pyverbs.cmid import CMID, AddrInfo
from pyverbs.cq import WC
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.wr import SendWR

from rpmemfs.transport import rdma
from rpmemfs.transport.choose import rdma_devices  # noqa: F401  (the tests use it from here)
from rpmemfs.transport.rdma import (  # noqa: F401  (the tests use them through this module)
    CM_NAMES,
    MAX_INLINE,
    PORT_SPACE,
    WC_NAMES,
    Event,
    EventChannel,
    VerbsError,
    ce,  # pyverbs' enums, under rdma-core 44's names or 59's
    conn_param,
    device_name,
    e,
)

MAX_SEND_WR = 128
MAX_RECV_WR = 16
MSG_SIZE = 4096  # largest flush request or reply
RECV_SLOTS = 4  # flush requests a target connection can have queued
POOL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
# Native RDMA FLUSH: the access flag exists from rdma-core 45 on (0: this pyverbs has none).
# FLUSH_GLOBAL only: rxe refuses FLUSH_PERSISTENT on memory that is not pmem (EINVAL).
FLUSH_GLOBAL_ACCESS = rdma.FLUSH_ACCESS
DEVICE_FLUSH_GLOBAL = rdma.DEVICE_FLUSH_GLOBAL  # the device_cap_flags_ex bit (Linux 6.2+ rxe)
PAGE = mmap.PAGESIZE

# Wire formats of this two-process test (not the product's): the pool description travels in
# the accept's private data (at most 196 bytes for RDMA_PS_TCP); the flush request and its
# reply travel as SENDs.
POOL_INFO = struct.Struct("<4sIQQ")  # b"POOL", rkey, address, size
FLUSH_HEAD = struct.Struct("<4sI")  # b"FLSH", number of ranges
FLUSH_RANGE = struct.Struct("<QQ")  # offset, length
FLUSH_REPLY = struct.Struct("<4sIQ")  # b"DONE", errno (0: persisted), bytes msync-ed
MAX_RANGES = (MSG_SIZE - FLUSH_HEAD.size) // FLUSH_RANGE.size


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


def flush_unsupported(dev: str) -> str | None:
    """Why native RDMA FLUSH (IBV_WR_FLUSH, FLUSH_GLOBAL) cannot be used on ``dev``, or None.

    Checks what can be checked without a connection: this pyverbs (rdma-core 45+) and the
    device's capability bit (rxe advertises it from Linux 6.2 on). Whether the userspace
    provider takes IBV_QP_EX_WITH_FLUSH only shows when an extended QP is created."""
    from pyverbs.qp import QPEx

    if not (FLUSH_GLOBAL_ACCESS and hasattr(e, "IBV_QP_EX_WITH_FLUSH") and hasattr(QPEx, "wr_flush")):
        return "this pyverbs has no RDMA FLUSH (IBV_QP_EX_WITH_FLUSH, QPEx.wr_flush: rdma-core 45+)"
    with Context(name=dev) as ctx:
        caps = ctx.query_device_ex().device_cap_flags_ex
    if not caps & DEVICE_FLUSH_GLOBAL:
        return (f"{dev} does not advertise FLUSH_GLOBAL (device_cap_flags_ex {caps:#x}, bit 38 clear;"
                " rxe has it from Linux 6.2 on)")
    return None


def wait_readable(fds: Sequence[int], timeout: float | None) -> set[int]:
    """poll(2): the descriptors of ``fds`` that are readable (or hung up) within ``timeout``."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000))
    return {fd for fd, _ in poller.poll(ms)}


# --- one connection --------------------------------------------------------------------------


class Conn(rdma.QueuePair):
    """The queue pair of one connection (the product's), with this test's queue depths.

    ``qp_access``: access flags added to those rdmacm computes for the INIT transition
    (remote write and read); a FLUSH responder needs IBV_ACCESS_FLUSH_GLOBAL there too, not
    only on the MR."""

    def __init__(self, cmid: CMID, ctx: Context, pd: PD, qp_access: int = 0) -> None:
        self.qp_access = qp_access
        self.cm_access = 0  # what rdmacm computed for INIT, for the log
        super().__init__(cmid, ctx, pd, send_depth=MAX_SEND_WR, recv_depth=MAX_RECV_WR)

    def to_state(self, state: int) -> None:
        attr, mask = self.cmid.init_qp_attr(state)
        if state == e.IBV_QPS_INIT:
            self.cm_access = attr.qp_access_flags
        if state == e.IBV_QPS_INIT and self.qp_access:
            attr.qp_access_flags = attr.qp_access_flags | self.qp_access
            mask |= e.IBV_QP_ACCESS_FLAGS
        self.qp.modify(attr, mask)

    def post_send_chain(self, wrs: Sequence[SendWR]) -> None:
        self.post_send(wrs)


def check(wc: WC, what: str) -> WC:
    if wc.status != e.IBV_WC_SUCCESS:
        raise VerbsError(f"{what}: completion {WC_NAMES.get(wc.status, wc.status)} (wr_id {wc.wr_id})")
    return wc


# --- work requests ---------------------------------------------------------------------------


def write_wr(wr_id: int, mr: MR, offset: int, length: int, rkey: int, raddr: int) -> SendWR:
    """An unsignaled RDMA WRITE of mr[offset:offset+length]; inline when it is tiny."""
    return rdma.write_wr(wr_id, mr.buf + offset, length, mr.lkey, rkey, raddr, inline=length <= MAX_INLINE)


def read_wr(wr_id: int, mr: MR, offset: int, length: int, rkey: int, raddr: int) -> SendWR:
    """A signaled RDMA READ into mr[offset:offset+length]."""
    return rdma.read_wr(wr_id, mr.buf + offset, length, mr.lkey, rkey, raddr)


def send_wr(wr_id: int, mr: MR, offset: int, length: int, *, signaled: bool) -> SendWR:
    return rdma.send_wr(wr_id, mr.buf + offset, length, mr.lkey, signaled=signaled)


# --- the target ------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[target {os.getpid()}] {msg}", file=sys.stderr, flush=True)


class Target:
    """Serves one pool file to one initiator at a time."""

    def __init__(self, ip: str, port: int, path: str, flush: bool = False) -> None:
        if flush and not FLUSH_GLOBAL_ACCESS:
            raise VerbsError("flush: this pyverbs has no IBV_ACCESS_FLUSH_GLOBAL (rdma-core 45+)")
        self.flush_access = FLUSH_GLOBAL_ACCESS if flush else 0
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
        self.pool_mr = MR(self.pd, self.size, POOL_ACCESS | self.flush_access, address=addr)
        self.msgs = MR(self.pd, MSG_SIZE * (RECV_SLOTS + 1), e.IBV_ACCESS_LOCAL_WRITE)
        self.info = PoolInfo(self.pool_mr.rkey, addr, self.size)
        self.conn: Conn | None = None
        self.listen_id.listen(4)

    def reply_offset(self) -> int:
        return MSG_SIZE * RECV_SLOTS

    def run(self) -> int:
        print("ready", flush=True)
        log(f"listening on {device_name(self.listen_id)}, pool rkey {self.info.rkey:#x} size {self.size}"
            + (" (FLUSH_GLOBAL)" if self.flush_access else ""))
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
            conn = Conn(ev.cmid, self.ctx, self.pd, self.flush_access)
            for slot in range(RECV_SLOTS):
                conn.post_recv(self.msgs, slot * MSG_SIZE, MSG_SIZE, slot)
            conn.to_state(e.IBV_QPS_RTR)
            conn.to_state(e.IBV_QPS_RTS)
            ev.cmid.accept(conn_param(conn.qp.qp_num, self.info.pack()))
            self.conn = conn
            log(f"connection request accepted (QP access flags {conn.cm_access:#x} from rdmacm"
                f"{f', {conn.qp_access:#x} added' if conn.qp_access else ''})")
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
    if len(argv) not in (5, 6) or argv[1] != "target" or argv[5:] not in ([], ["flush"]):
        print(f"usage: {argv[0]} target IP PORT POOL_FILE [flush]", file=sys.stderr)
        return 2
    return Target(argv[2], int(argv[3]), argv[4], flush=argv[5:] == ["flush"]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
