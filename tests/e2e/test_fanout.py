"""Parallel fan-out: an fsync waits for the slowest replica, not for the sum of them.

Each target sits behind a TCP relay that holds every byte it forwards from the target back to
the initiator for a fixed delay (a long link, as a WAN emulator makes one; this kernel has no
netem). With delays of 150 ms and 250 ms, replicas served one after another would make an
fsync take at least 400 ms; served in parallel, about 250 ms.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import cli

from rpmemfs.tools.processes import TargetProcess

DELAYS = (0.15, 0.25)


class DelayRelay:
    """Listens on loopback and relays to ``upstream``; bytes coming back are held ``delay`` s."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream = upstream
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._closing = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        held: deque[tuple[float, bytes]] = deque()
        cond = threading.Condition()
        done = threading.Event()

        def sender() -> None:
            while True:
                with cond:
                    while not held and not done.is_set():
                        cond.wait()
                    if not held:
                        break
                    due, data = held.popleft()
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    return
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        t = threading.Thread(target=sender, daemon=True)
        t.start()
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            with cond:
                if not data:
                    done.set()
                else:
                    held.append((time.monotonic() + delay, data))
                cond.notify()
            if not data:
                return

    def close(self) -> None:
        self._closing.set()
        self.listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def slow_targets(work_dir: Path) -> Iterator[list[DelayRelay]]:
    procs, relays = [], []
    for i, delay in enumerate(DELAYS):
        d = work_dir / f"target{i}"
        d.mkdir()
        t = TargetProcess(d, listen="127.0.0.1:0", pmem="force", persist="apm",
                          log_path=work_dir / f"target{i}.log")
        t.start()
        procs.append(t)
        relays.append(DelayRelay(("127.0.0.1", t.port), delay))
    yield relays
    for r in relays:
        r.close()
    for t in procs:
        t.close()


def test_an_fsync_waits_for_the_slowest_replica_not_the_sum(
        work_dir: Path, slow_targets: list[DelayRelay], mount_pool: MountPool) -> None:
    pool = work_dir / "app.pool"
    args: list[str | os.PathLike[str]] = ["mkfs", pool, "--size", "64M"]
    for r in slow_targets:
        args += ["--replica", f"{r.address}/app"]
    res = cli(*args, timeout=120)
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options="pmem=force,replica_timeout=10")
    fd = os.open(m.path / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.pwrite(fd, b"w" * 4096, 0)
        os.fsync(fd)  # the first barrier also carries the mount's header: not timed
        took = []
        for i in range(5):
            os.pwrite(fd, bytes([i]) * 4096, 4096 * i)
            t0 = time.monotonic()
            os.fsync(fd)
            took.append(time.monotonic() - t0)
    finally:
        os.close(fd)
    took.sort()
    median = took[len(took) // 2]
    # At least the slower link (nothing completes before its reply crosses it)...
    assert median >= max(DELAYS) * 0.95, took
    # ...and well short of both links in a row.
    assert median < sum(DELAYS) * 0.85, took


def test_fsyncs_of_different_files_overlap_on_the_replicas(
        work_dir: Path, slow_targets: list[DelayRelay], mount_pool: MountPool) -> None:
    """The second fsync posts its barrier while the first is in flight (pipelined on each
    replica's ordered lane) instead of waiting for it: both are done in about one slow round
    trip plus the head start, not two."""
    pool = work_dir / "app.pool"
    args: list[str | os.PathLike[str]] = ["mkfs", pool, "--size", "64M"]
    for r in slow_targets:
        args += ["--replica", f"{r.address}/app"]
    assert cli(*args, timeout=120).returncode == 0
    m = mount_pool(pool, options="pmem=force,replica_timeout=10")
    fds = [os.open(m.path / name, os.O_CREAT | os.O_WRONLY, 0o644) for name in ("a", "b")]
    try:
        for fd in fds:
            os.pwrite(fd, b"w" * 4096, 0)
            os.fsync(fd)
        head_start = 0.08
        finished: dict[int, float] = {}

        def sync(i: int) -> None:
            time.sleep(head_start * i)
            os.pwrite(fds[i], bytes([i]) * 4096, 0)  # written after the first barrier began
            os.fsync(fds[i])
            finished[i] = time.monotonic()

        t0 = time.monotonic()
        threads = [threading.Thread(target=sync, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    slow = max(DELAYS)
    first, second = finished[0] - t0, finished[1] - t0
    assert first >= slow * 0.95, (first, second)
    # Serialized, the second would end after two slow round trips (2 x 250 ms).
    assert second < head_start + slow * 1.5, (first, second)
