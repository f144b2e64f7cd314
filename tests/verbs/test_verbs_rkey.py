"""The trust model over verbs (docs/verbs.md, issue 15): a pool's rkey works only on the queue
pairs of the session it was handed to, and names nothing once that session has ended.

A real target daemon listening on rxe1's address, real sessions from rxe0 through the
project's verbs transport. A second session that presents the first one's rkey and address
(as a peer that learned them would) gets a remote access error, while the first session is
alive and after it ended; the pool never holds what it tried to write.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.base import RemoteRegion, TransportError, barrier
from rpmemfs.transport.choose import rdma_devices

IP_A = os.environ.get("RXE_IP_A", "")
IP_B = os.environ.get("RXE_IP_B", "")
pytestmark = [
    pytest.mark.skipif(not (rdma_devices() and IP_A and IP_B),
                       reason="needs RDMA devices and RXE_IP_A/RXE_IP_B: run it in the VM"),
    pytest.mark.timeout(900),
]
START_TIMEOUT = 180.0  # Python start-up under the VM's software emulation
TIMEOUT = 60.0
POOL = 1 << 20


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-verbs-rkey-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_an_rkey_works_only_in_its_own_session_and_not_after_it(work: Path) -> None:
    from rpmemfs.transport import verbs

    token_file = work / "token"
    token_file.write_text(uuid.uuid4().hex + "\n")
    token_file.chmod(0o600)
    token = token_file.read_bytes().strip()
    (work / "pools").mkdir(mode=0o700)
    t = TargetProcess(work / "pools", listen=f"{IP_B}:0", token_file=token_file, pmem="force",
                      log_path=work / "target.log")
    t.start(timeout=START_TIMEOUT)

    async def session() -> verbs.VerbsSession:
        return await verbs.connect(t.address, token, lanes=1, timeout=TIMEOUT, src=IP_A)

    async def refused(s: verbs.VerbsSession, stolen: RemoteRegion, what: str) -> None:
        lane = s.lanes[0]
        with pytest.raises(TransportError):
            # A barrier's flush (a READ, or a SEND after the writes) reports the failed WRITE.
            await barrier(lane, stolen, [(0, b"evil")])
            await lane.read(stolen, 0, 4)
        assert (work / "pools" / "a").read_bytes()[:4] == b"mine", f"{what}: the write landed"

    async def main() -> None:
        a = await session()
        region_a = await a.create_pool("a", POOL)
        await barrier(a.lanes[0], region_a, [(0, b"mine")])
        assert await a.lanes[0].read(region_a, 0, 4) == b"mine"  # the rkey works in its session

        b = await session()
        try:
            region_b = await b.create_pool("b", POOL)
            stolen = dataclasses.replace(region_b, rkey=region_a.rkey, raddr=region_a.raddr)
            await refused(b, stolen, "another live session")
        finally:
            await b.aclose()

        await a.aclose()  # the session ends: its queue pairs, memory regions and domain go
        c = await session()
        try:
            region_c = await c.create_pool("c", POOL)
            stolen = dataclasses.replace(region_c, rkey=region_a.rkey, raddr=region_a.raddr)
            await refused(c, stolen, "after the session ended")
            # A session that presents its own rkey is unharmed by all this.
            d = await session()
            try:
                region_d = await d.open_pool("a")
                assert await d.lanes[0].read(region_d, 0, 4) == b"mine"
            finally:
                await d.aclose()
        finally:
            await c.aclose()

    try:
        trio.run(main)
    finally:
        code = t.stop()
        log = t.log_text()
        t.close()
    assert code == 0, log
    assert "Traceback" not in log, log
