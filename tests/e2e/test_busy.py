"""A daemon kept busy by many programs at once still serves everything else.

The daemon reads /dev/fuse before waiting on it, so while requests keep coming it could serve
them forever without letting its other tasks run: the control socket (status), replica
barriers' completions, the periodic commit. These tests keep a queue of requests standing and
check that the rest is served meanwhile, and that every writer's data is what it wrote.
(On 2 cores the queue still drains between requests now and then, so a binding that never
let the other tasks run would pass here too; on many cores it would not.)
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from conftest import MakePool, Mount, MountPool
from helpers import cli, mkfs_replicated, status_json

from rpmemfs.tools.processes import TargetProcess

WRITERS = 16
BLOCK = 4096


def _hammer(path: Path, seconds: float) -> int:
    """4 KiB pwrite + fsync of a counter in a loop for ``seconds``; the last one acknowledged."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n += 1
            os.pwrite(fd, n.to_bytes(8, "little") * (BLOCK // 8), (n % 16) * BLOCK)
            os.fsync(fd)
        return n
    finally:
        os.close(fd)


def _run_busy(m: Mount, rounds: int = 5, seconds: float = 6.0) -> list[dict[str, object]]:
    """Writers in processes of their own (threads would queue on this one's GIL), status
    asked ``rounds`` times meanwhile."""
    pids, out_r = _fork_writers(lambda i: f"{_hammer(m.path / f'w{i}', seconds)}")
    answers = []
    try:
        for _ in range(rounds):
            # A starved control task would leave this waiting until cli's timeout.
            res = cli("status", m.path, "--json", timeout=60)
            assert res.returncode in (0, 1), res.stderr
            answers.append(json.loads(res.stdout))
    finally:
        with os.fdopen(out_r) as f:
            lines = f.read().split()
        codes = [os.waitpid(pid, 0)[1] for pid in pids]
    assert not any(codes), codes
    last = dict(zip(map(int, lines[0::2]), map(int, lines[1::2]), strict=True))
    assert len(last) == WRITERS, last
    _check_last(m, last)
    return answers


def _fork_writers(work: Callable[[int], str]) -> tuple[list[int], int]:
    """WRITERS processes (threads would queue on this one's GIL), writer i printing
    "i work(i)" on a pipe: their pids, and the pipe's end to read."""
    out_r, out_w = os.pipe()
    pids = []
    for i in range(WRITERS):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(out_r)
                os.write(out_w, f"{i} {work(i)}\n".encode())
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(out_w)
    return pids, out_r


def _check_last(m: Mount, last: dict[int, int]) -> None:
    """Each writer's last acknowledged counter is in its file."""
    for i, n in last.items():
        with open(m.path / f"w{i}", "rb") as f:
            f.seek((n % 16) * BLOCK)
            assert f.read(BLOCK) == n.to_bytes(8, "little") * (BLOCK // 8), i


def test_status_answers_while_writers_keep_the_daemon_busy(make_pool: MakePool,
                                                          mount_pool: MountPool) -> None:
    m = mount_pool(make_pool("64M"), options="pmem=force,commit=1")
    answers = _run_busy(m)
    fsyncs = [a["fsync_count"] for a in answers]
    assert fsyncs == sorted(fsyncs) and fsyncs[-1] > fsyncs[0], fsyncs


def test_barriers_complete_while_writers_keep_the_daemon_busy(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    pool = work_dir / "busy.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options="pmem=force")
    answers = _run_busy(m)
    assert all(a["health"] == "healthy" for a in answers), answers[-1]
    # Writers fsyncing at once share points (durability/grouped.py): far fewer barriers than
    # fsyncs, every fsync counted.
    last = answers[-1]
    grouped, fsyncs = last["fsync_grouped"], last["fsync_count"]
    assert 0 < grouped["points"] < grouped["fsyncs"] <= fsyncs, (grouped, fsyncs)
    assert all(r["barriers"] < fsyncs / 2 for r in last["replicas"]), last["replicas"]
    res = cli("verify", m.path)
    assert res.returncode == 0, res.stdout + res.stderr


def _until_eio(path: Path, seconds: float) -> tuple[int, int]:
    """4 KiB pwrite + fsync of a counter until an fsync fails or ``seconds`` pass:
    (the last acknowledged, the errno that ended it or 0)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    n = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            os.pwrite(fd, (n + 1).to_bytes(8, "little") * (BLOCK // 8), ((n + 1) % 16) * BLOCK)
            try:
                os.fsync(fd)
            except OSError as e:
                return n, e.errno or 0
            n += 1
        return n, 0
    finally:
        os.close(fd)


def test_a_replica_killed_under_busy_writers_fails_their_fsyncs_with_eio_and_none_hangs(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """The fsyncs waiting in a group when its point fails all get EIO (min_replicas: all), at
    once after the kill or within replica_timeout; none waits for ever, and what each writer
    had acknowledged is in its file."""
    pool = work_dir / "busy.pool"
    mkfs_replicated(pool, targets)
    m = mount_pool(pool, options="pmem=force,replica_timeout=2")
    pids, out_r = _fork_writers(lambda i: " ".join(map(str, _until_eio(m.path / f"w{i}", 30.0))))
    time.sleep(1.5)
    killed = time.monotonic()
    targets[1].kill()
    with os.fdopen(out_r) as f:
        lines = f.read().split("\n")
    ended = time.monotonic() - killed
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    assert not any(codes), codes
    results = {int(a): (int(n), int(e)) for a, n, e in (line.split() for line in lines if line)}
    assert len(results) == WRITERS, results
    # Every writer stopped on EIO, long before the 30 s it would have written.
    assert all(e == errno.EIO for _, e in results.values()), results
    assert ended < 15, ended
    assert status_json(m.path)["fsync_grouped"]["points"] > 0
    assert all(n > 0 for n, _ in results.values()), results
    _check_last(m, {i: n for i, (n, _) in results.items()})
