"""The replication layer against real target daemons: pool sets, the replica table, barriers.

Targets are real `python -m rpmemfs.target` processes on loopback with pool dirs on /dev/shm,
one with the appliance method (`--pmem force --persist apm`), one with the default
general-purpose method. What a barrier left on a target is checked by reading its pool FILE.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import stop_process

from rpmemfs.fs.mkfs import mkfs
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.layout import BACKUP_OFF, HEADER_OFF, Header, PoolFormatError
from rpmemfs.replica import (
    PoolSetError,
    ReplicaError,
    ReplicaSet,
    ReplicaSpec,
    TableError,
    create_remote,
    inspect_table,
    is_poolset,
    metadata_ranges,
    parse_poolset,
    read_table,
    write_table,
)
from rpmemfs.replica.table import BACKUP_TABLE_OFF, PRIMARY_OFF
from rpmemfs.tools.processes import TargetProcess
from rpmemfs.transport import TransportError, connect

pytestmark = pytest.mark.timeout(60)

POOL = 4 << 20
TIMEOUT = 10.0


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


def read_file(path: Path) -> bytes:
    """A pool file as its replicas hold it: without the node-local sync map at its end."""
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
    try:
        return raw[: Header.decode(raw[:4096]).map_off]
    except PoolFormatError:
        return raw


# --- replica specs and pool sets -------------------------------------------------------------


def test_replica_spec_forms() -> None:
    assert ReplicaSpec.parse("node2:7420/app") == ReplicaSpec("node2:7420", "app")
    assert ReplicaSpec.parse("tcp://127.0.0.1:7420/app.1") == ReplicaSpec("127.0.0.1:7420", "app.1")
    assert ReplicaSpec.parse("[::1]:7420/app") == ReplicaSpec("[::1]:7420", "app")
    assert str(ReplicaSpec.parse("tcp://[::1]:7420/app")) == "[::1]:7420/app"


def test_replica_spec_transport() -> None:
    """The scheme names the transport; a bare address is "auto"; identity ignores it."""
    assert ReplicaSpec.parse("rdma://node2:7420/app").transport == "rdma"
    assert ReplicaSpec.parse("TCP://node2:7420/app").transport == "tcp"
    assert ReplicaSpec.parse("node2:7420/app").transport == "auto"
    assert ReplicaSpec.parse("rdma://node2:7420/app").url == "rdma://node2:7420/app"
    assert ReplicaSpec.parse("rdma://node2:7420/app") == ReplicaSpec.parse("tcp://node2:7420/app")
    assert ReplicaSpec.parse("rdma://node2:7420/app").to_json() == {
        "address": "node2:7420", "name": "app", "transport": "rdma"}
    assert "transport" not in ReplicaSpec.parse("node2:7420/app").to_json()
    text = "PMEMPOOLSET\n64M /p/a.pool\nREPLICA rdma://10.0.0.2:7420 app\nREPLICA tcp://h:1/b\n"
    assert [r.transport for r in parse_poolset(text).replicas] == ["rdma", "tcp"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("node2:7420", "HOST:PORT/NAME"),
        ("node2/app", "no port"),
        ("node2:99999/app", "port must be"),
        ("node2:0/app", "port 0"),
        ("::1:7420/app", "IPv6"),
        ("node2:7420/", "empty"),
        ("node2:7420/..x", "starts with '.'"),
        ("node2:7420/a b", "may contain only"),
        ("udp://node2:7420/app", "use tcp:// or rdma://"),
    ],
)
def test_replica_spec_errors(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="bad replica") as info:
        ReplicaSpec.parse(text)
    assert fragment in str(info.value)


def test_poolset_good() -> None:
    text = """
# the application's pool and its two replicas

PMEMPOOLSET
256M /srv/pools/../pools/app.pool   # local part
REPLICA 127.0.0.1:7420 app
REPLICA tcp://[::1]:7421/app-b
"""
    ps = parse_poolset(text)
    assert ps.size == 256 << 20
    assert ps.path == "/srv/pools/app.pool"
    assert ps.replicas == [ReplicaSpec("127.0.0.1:7420", "app"), ReplicaSpec("[::1]:7421", "app-b")]
    assert parse_poolset("PMEMPOOLSET\n4096 /p\n").replicas == []
    # PMDK's AUTO: the whole device DAX that the part names (mkfs reads its size).
    auto = parse_poolset("PMEMPOOLSET\nAUTO /dev/dax0.1\nREPLICA rdma://10.0.0.2:7420 app\n")
    assert auto.size is None and auto.path == "/dev/dax0.1" and len(auto.replicas) == 1
    assert parse_poolset("PMEMPOOLSET\nauto /dev/dax0.1\n").size is None


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("", 1, "missing header"),
        ("256M /p\nREPLICA h:1 a\n", 1, "missing header"),
        ("PMEMPOOLSET\n", 1, "no local part"),
        ("PMEMPOOLSET\n\n256Q /p\n", 3, "bad size"),
        ("PMEMPOOLSET\nAUTOMATIC /p\n", 2, "or AUTO for a whole device DAX"),
        ("PMEMPOOLSET\n0 /p\n", 2, "positive size"),
        ("PMEMPOOLSET\n256M p.pool\n", 2, "relative"),
        ("PMEMPOOLSET\n256M /a\n# c\n256M /b\n", 4, "second local part"),
        ("PMEMPOOLSET\n256M /a\nREPLICA\n", 3, "needs an address and a pool name"),
        ("PMEMPOOLSET\n256M /a\nREPLICA h:1\n", 3, "has no pool name"),
        ("PMEMPOOLSET\n256M /a\nREPLICA h:1 a b\n", 3, "3 fields"),
        ("PMEMPOOLSET\n256M /a\nREPLICA h:x a\n", 3, "port must be"),
        ("PMEMPOOLSET\n256M /a\nREPLICA h:1 ../a\n", 3, "bad replica"),
        ("PMEMPOOLSET\n256M /a extra\n", 2, "expected 'SIZE|AUTO /absolute/path'"),
    ],
)
def test_poolset_errors(text: str, line: int, fragment: str) -> None:
    with pytest.raises(PoolSetError) as info:
        parse_poolset(text, "app.set")
    assert f"app.set, line {line}:" in str(info.value)
    assert fragment in str(info.value)


def test_is_poolset(tmp_path: Path) -> None:
    good = tmp_path / "app.set"
    good.write_text("\n  \nPMEMPOOLSET\n4M /p\n")
    other = tmp_path / "notes.txt"
    other.write_text("hello\nPMEMPOOLSET\n")
    pool = tmp_path / "app.pool"
    mkfs(str(pool), POOL)
    assert is_poolset(str(good))
    assert not is_poolset(str(other))
    assert not is_poolset(str(pool))
    assert not is_poolset(str(tmp_path / "missing"))


# --- the replica table -----------------------------------------------------------------------


SPECS = [ReplicaSpec("127.0.0.1:7420", "app"), ReplicaSpec("[::1]:7421", "app-b")]


def test_table_round_trip() -> None:
    buf = bytearray(8192)
    blank = inspect_table(buf)
    assert blank.replicas == [] and blank.problem is None and blank.source is None
    ranges = write_table(buf, SPECS, "/etc/rpmemfs/token")
    assert ranges == [(BACKUP_TABLE_OFF, ranges[0][1]), (PRIMARY_OFF, ranges[0][1])]
    assert PRIMARY_OFF == HEADER_OFF + 2048 and BACKUP_TABLE_OFF == BACKUP_OFF + 2048
    assert buf[PRIMARY_OFF : PRIMARY_OFF + 8] == b"RPMREPL\x00"
    found = inspect_table(buf)
    assert (found.replicas, found.token_file, found.source, found.problem) == (
        SPECS, "/etc/rpmemfs/token", "primary", None)
    # A shorter table written over a longer one reads back as itself.
    write_table(buf, SPECS[:1])
    assert read_table(buf) == SPECS[:1]


def test_table_damaged_primary_uses_backup() -> None:
    buf = bytearray(8192)
    write_table(buf, SPECS)
    buf[PRIMARY_OFF + 20] ^= 0xFF
    found = inspect_table(buf)
    assert found.replicas == SPECS and found.source == "backup"
    assert found.problem is not None and "checksum mismatch" in found.problem
    buf[BACKUP_TABLE_OFF + 1] ^= 0xFF
    lost = inspect_table(buf)
    assert lost.replicas == [] and lost.source is None
    assert lost.problem is not None and "bad magic" in lost.problem and "checksum" in lost.problem


def test_table_too_large() -> None:
    many = [ReplicaSpec("127.0.0.1:7420", "r" * 100 + str(i)) for i in range(10)]
    with pytest.raises(TableError, match="room for 1024"):
        write_table(bytearray(8192), many)


# --- real targets ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-replica-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Target:
    def __init__(self, proc: TargetProcess, pool_dir: Path) -> None:
        self.proc = proc
        self.pool_dir = pool_dir

    @property
    def address(self) -> str:
        return self.proc.address

    def spec(self, name: str) -> ReplicaSpec:
        return ReplicaSpec.parse(f"{self.address}/{name}")

    async def flushes(self, name: str) -> int:
        async with await connect(self.address, None, timeout=TIMEOUT) as s:
            return int((await s.stats(name))[name]["flushes"])


def _start(scratch: Path, **kw: Any) -> Iterator[Target]:
    pool_dir = Path(tempfile.mkdtemp(prefix="target-", dir=scratch))
    proc = TargetProcess(pool_dir, **kw)
    proc.start()
    try:
        yield Target(proc, pool_dir)
    finally:
        killed = not proc.running
        code = proc.stop()
        log = proc.log_text()
        proc.close()
        if not killed:
            assert code == 0, log
        assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def apm(scratch: Path) -> Iterator[Target]:
    yield from _start(scratch, persist="apm", pmem="force")


@pytest.fixture(scope="module")
def gpspm(scratch: Path) -> Iterator[Target]:
    yield from _start(scratch)


class Local:
    """A local pool made by mkfs, mapped like a mount maps it."""

    def __init__(self, dirpath: Path, specs: list[ReplicaSpec] | None = None, size: int = POOL) -> None:
        self.path = dirpath / f"local-{uuid.uuid4().hex[:8]}.pool"
        self.header: Header = mkfs(str(self.path), size)
        self.pm = PoolMapping.open(str(self.path), "force")
        self.buf = self.pm.buf
        if specs:
            self.pm.persist(write_table(self.buf, specs))

    def put(self, offset: int, data: bytes) -> tuple[int, int]:
        self.buf[offset : offset + len(data)] = data
        self.pm.persist([(offset, len(data))])
        return offset, len(data)

    def close(self) -> None:
        self.pm.close()


@pytest.fixture
def local_dir(scratch: Path) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="local-", dir=scratch))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _name() -> str:
    return "r-" + uuid.uuid4().hex[:10]


async def _seed(local: Local, specs: list[ReplicaSpec]) -> None:
    ranges = metadata_ranges(local.buf)
    async with trio.open_nursery() as nursery:
        for spec in specs:
            nursery.start_soon(create_remote, spec, POOL, local.buf, ranges)


def test_create_remote_makes_an_identical_pool(apm: Target, gpspm: Target, local_dir: Path) -> None:
    specs = [apm.spec(_name()), gpspm.spec(_name())]
    local = Local(local_dir, specs)
    try:
        run(_seed, local, specs)
        want = read_file(local.path)
        for t, spec in ((apm, specs[0]), (gpspm, specs[1])):
            assert read_file(t.pool_dir / spec.name) == want
            # The remote copy carries the table, so a replica mounted alone knows its peers.
            assert read_table(read_file(t.pool_dir / spec.name)) == specs
        with pytest.raises(TransportError, match="already exists"):
            run(create_remote, specs[0], POOL, local.buf, metadata_ranges(local.buf))
    finally:
        local.close()


def test_barrier_makes_replica_files_equal_with_one_flush_each(
    apm: Target, gpspm: Target, local_dir: Path
) -> None:
    specs = [apm.spec(_name()), gpspm.spec(_name())]
    local = Local(local_dir, specs)
    hdr = local.header
    targets = [apm, gpspm]

    async def main() -> None:
        await _seed(local, specs)
        before = [await t.flushes(s.name) for t, s in zip(targets, specs, strict=True)]
        rs = await ReplicaSet.open(specs, local.buf, hdr.uuid, None, lanes=2, timeout=TIMEOUT)
        try:
            assert [r.state for r in rs.replicas] == ["in-sync", "in-sync"], rs.status()
            assert [r.method for r in rs.replicas] == ["apm", "gpspm"]
            for i in range(3):
                # Data first, then the "record" that points at it, as the filesystem orders them.
                data = local.put(hdr.data_off + i * 8192 + 100, os.urandom(5000 + i))
                record = local.put(hdr.area_off(0) + 4096 + 512 + 64 * i, os.urandom(64))
                await rs.barrier([data, record])
            after = [await t.flushes(s.name) for t, s in zip(targets, specs, strict=True)]
            for r, b, a in zip(rs.replicas, before, after, strict=True):
                assert a - b == 3 == r.flushes == r.barriers
                assert r.writes == 6 and r.bytes == sum(5000 + i + 64 for i in range(3))
            status = rs.status()
            assert [s["state"] for s in status] == ["in-sync", "in-sync"]
            assert {"address", "name", "state", "method", "barriers", "writes", "flushes", "bytes",
                    "last_error"} <= set(status[0])
        finally:
            await rs.aclose()

    try:
        run(main)
        want = read_file(local.path)
        for t, spec in zip(targets, specs, strict=True):
            assert read_file(t.pool_dir / spec.name) == want
    finally:
        local.close()


def test_a_barrier_larger_than_the_socket_buffer_goes_out_whole(
        apm: Target, gpspm: Target, local_dir: Path) -> None:
    """2,000 ranges, 32 MiB: more iovecs than one sendmsg takes and more bytes than the socket
    buffer holds, so the frames built in C go out in parts and the rest follows from Python."""
    specs = [apm.spec(_name()), gpspm.spec(_name())]
    local = Local(local_dir, specs, size=96 << 20)
    hdr = local.header
    ranges = [local.put(hdr.data_off + 32768 * i + (i % 7) * 512, os.urandom(16384)) for i in range(2000)]

    async def main() -> None:
        for spec in specs:
            await create_remote(spec, 96 << 20, local.buf, metadata_ranges(local.buf))
        rs = await ReplicaSet.open(specs, local.buf, hdr.uuid, None, lanes=2, timeout=TIMEOUT)
        try:
            # Stopped targets read nothing, so the socket takes only part of the big barrier:
            # the rest is left to send, and the small one queues behind it, not cutting in.
            for t in (apm, gpspm):
                assert t.proc.proc is not None
                stop_process(t.proc.proc.pid)
            try:
                flights = [rs.post(ranges), rs.post([local.put(hdr.data_off, b"behind the big one")])]
                assert all(p.ticket.rest for p in flights[0].posted)  # type: ignore[attr-defined]
            finally:
                for t in (apm, gpspm):
                    assert t.proc.proc is not None
                    os.kill(t.proc.proc.pid, signal.SIGCONT)
            for f in flights:
                await rs.complete(f)
            for r in rs.replicas:
                assert r.state == "in-sync" and r.barriers == 2 and r.writes == 2001
        finally:
            await rs.aclose()

    try:
        run(main)
        want = read_file(local.path)
        for t, spec in zip((apm, gpspm), specs, strict=True):
            assert read_file(t.pool_dir / spec.name) == want
    finally:
        local.close()


def test_concurrent_barriers_pipeline_on_one_ordered_lane(
        apm: Target, gpspm: Target, local_dir: Path) -> None:
    specs = [apm.spec(_name()), gpspm.spec(_name())]
    local = Local(local_dir, specs)
    hdr = local.header
    rounds = 8

    async def writer(rs: ReplicaSet, base: int) -> None:
        for i in range(rounds):
            await rs.barrier([local.put(base + i * 4096, os.urandom(4096))])

    async def main() -> None:
        await _seed(local, specs)
        rs = await ReplicaSet.open(specs, local.buf, hdr.uuid, None, lanes=2, timeout=TIMEOUT)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer, rs, hdr.data_off)
                nursery.start_soon(writer, rs, hdr.data_off + (1 << 20))
            for r, t, spec in zip(rs.replicas, (apm, gpspm), specs, strict=True):
                assert r.state == "in-sync" and r.barriers == 2 * rounds
                assert await t.flushes(spec.name) == 2 * rounds + 2  # two from create_remote
                # Every barrier on the one ordered lane; the other carries only bulk copies.
                assert r.barrier_lane.stats.flushes == 2 * rounds
            # Several barriers in flight at once: all posted before any is waited for, each
            # completes, and they complete in order.
            flights = [rs.post([local.put(hdr.data_off + 8192 * i, bytes([i]) * 100)]) for i in range(5)]
            assert all(len(f.posted) == 2 for f in flights)
            for f in flights:
                await rs.complete(f)
            assert [r.state for r in rs.replicas] == ["in-sync", "in-sync"]
            assert all(r.barriers == 2 * rounds + 5 for r in rs.replicas)
        finally:
            await rs.aclose()

    try:
        run(main)
        want = read_file(local.path)
        for t, spec in ((apm, specs[0]), (gpspm, specs[1])):
            assert read_file(t.pool_dir / spec.name) == want
    finally:
        local.close()


def test_uuid_mismatch_and_headerless_pool_are_refused(apm: Target, gpspm: Target, local_dir: Path) -> None:
    good, foreign, blank = apm.spec(_name()), gpspm.spec(_name()), gpspm.spec(_name())
    local = Local(local_dir)
    other = Local(local_dir)

    async def main() -> None:
        await _seed(local, [good])
        await _seed(other, [foreign])
        async with await connect(gpspm.address, None, timeout=TIMEOUT) as s:
            await s.create_pool(blank.name, POOL)
        rs = await ReplicaSet.open([good, foreign, blank], local.buf, local.header.uuid, None,
                                   timeout=TIMEOUT, min_replicas=1)
        try:
            assert [r.state for r in rs.replicas] == ["in-sync", "stale", "stale"]
            err = rs.replicas[1].last_error or ""
            assert str(foreign) in err
            assert local.header.uuid_str in err and other.header.uuid_str in err
            assert "not an rpmemfs pool" in (rs.replicas[2].last_error or "")
            await rs.barrier([local.put(local.header.data_off, b"still replicated")])
            assert rs.replicas[0].barriers == 1 and rs.replicas[1].barriers == 0
        finally:
            await rs.aclose()

    try:
        run(main)
        assert read_file(apm.pool_dir / good.name) == read_file(local.path)
    finally:
        local.close()
        other.close()


@pytest.fixture
def doomed(scratch: Path) -> Iterator[Target]:
    """A target of the test's own, to be killed."""
    yield from _start(scratch)


def test_killed_target_fails_by_policy(apm: Target, doomed: Target, local_dir: Path) -> None:
    specs = [apm.spec(_name()), doomed.spec(_name())]
    local = Local(local_dir, specs)
    off = local.header.data_off

    async def main() -> None:
        await _seed(local, specs)
        strict = await ReplicaSet.open(specs, local.buf, local.header.uuid, None, timeout=TIMEOUT)
        lenient = await ReplicaSet.open(specs, local.buf, local.header.uuid, None, timeout=TIMEOUT,
                                        min_replicas=1)
        try:
            await strict.barrier([local.put(off, b"before the kill")])
            doomed.proc.kill()  # SIGKILL
            with trio.fail_after(2 * TIMEOUT):
                with pytest.raises(ReplicaError) as info:
                    await strict.barrier([local.put(off + 4096, b"after the kill")])
            assert str(specs[1]) in str(info.value)
            assert [r.spec for r in info.value.failed] == [specs[1]]
            with trio.fail_after(2 * TIMEOUT):
                await lenient.barrier([local.put(off + 8192, b"one replica is enough")])
            status = lenient.status()
            assert [s["state"] for s in status] == ["in-sync", "stale"]
            assert status[1]["last_error"] and str(specs[1]) in status[1]["last_error"]
            assert status[0]["barriers"] == 1
            # Once below the policy, every barrier refuses without touching the network.
            with pytest.raises(ReplicaError, match="too few replicas in sync"):
                await strict.barrier([(off, 1)])
            # A fresh open finds the dead target unreachable and says so, without raising.
            again = await ReplicaSet.open(specs, local.buf, local.header.uuid, None, timeout=TIMEOUT,
                                          min_replicas=1)
            assert [r.state for r in again.replicas] == ["in-sync", "stale"]
            assert "cannot open" in (again.replicas[1].last_error or "")
            await again.aclose()
        finally:
            await strict.aclose()
            await lenient.aclose()

    try:
        run(main)
        assert read_file(apm.pool_dir / specs[0].name) == read_file(local.path)
    finally:
        local.close()
