"""End to end over real verbs: a FUSE mount whose two replicas are reached with rdma:// (queue
pairs from rxe0 to target daemons listening on rxe1's address), inside the VM.

Files written and fsynced through the mount land byte for byte in both replica pools; the
status shows each replica's transport, method and one flush per barrier.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
from helpers import Mount, cli, pool_content, replica_file, status_json, write_fsync

from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.choose import rdma_devices

IP_A = os.environ.get("RXE_IP_A", "")
IP_B = os.environ.get("RXE_IP_B", "")
pytestmark = [
    pytest.mark.skipif(not (rdma_devices() and IP_A and IP_B),
                       reason="needs RDMA devices and RXE_IP_A/RXE_IP_B: run it in the VM"),
    pytest.mark.timeout(900),
]
START_TIMEOUT = 180.0  # Python start-up under the VM's software emulation


def native_flush() -> bool:
    """Whether this pyverbs and rxe0 can post native RDMA FLUSH (rdma-core 45+, Linux 6.2+)."""
    from rpmemfs.transport import rdma

    if not rdma.qpex_has_flush():
        return False
    ctx = rdma.Context(name=rdma_devices()[0])
    try:
        return bool(rdma.flush_access(ctx))
    finally:
        ctx.close()


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-verbs-mount-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_mount_replicates_over_verbs(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "MOUNT_TIMEOUT", 300.0)
    monkeypatch.setenv("RPMEMFS_RDMA_SRC", IP_A)  # queue pairs leave from rxe0
    token = work / "token"
    token.write_text(uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    targets = []
    mount: Mount | None = None
    try:
        for i, extra in enumerate((dict(pmem="force", persist="apm"), dict(pmem="msync"))):
            d = work / f"target{i}"
            d.mkdir()
            t = TargetProcess(d, listen=f"{IP_B}:0", token_file=token, log_path=work / f"target{i}.log",
                              **extra)  # type: ignore[arg-type]
            t.start(timeout=START_TIMEOUT)
            targets.append(t)
        pool = work / "app.pool"
        res = cli("mkfs", pool, "--size", "16M", "--token-file", token,
                  *(a for t in targets for a in ("--replica", f"rdma://{t.address}/app")), timeout=600)
        assert res.returncode == 0, res.stderr
        mount = Mount(pool, work / "mnt", work, options="pmem=force")
        mount.start()
        payloads = {f"f{i}": os.urandom(size) for i, size in enumerate((1, 4096, 70_000, 1 << 20))}
        for name, data in payloads.items():
            write_fsync(mount.path / name, data)
        st = status_json(mount.path)
        reps = st["replicas"]
        assert [r["transport"] for r in reps] == ["rdma", "rdma"], reps
        assert [r["state"] for r in reps] == ["in-sync", "in-sync"], reps
        # The appliance target's flush is a native RDMA FLUSH where both ends have it.
        assert {r["method"] for r in reps} == {"apm", "gpspm"}
        # Of the global-visibility type: the apm target's pools are not persistent memory
        # (pmem=force on /dev/shm), where rxe refuses a registration for the persistent type.
        assert {r["flush"] for r in reps} == {"visibility" if native_flush() else "read", "send"}, reps
        if native_flush():
            assert ("pool app registered with FLUSH visibility (FLUSH persistent and visibility "
                    "refused") in targets[0].log_text()
        for r in reps:
            assert r["barriers"] >= len(payloads), r
            assert r["flushes"] == r["barriers"], r  # exactly one flush per barrier
        for name, data in payloads.items():
            assert (mount.path / name).read_bytes() == data
        mount.unmount()
        assert not mount.internal_errors(), mount.internal_errors()
        local = pool_content(pool)
        for t in targets:
            assert pool_content(replica_file(t, "app")) == local, f"replica on {t.address} differs"
    finally:
        if mount is not None:
            mount.cleanup()
        for t in targets:
            t.close()
