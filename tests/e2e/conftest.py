"""Fixtures for the FUSE-level tests: a scratch dir on /dev/shm, pools, real mounts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import (  # noqa: E402
    Mount,
    cli,
    collect_garbage_in_vm,  # noqa: F401  (an autouse fixture in the VM)
    describe,
    mkfs,
)

from rpmemfs.tools.processes import TargetProcess, detach_all_under  # noqa: E402
from rpmemfs.transport.tokens import STATE_ENV  # noqa: E402

# A test that takes longer than this is hung (the slowest takes ~15 s). The watchdog records
# what the daemons were doing, then SIGKILLs them: that aborts the FUSE connection, so a test
# stuck in a syscall on the mount gets ENOTCONN and fails with the diagnosis instead of
# hanging where pytest-timeout's signal cannot reach it.
WATCHDOG_SECONDS = 180.0

MakePool = Callable[..., Path]
MountPool = Callable[..., Mount]


def pytest_configure(config: pytest.Config) -> None:
    """Targets started without a token file generate theirs in a state directory of this
    test run (and mounts, commands and tests find it there), not in the machine's own."""
    state = tempfile.mkdtemp(prefix="rpmemfs-state-", dir="/dev/shm")
    os.environ[STATE_ENV] = state
    config.add_cleanup(lambda: shutil.rmtree(state, ignore_errors=True))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


def _passed(request: pytest.FixtureRequest) -> bool:
    rep = getattr(request.node, "rep_call", None)
    return rep is not None and rep.passed


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A fresh directory under /dev/shm, removed (after detaching any mounts) afterwards."""
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-test-", dir="/dev/shm"))
    yield d
    detach_all_under(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_pool(work_dir: Path) -> MakePool:
    """make_pool(size="64M", name=None) -> path of a freshly made pool."""
    counter = 0

    def _make(size: str = "64M", name: str | None = None) -> Path:
        nonlocal counter
        counter += 1
        pool = work_dir / (name or f"pool{counter}.img")
        mkfs(pool, size)
        return pool

    return _make


def _proc_state(pid: int) -> str:
    lines = [f"pid {pid}:"]
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text()
            stack = (task / "stack").read_text().strip().replace("\n", " | ")
        except OSError as exc:
            lines.append(f"  task {task.name}: {exc}")
            continue
        lines.append(f"  task {task.name} state {state} wchan {wchan} stack: {stack}")
    return "\n".join(lines)


class _Watchdog:
    def __init__(self, mounts: list[Mount]) -> None:
        self.mounts = mounts
        self.report = ""
        self.timer = threading.Timer(WATCHDOG_SECONDS, self.fire)
        self.timer.daemon = True
        self.timer.start()

    def fire(self) -> None:
        parts = [f"test still running after {WATCHDOG_SECONDS:.0f} s; killing its daemons"]
        parts.append("test process " + _proc_state(os.getpid()))
        for m in self.mounts:
            if m.proc is not None and m.proc.poll() is None:
                parts.append(f"daemon for {m.path} " + _proc_state(m.proc.pid))
                parts.append(f"daemon output:\n{m.output()[-3000:]}")
        self.report = "\n".join(parts)
        for m in self.mounts:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()


@pytest.fixture
def mount_pool(work_dir: Path, request: pytest.FixtureRequest) -> Iterator[MountPool]:
    """mount_pool(pool, name=None, options="pmem=force", start=True) -> a running Mount.

    At teardown every mount is stopped. If the test passed, a daemon still running must
    unmount cleanly (exit 0) and `rpmemfs check` must find the pool clean; and no daemon
    run of the test may have logged a Python traceback (an internal error behind an EIO)."""
    mounts: list[Mount] = []

    def _mount(
        pool: Path, name: str | None = None, options: str = "pmem=force", start: bool = True
    ) -> Mount:
        path = work_dir / (name or f"mnt{len(mounts) + 1}")
        m = Mount(pool, path, work_dir, options)
        mounts.append(m)
        if start:
            m.start()
        return m

    dog = _Watchdog(mounts)
    yield _mount
    dog.timer.cancel()

    problems: list[str] = []
    if dog.report:
        problems.append(dog.report)
    strict = _passed(request)
    for m in mounts:
        if strict and m.running:
            try:
                m.unmount()
            except AssertionError as exc:
                problems.append(f"teardown unmount of {m.path}: {exc}")
            else:
                res = cli("check", m.pool)
                if res.returncode != 0:
                    problems.append(f"pool not clean after the test:\n{describe(res)}")
        m.cleanup()
        if strict:
            problems += [f"traceback in daemon output:\n{t}" for t in m.internal_errors()]
    if problems:
        pytest.fail("\n\n".join(problems))


@pytest.fixture
def mnt(make_pool: MakePool, mount_pool: MountPool) -> Mount:
    """A fresh 64M pool, mounted (pmem=force). Use mnt.path, mnt.remount(), mnt.kill9()."""
    return mount_pool(make_pool("64M"))


@pytest.fixture
def targets(work_dir: Path) -> Iterator[list[TargetProcess]]:
    """Two target daemons on loopback: one declares the appliance method, one general purpose.
    Teardown kills them (resuming any a test left stopped)."""
    procs = []
    for i, extra in enumerate((dict(pmem="force", persist="apm"), dict(pmem="msync"))):
        d = work_dir / f"target{i}"
        d.mkdir()
        t = TargetProcess(d, listen="127.0.0.1:0", log_path=work_dir / f"target{i}.log", **extra)
        t.start()
        procs.append(t)
    yield procs
    for t in procs:
        if t.proc is not None and t.proc.poll() is None:
            os.kill(t.proc.pid, signal.SIGCONT)
        t.close()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """A target daemon on a host of its own: a network namespace behind a veth link."""

    netns: str
    veth: str  # the host side of its link
    target: TargetProcess


@pytest.fixture
def hosts(work_dir: Path) -> Iterator[list[Host]]:
    """Two hosts 10.201.N.2, each reached over its own veth link from 10.201.N.1; a token in
    work_dir/token (a target that is not on loopback requires one)."""
    tag = uuid.uuid4().hex[:6]
    net = int(tag, 16) % 120 * 2  # two /30 links in 10.201.net.0 - 10.201.net+1.3
    token = work_dir / "token"
    token.write_text(uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    made: list[Host] = []
    try:
        for i in range(2):
            ns, veth, peer = f"rpm-{tag}-{i}", f"vh{tag}{i}", f"vn{tag}{i}"
            try:
                ip("netns", "add", ns)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot create a network namespace here: {exc.stderr.strip()}")
            ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            ip("link", "set", peer, "netns", ns)
            ip("addr", "add", f"10.201.{net + i}.1/30", "dev", veth)
            ip("link", "set", veth, "up")
            ip("-n", ns, "addr", "add", f"10.201.{net + i}.2/30", "dev", peer)
            ip("-n", ns, "link", "set", peer, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            d = work_dir / f"host{i}"
            d.mkdir()
            t = TargetProcess(d, listen=f"10.201.{net + i}.2:7420", token_file=token, pmem="force",
                              persist="apm" if i == 0 else None, prefix=["ip", "netns", "exec", ns],
                              log_path=work_dir / f"host{i}.log")
            made.append(Host(ns, veth, t))
            t.start()
        yield made
    finally:
        for h in made:
            h.target.close()
            subprocess.run(["ip", "link", "del", h.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)
