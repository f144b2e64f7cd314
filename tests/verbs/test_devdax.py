"""Pools on device DAX (/dev/daxX.Y), on the VM's emulated NVDIMM (vm/run.sh VM_NVDIMM with
VM_NVDIMM_MODE=devdax or both, which exports RPMEMFS_DAX_DEVS).

The pool is the device (or its first part): mkfs takes the device's size, the mount maps it
whole and makes every durability point with cache-line flushes and a fence, never msync (the
kernel refuses msync on a device DAX). A kill -9 of the mount loses no fsync'ed file; check is
clean; grow stops at the end of the device; a device in use is refused.

A target serves a pool on the other device (--pool-dev), over verbs: the kernel registers a
device DAX mapping for RDMA (it refuses file-system DAX, tests/verbs/test_dax.py), and the
target declares the appliance method for it by itself. Where the stack has native RDMA FLUSH
(Linux 6.12, pyverbs 59) the target registers the device for FLUSH of the persistent type and
the primary's barriers end with one; on the 6.1 stack with the appliance method's READ.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers
import pytest
from helpers import (
    Mount,
    assert_check_clean,
    assert_clean_error,
    cli,
    describe,
    status_json,
    wait_until,
    write_fsync,
)

from rpmemfs.devdax import probe
from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport.choose import rdma_devices


def native_flush() -> bool:
    """Whether this stack posts native RDMA FLUSH (as test_verbs_mount tells the stacks apart)."""
    from test_verbs_mount import native_flush as both_ends_have_it

    return both_ends_have_it()

DEVS = [d for d in os.environ.get("RPMEMFS_DAX_DEVS", "").split(",") if d]
IP_A = os.environ.get("RXE_IP_A", "")
IP_B = os.environ.get("RXE_IP_B", "")
pytestmark = [
    pytest.mark.skipif(len(DEVS) < 2, reason="needs two device DAX namespaces: run it in the VM "
                                            "with VM_NVDIMM_MODE=devdax (scripts/test-verbs.sh does)"),
    pytest.mark.timeout(900),
]


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(helpers, "MOUNT_TIMEOUT", 300.0)
    # On /dev/shm: the guest's / is an overlay, whose files report another device than their
    # directory, which a target refuses in its pool directory.
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-devdax-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _target_on(work: Path, dev: str, token: Path) -> TargetProcess:
    d = work / "target"
    d.mkdir(mode=0o700)
    return TargetProcess(d, listen=f"{IP_B}:0", token_file=token, extra=["--pool-dev", f"app={dev}"],
                         log_path=work / "target.log")


def _token(work: Path) -> Path:
    token = work / "token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    return token


def test_a_pool_on_device_dax_flushes_never_msyncs_and_survives_kill9(work: Path) -> None:
    dev = DEVS[0]
    info = probe(dev)
    assert info is not None and info.size % info.align == 0, info
    # Through a pool set whose part is AUTO (PMDK's size of a device DAX part): the device's.
    poolset = work / "app.set"
    poolset.write_text(f"PMEMPOOLSET\nAUTO {dev}\n")
    res = cli("mkfs", poolset, "--force", timeout=300)
    assert res.returncode == 0, describe(res)
    assert f"created pool {dev}" in res.stdout, res.stdout
    # A pool is there now: making another needs --force, as for a file.
    assert_clean_error(cli("mkfs", dev, timeout=300), "holds an rpmemfs pool .* use --force", one_line=True)
    m = Mount(Path(dev), work / "mnt", work, options="pmem=auto")
    m.start()
    try:
        st = status_json(m.path)
        assert st["pmem_mode"] == "devdax" and st["size"] == info.size, st
        before = st["persists"]
        data = {f"f{i}": os.urandom(3000 + 7000 * i) for i in range(8)}
        for name, payload in data.items():
            write_fsync(m.path / name, payload)
        after = status_json(m.path)["persists"]
        assert after["flush_fence"] >= before["flush_fence"] + len(data), (before, after)
        assert after["msync"] == 0, after  # never: the kernel would refuse it (EINVAL)
        # The mount holds the device as it holds a pool file: nothing else may write it.
        assert_clean_error(cli("mkfs", dev, "--force", timeout=300), "is in use", one_line=True)
        assert_clean_error(cli("check", dev, timeout=300), f"pool {dev} is mounted at", one_line=True)
        m.kill9()
        assert_check_clean(Path(dev))
        m.start()
        for name, payload in data.items():
            assert (m.path / name).read_bytes() == payload, name
        assert status_json(m.path)["pmem_mode"] == "devdax"
        m.unmount()
    finally:
        m.cleanup()
    assert_check_clean(Path(dev))


def test_a_smaller_pool_on_a_device_grows_up_to_the_device_and_no_further(work: Path) -> None:
    dev = DEVS[1]
    info = probe(dev)
    assert info is not None
    half = info.size // 2 // (1 << 20) << 20
    too_big = f"{info.size + (2 << 20)}"
    assert_clean_error(cli("mkfs", dev, "--size", too_big, "--force", timeout=300), "does not fit",
                       one_line=True)
    res = cli("mkfs", dev, "--size", str(half), "--force", timeout=300)
    assert res.returncode == 0, describe(res)
    m = Mount(Path(dev), work / "mnt", work, options="pmem=auto")
    m.start()
    try:
        assert status_json(m.path)["size"] == half
        write_fsync(m.path / "kept", b"x" * 100_000)
        m.unmount()
    finally:
        m.cleanup()
    assert_clean_error(cli("grow", dev, "--size", too_big, timeout=300), "a device cannot grow",
                       one_line=True)
    res = cli("grow", dev, "--size", str(info.size), timeout=300)
    assert res.returncode == 0, describe(res)
    assert_check_clean(Path(dev))
    m.start()
    try:
        st = status_json(m.path)
        assert st["size"] == info.size and st["pmem_mode"] == "devdax", st
        assert (m.path / "kept").read_bytes() == b"x" * 100_000
        m.unmount()
    finally:
        m.cleanup()


def test_a_target_serves_a_pool_on_device_dax_over_verbs(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not (rdma_devices() and IP_A and IP_B):
        pytest.skip("needs RDMA devices (rxe) in the VM")
    monkeypatch.setenv("RPMEMFS_RDMA_SRC", IP_A)
    primary, replica = DEVS
    info = probe(primary)
    assert info is not None
    token = _token(work)
    d = work / "target"
    # No --persist: a target whose pools are on device DAX declares the appliance method.
    t = _target_on(work, replica, token)
    m = Mount(Path(primary), work / "mnt", work, options="pmem=auto")
    alone: Mount | None = None
    try:
        t.start(timeout=180)
        # The device is the target's while it runs: another target (or a mount) is refused.
        res = cli("target", "--listen", f"{IP_B}:0", "--pool-dir", d, "--token-file", token,
                  "--pool-dev", f"other={replica}", timeout=300)
        assert_clean_error(res, rf"--pool-dev other={replica}: the device is in use", one_line=True)
        assert res.returncode == 2, describe(res)
        res = cli("mkfs", primary, "--force", "--token-file", token, "--replica",
                  f"rdma://{t.address}/app", timeout=600)
        assert res.returncode == 0, describe(res) + t.log_text()
        res = cli("pools", t.address, "--json", "--token-file", token, timeout=300)
        assert res.returncode == 0, describe(res)
        assert json.loads(res.stdout)["app"]["size"] == info.size
        assert not (d / "app").exists() and (d / ".app.dev").is_file()
        m.start()
        data = {f"f{i}": os.urandom(size) for i, size in enumerate((1, 4096, 70_000, 300_000))}
        for name, payload in data.items():
            write_fsync(m.path / name, payload)
        st = status_json(m.path)
        assert st["pmem_mode"] == "devdax" and st["persists"]["msync"] == 0, st
        rep = st["replicas"][0]
        assert rep["state"] == "in-sync" and rep["transport"] == "rdma", (rep, t.log_text())
        # Where both ends have native FLUSH (the 6.12 stack), the target registers the device
        # DAX mapping for FLUSH of the persistent type, and each barrier ends with one; on
        # the 6.1 stack with apm's READ.
        native = native_flush()
        assert rep["method"] == "apm", (rep, t.log_text())  # the declared method, whatever ends it
        assert rep["flush"] == ("persistent" if native else "read"), (rep, t.log_text())
        assert rep["flushes"] == rep["barriers"] >= len(data), rep
        m.kill9()
        assert_check_clean(Path(primary))
        log = t.log_text()
        assert f"pool app mapped ({info.size} bytes of device DAX {replica})" in log, log
        if native:
            assert "pool app registered with FLUSH persistent and visibility\"" in log, log
        t.close()
        # The replica's device, with the target gone, is a pool of its own: clean, and mounted
        # alone it holds every file fsync'ed before the kill.
        assert_check_clean(Path(replica))
        alone = Mount(Path(replica), work / "alone", work,
                      options="pmem=auto,min_replicas=0,replica_timeout=1")
        alone.start()
        for name, payload in data.items():
            assert (alone.path / name).read_bytes() == payload, name
        alone.unmount()
    finally:
        m.cleanup()
        if alone is not None:
            alone.cleanup()
        t.close()


def test_failover_fail_back_and_recover_with_pools_on_device_dax(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fencing holds with pools on devices: the primary on one device dies, a new primary is
    promoted (a file) from the replica on the other device, and the old primary is refused;
    then the fail-back promotes onto the old primary's device, copying only what changed, and
    the file primary is refused in turn; recover rewrites the device from the replica."""
    if not (rdma_devices() and IP_A and IP_B):
        pytest.skip("needs RDMA devices (rxe) in the VM")
    monkeypatch.setenv("RPMEMFS_RDMA_SRC", IP_A)
    primary, replica = DEVS
    token = _token(work)
    t = _target_on(work, replica, token)

    def src() -> str:
        return f"rdma://{t.address}/app"

    mounts: list[Mount] = []

    def mount(pool: Path, name: str, options: str = "pmem=auto") -> Mount:
        m = Mount(pool, work / name, work, options=options)
        mounts.append(m)
        return m

    def promote(onto: Path) -> dict[str, Any]:
        res = cli("promote", onto, "--from", src(), "--token-file", token, "--json",
                  timeout=600)
        assert res.returncode == 0, describe(res) + t.log_text()
        result: dict[str, Any] = json.loads(res.stdout)
        return result

    try:
        t.start(timeout=180)
        # A pool-set file whose part is a device DAX (a pool of 16 MiB on it: quicker copies).
        poolset = work / "app.set"
        poolset.write_text(f"PMEMPOOLSET\n16M {primary}\nREPLICA {src()}\n")
        res = cli("mkfs", poolset, "--force", "--token-file", token, timeout=600)
        assert res.returncode == 0, describe(res) + t.log_text()
        old = mount(poolset, "old")
        old.start()
        first = {f"a{i}": os.urandom(5000 + 40_000 * i) for i in range(4)}
        for name, payload in first.items():
            write_fsync(old.path / name, payload)
        assert status_json(old.path)["pmem_mode"] == "devdax"
        old.kill9()

        new_pool = work / "new.pool"
        took = promote(new_pool)
        assert len(took["claimed"]) == 1 and not took["unreachable"], took
        # The old primary, on its device, is fenced: its next mount is refused.
        assert "taken over" in mount(Path(primary), "again").start_expect_failure()
        # min_replicas=0: it writes on while its one replica is stopped, below.
        new = mount(new_pool, "new", "pmem=auto,min_replicas=0,replica_timeout=5")
        new.start()
        for name, payload in first.items():
            assert (new.path / name).read_bytes() == payload, name
        second = {f"b{i}": os.urandom(70_000) for i in range(3)}
        for name, payload in second.items():
            write_fsync(new.path / name, payload)
        rep = status_json(new.path)["replicas"][0]
        assert rep["state"] == "in-sync" and rep["method"] == "apm", rep
        assert rep["flush"] == ("persistent" if native_flush() else "read"), rep
        res = cli("verify", new.path, timeout=600)  # the device replica, chunk by chunk
        assert res.returncode == 0 and ": identical," in res.stdout, describe(res)
        # Resync onto the device: the target stops, the primary writes on, and the target
        # back on its device is sent what it missed.
        t.stop()
        third = {f"c{i}": os.urandom(50_000) for i in range(3)}
        for name, payload in third.items():
            write_fsync(new.path / name, payload)
        t = t.respawn(work / "target-again.log")
        t.start(timeout=180)
        assert wait_until(lambda: status_json(new.path)["replicas"][0]["state"] == "in-sync", timeout=600), \
            status_json(new.path)
        assert status_json(new.path)["replicas"][0]["resyncs"] >= 1
        second.update(third)
        new.unmount()

        # Fail-back onto the device: it holds an older copy of this pool, so only the chunks
        # that changed are copied, and the file primary is fenced in its turn.
        back = promote(Path(primary))
        assert 0 < back["chunks_differing"] < back["chunks_compared"], back
        assert "taken over" in mount(new_pool, "new-again").start_expect_failure()
        home = mount(Path(primary), "home")
        home.start()
        for name, payload in {**first, **second}.items():
            assert (home.path / name).read_bytes() == payload, name
        assert status_json(home.path)["pmem_mode"] == "devdax"
        res = cli("verify", home.path, timeout=600)  # a device primary against a device replica
        assert res.returncode == 0 and ": identical," in res.stdout, describe(res)
        home.unmount()
        res = cli("sync", primary, "--token-file", token, timeout=600)  # offline, on the device
        assert res.returncode == 0, describe(res)

        # recover rewrites the device from the replica: a device holding a pool only with
        # --force, and what it makes checks clean and mounts with every file.
        assert_clean_error(cli("recover", primary, "--from", src(), "--token-file", token, timeout=300),
                           f"{primary} holds an rpmemfs pool .*use --force", one_line=True)
        res = cli("recover", primary, "--from", src(), "--token-file", token, "--force", timeout=600)
        assert res.returncode == 0, describe(res) + t.log_text()
        assert_check_clean(Path(primary))
        home.start()
        for name, payload in {**first, **second}.items():
            assert (home.path / name).read_bytes() == payload, name
        home.unmount()
    finally:
        for m in mounts:
            m.cleanup()
        t.close()
