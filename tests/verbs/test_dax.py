"""The real persistent-memory path, on the VM's emulated NVDIMM (vm/run.sh VM_NVDIMM: ext4 on
/dev/pmem0 mounted with -o dax at $RPMEMFS_PMEM_DIR).

With the pool there and pmem=auto, the mount maps it with MAP_SYNC ("dax") and every
durability point takes the cache-flush-and-fence path: no msync at all. It keeps every fsync'ed
write across a kill -9. Targets with their pools there map them the same way, may declare the
appliance method (writes placed in persistent memory), and replicate over TCP; over verbs the
kernel refuses to register file-system DAX memory (no on-demand paging on rxe), and the target
says so.
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
from helpers import Mount, assert_check_clean, cli, pool_content, replica_file, status_json, write_fsync

from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.choose import rdma_devices

PMEM_DIR = os.environ.get("RPMEMFS_PMEM_DIR", "")
IP_A = os.environ.get("RXE_IP_A", "")
IP_B = os.environ.get("RXE_IP_B", "")
pytestmark = [
    pytest.mark.skipif(not PMEM_DIR, reason="needs a DAX file system: run it in the VM with VM_NVDIMM"),
    pytest.mark.timeout(900),
]
START_TIMEOUT = 180.0


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(helpers, "MOUNT_TIMEOUT", 300.0)
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-dax-", dir=PMEM_DIR))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_pool_is_mapped_with_map_sync_and_fsync_never_msyncs(work: Path) -> None:
    pool = work / "p.pool"
    assert cli("mkfs", pool, "--size", "16M", timeout=300).returncode == 0
    m = Mount(pool, work / "mnt", work, options="pmem=auto")
    m.start()
    try:
        st = status_json(m.path)
        assert st["pmem_mode"] == "dax" and st["pmem_requested"] == "auto", st
        before = st["persists"]
        data = {f"f{i}": os.urandom(5000 + 3000 * i) for i in range(10)}
        for name, payload in data.items():
            write_fsync(m.path / name, payload)
        after = status_json(m.path)["persists"]
        assert after["flush_fence"] >= before["flush_fence"] + len(data), (before, after)
        assert after["msync"] == 0, after  # never, not even at mount
        # A crash right after: every fsync'ed write is there at the next mount.
        m.kill9()
        assert_check_clean(pool)
        m.start()
        for name, payload in data.items():
            assert (m.path / name).read_bytes() == payload, name
        assert status_json(m.path)["pmem_mode"] == "dax"
    finally:
        m.cleanup()


@pytest.mark.parametrize("scheme", ["tcp", "rdma"])
def test_targets_on_dax_replicate_over_tcp_and_say_why_not_over_verbs(
        work: Path, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if scheme == "rdma":
        if not (rdma_devices() and IP_A and IP_B):
            pytest.skip("needs RDMA devices (rxe) in the VM")
        monkeypatch.setenv("RPMEMFS_RDMA_SRC", IP_A)
    listen = f"{IP_B or '127.0.0.1'}:0"
    token = work / "token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    d = work / "target"
    d.mkdir()
    # --pmem auto: the target maps its pools with MAP_SYNC here, which --persist apm needs.
    t = TargetProcess(d, listen=listen, token_file=token, persist="apm", pmem="auto",
                      log_path=work / "target.log")
    mount: Mount | None = None
    try:
        t.start(timeout=START_TIMEOUT)
        pool = work / "app.pool"
        res = cli("mkfs", pool, "--size", "16M", "--token-file", token,
                  "--replica", f"{scheme}://{t.address}/app", timeout=600)
        if scheme == "rdma":
            # What the emulation shows: Linux will not pin file-system DAX pages for an RDMA
            # memory registration (ibv_reg_mr: EOPNOTSUPP) unless the NIC pages on demand,
            # which rxe does not here. The target says so; nothing is left behind.
            assert res.returncode == 1, res.stdout + res.stderr
            assert "refuses to pin file-system DAX memory" in res.stderr, res.stderr
            assert not pool.exists() and not (d / "app").exists()
            return
        assert res.returncode == 0, res.stderr
        mount = Mount(pool, work / "mnt", work, options="pmem=auto")
        mount.start()
        payloads = {f"f{i}": os.urandom(size) for i, size in enumerate((1, 4096, 70_000, 1 << 20))}
        for name, data in payloads.items():
            write_fsync(mount.path / name, data)
        st = status_json(mount.path)
        assert st["pmem_mode"] == "dax" and st["persists"]["msync"] == 0, st
        rep = st["replicas"][0]
        assert rep["state"] == "in-sync" and rep["transport"] == scheme, rep
        assert rep["method"] == "apm" and rep["flush"] == "read", rep  # over tcp:// only
        assert rep["flushes"] == rep["barriers"] >= len(payloads), rep
        mount.unmount()
        assert pool_content(replica_file(t, "app")) == pool_content(pool)
        assert "pmem dax" in t.log_text(), t.log_text()
    finally:
        if mount is not None:
            mount.cleanup()
        t.close()
