"""Native RDMA FLUSH (IBV_WR_FLUSH) as a barrier, between two processes on the VM's rxe pair.

The target (``verbs_peer.py target ... flush``, on rxe1) registers its pool with remote write
and read access plus IBV_ACCESS_FLUSH_GLOBAL (not FLUSH_PERSISTENT: rxe refuses that on
memory that is not pmem) and grants FLUSH_GLOBAL on each connection's queue pair. This
process (rxe0) connects with rdmacm and posts, through an extended queue pair (QPEx, with
IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_FLUSH), one chain: wr_start, unsignaled
wr_rdma_writes, one signaled wr_flush(FLUSH_GLOBAL, FLUSH_RANGE), wr_complete; then waits for
exactly one completion (the FLUSH's) and checks the bytes are in the target's file.

Needs rdma-core >= 45 in pyverbs and in the userspace rxe provider, and Linux >= 6.2 (rxe's
FLUSH). Elsewhere (Debian 12's pyverbs 44, its 6.1 kernel) it skips and says which is missing:
``VM_KERNEL=6.12... vm/run.sh vm/venv59/bin/python -m pytest tests/verbs/test_verbs_flush.py``.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytest.importorskip("pyverbs", reason="pyverbs is not importable (Debian's python3-pyverbs)")

import verbs_peer as vp  # noqa: E402
from pyverbs.cmid import CMID, AddrInfo  # noqa: E402
from pyverbs.cq import CQ, WC, CompChannel  # noqa: E402
from pyverbs.device import Context  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError  # noqa: E402
from pyverbs.wr import SGE  # noqa: E402
from test_verbs_transport import TargetProcess, assert_in_pool  # noqa: E402

from rpmemfs.transport import rdma  # noqa: E402
from rpmemfs.transport.rdma import ce, e  # noqa: E402  (pyverbs' enums, either version's names)

IP_A = os.environ.get("RXE_IP_A", "")
IP_B = os.environ.get("RXE_IP_B", "")
DEV_A = os.environ.get("RXE_DEV_A", "")
pytestmark = pytest.mark.skipif(
    not (vp.rdma_devices() and IP_A and IP_B and DEV_A),
    reason="needs RDMA devices and RXE_IP_A/RXE_IP_B: run it in the VM (scripts/test-verbs.sh)",
)

POOL_SIZE = 1 << 20
TARGET_PORT = 7473
READY_TIMEOUT = 120.0  # a Python process start-up under TCG takes seconds
CONNECT_TIMEOUT = 60.0
BARRIER_TIMEOUT = 30.0
SEND_DEPTH = 64
FLUSH_ID = 950


def make_pool(tag: str) -> Path:
    fd, name = tempfile.mkstemp(prefix=f"verbs-{tag}-", dir="/dev/shm")
    os.ftruncate(fd, POOL_SIZE)
    os.close(fd)
    return Path(name)


def send_ops() -> int:
    return e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_FLUSH


class FlushQueuePair(rdma.QueuePair):
    """rdma.QueuePair with an extended QP that can post FLUSH (ibv_wr_* API)."""

    def __init__(self, cmid: CMID | None, ctx: Context, pd: PD) -> None:
        from pyverbs.qp import QPCap, QPEx, QPInitAttrEx

        self.cmid = cmid  # type: ignore[assignment]  (None: a probe that is never connected)
        self.channel, self.fd = rdma.with_new_fd(lambda: CompChannel(ctx), "infinibandevent")
        try:
            self.cq = CQ(ctx, SEND_DEPTH + 2, None, self.channel, 0)
            self.cq.req_notify()
            cap = QPCap(max_send_wr=SEND_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttrEx(
                qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0, pd=pd,
                comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                send_ops_flags=send_ops(),
            )
            self.qp = QPEx(ctx, init)
            if cmid is not None:
                self.to_state(e.IBV_QPS_INIT)
        except BaseException:
            self.channel.close()
            raise

    def post_flush_barrier(self, writes: Sequence[tuple[int, int, int]], lkey: int, rkey: int,
                           flush_addr: int, flush_len: int) -> None:
        """One ibv_wr_start .. ibv_wr_complete chain: unsignaled WRITEs (local address,
        length, remote address), then one signaled FLUSH of [flush_addr, +flush_len)."""
        qp = self.qp
        qp.wr_start()
        for i, (laddr, length, raddr) in enumerate(writes):
            qp.wr_id = i
            qp.wr_flags = 0
            qp.wr_rdma_write(rkey, raddr)
            qp.wr_set_sge(SGE(laddr, length, lkey))
        qp.wr_id = FLUSH_ID
        qp.wr_flags = e.IBV_SEND_SIGNALED
        qp.wr_flush(rkey, flush_addr, flush_len, e.IBV_FLUSH_GLOBAL, e.IBV_FLUSH_RANGE)
        qp.wr_complete()


def provider_refuses_flush(dev: str) -> str | None:
    """Create (and drop) an extended QP with IBV_QP_EX_WITH_FLUSH on ``dev``: the userspace
    provider (librxe) of rdma-core < 45 refuses the send_ops_flags."""
    with Context(name=dev) as ctx, PD(ctx) as pd:
        try:
            probe = FlushQueuePair(None, ctx, pd)
        except PyverbsError as exc:
            return f"the userspace provider of {dev} refuses an extended QP with FLUSH: {exc}"
        probe.close()
    return None


@pytest.fixture(scope="module")
def flush_target() -> Iterator[TargetProcess]:
    reason = vp.flush_unsupported(DEV_A) or provider_refuses_flush(DEV_A)
    if reason:
        pytest.skip(reason)
    pool = make_pool("flush")
    proc = TargetProcess(TARGET_PORT, pool, "flush")
    yield proc
    status = proc.stop()
    pool.unlink()
    assert status == 0, f"the target exited with status {status}"


class Initiator:
    """One rdmacm connection whose queue pair is a FlushQueuePair; waits with poll(2)."""

    def __init__(self, port: int) -> None:
        self.events = vp.EventChannel()
        self.cmid = self.events.create_id()
        self.conn: FlushQueuePair | None = None
        deadline = time.monotonic() + CONNECT_TIMEOUT
        rai = AddrInfo(src=IP_A, dst=IP_B, dst_service=str(port), port_space=vp.PORT_SPACE)
        self.cmid.resolve_addr(rai, 5000)
        self.expect(ce.RDMA_CM_EVENT_ADDR_RESOLVED, deadline)
        self.cmid.resolve_route(5000)
        self.expect(ce.RDMA_CM_EVENT_ROUTE_RESOLVED, deadline)
        self.ctx = Context(name=vp.device_name(self.cmid))
        self.pd = PD(self.ctx)
        self.conn = FlushQueuePair(self.cmid, self.ctx, self.pd)
        self.stage = MR(self.pd, POOL_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self.cmid.connect(vp.conn_param(self.conn.qp.qp_num))
        response = self.expect(ce.RDMA_CM_EVENT_CONNECT_RESPONSE, deadline)
        self.pool = vp.PoolInfo.unpack(response.private)
        self.conn.to_state(e.IBV_QPS_RTR)
        self.conn.to_state(e.IBV_QPS_RTS)
        self.cmid.establish()

    def expect(self, kind: int, deadline: float) -> vp.Event:
        while (ev := self.events.next()) is None:
            if not vp.wait_readable([self.events.fd], deadline - time.monotonic()):
                raise TimeoutError(f"no {vp.CM_NAMES[kind]} in time")
        if ev.kind != kind:
            raise vp.VerbsError(f"expected {vp.CM_NAMES[kind]}, got {ev.name}")
        return ev

    def barrier(self, writes: Sequence[tuple[int, bytes]]) -> None:
        assert self.conn is not None
        start = min(offset for offset, _ in writes)
        end = max(offset + len(data) for offset, data in writes)
        wrs = []
        for offset, data in writes:
            self.stage.write(data, len(data), offset)
            wrs.append((self.stage.buf + offset, len(data), self.pool.addr + offset))
        self.conn.post_flush_barrier(wrs, self.stage.lkey, self.pool.rkey, self.pool.addr + start,
                                     end - start)

    def wait(self, timeout: float = BARRIER_TIMEOUT) -> list[WC]:
        """The completions, once there is one (an rdmacm event first is an error)."""
        assert self.conn is not None
        deadline = time.monotonic() + timeout
        while True:
            wcs = self.conn.completions()
            if wcs:
                return wcs
            ev = self.events.next()
            if ev is not None:
                raise vp.VerbsError(f"the connection went away: {ev.name}")
            if not vp.wait_readable([self.conn.fd, self.events.fd], deadline - time.monotonic()):
                raise TimeoutError(f"no completion within {timeout} s")

    def close(self) -> None:
        try:
            self.cmid.disconnect()
        except PyverbsRDMAError:
            pass
        if self.conn is not None:
            self.conn.close()
            for obj in (self.stage, self.pd, self.ctx):
                obj.close()
        self.cmid.close()
        self.events.close()


def random_writes(rng: random.Random) -> list[tuple[int, bytes]]:
    """Several ranges, unaligned and page-crossing ones among them."""
    return [
        (rng.randrange(0, 64) * 4096, rng.randbytes(4096)),
        (rng.randrange(300_000, 400_000), rng.randbytes(333)),
        (rng.randrange(500_000, 600_000), rng.randbytes(100_000)),
        (rng.randrange(900_000, POOL_SIZE - 8), rng.randbytes(8)),
    ]


def test_flush_barrier_places_writes(flush_target: TargetProcess) -> None:
    """Unsignaled WRITEs and one signaled FLUSH (global visibility, range) in one chain:
    exactly one completion, IBV_WC_FLUSH, after which every written byte is in the file."""
    rng = random.Random(4)
    ini = Initiator(flush_target.port)
    try:
        for _ in range(3):
            writes = random_writes(rng)
            ini.barrier(writes)
            wcs = ini.wait()
            got = [(wc.wr_id, wc.opcode, rdma.WC_NAMES.get(wc.status, wc.status)) for wc in wcs]
            assert got == [(FLUSH_ID, e.IBV_WC_FLUSH, "IBV_WC_SUCCESS")]
            assert_in_pool(flush_target.pool, writes)
        assert ini.conn is not None and ini.conn.completions() == []
    finally:
        ini.close()
