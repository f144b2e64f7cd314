"""Limits before authentication, against a real target: a flood of idle connections from many
addresses (1100 at once, renewed as the target closes them) neither locks out a mount that
holds the token nor makes the target hold more than its caps; an idle handshake is closed at
its deadline."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MountPool
from helpers import cli, status_json, write_fsync

from rpmemfs.target.admission import DEFAULT_MAX_HANDSHAKES, MAX_HANDSHAKE_TIMEOUT
from rpmemfs.tools.processes import TargetProcess

FLOOD_ADDRESSES = 50
FLOOD_CONNECTIONS = 1100


@pytest.fixture
def guarded(work_dir: Path) -> Iterator[tuple[TargetProcess, Path]]:
    token = work_dir / "token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    d = work_dir / "pools"
    d.mkdir()
    t = TargetProcess(d, listen="127.0.0.1:0", token_file=token, pmem="force",
                      log_path=work_dir / "target.log")
    t.start()
    yield t, token
    t.close()


class Flood:
    """Idle connections from 127.0.0.2 up, each reopened as soon as the target closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.opened = 0
        self.closed_by_target = 0
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> socket.socket | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((f"127.0.0.{2 + i % FLOOD_ADDRESSES}", 0))
            s.connect_ex(("127.0.0.1", self.port))
        except OSError:
            s.close()
            return None
        self.opened += 1
        return s

    def _run(self) -> None:
        socks = [s for i in range(FLOOD_CONNECTIONS) if (s := self._open(i)) is not None]
        while not self.stop.is_set():
            for k, s in enumerate(socks):
                try:
                    gone = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    self.closed_by_target += 1
                    s.close()
                    fresh = self._open(k)
                    if fresh is not None:
                        socks[k] = fresh
            time.sleep(0.05)
        for s in socks:
            s.close()

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join()


def _target_fds(t: TargetProcess) -> int:
    assert t.proc is not None
    return len(os.listdir(f"/proc/{t.proc.pid}/fd"))


def test_a_connection_flood_neither_locks_out_a_mount_nor_exceeds_the_caps(
        work_dir: Path, guarded: tuple[TargetProcess, Path], mount_pool: MountPool) -> None:
    target, token = guarded
    pool = work_dir / "app.pool"
    idle = _target_fds(target)
    with Flood(target.port) as flood:
        time.sleep(1.0)
        # Made, mounted and written while the flood goes on: each replica connection is a
        # fresh handshake that must get through.
        res = cli("mkfs", pool, "--size", "64M", "--token-file", token,
                  "--replica", f"{target.address}/app")
        assert res.returncode == 0, res.stderr
        m = mount_pool(pool, options="pmem=force,replica_timeout=5")
        for i in range(20):
            write_fsync(m.path / f"f{i}", os.urandom(8000))
        assert [r["state"] for r in status_json(m.path)["replicas"]] == ["in-sync"]
        for _ in range(5):
            res = cli("pools", target.address, "--token-file", token, "--json")
            assert res.returncode == 0, res.stderr
        # The target holds at most its caps of handshakes, however many were opened.
        assert flood.opened >= FLOOD_CONNECTIONS
        assert flood.closed_by_target > FLOOD_CONNECTIONS - DEFAULT_MAX_HANDSHAKES
        # (The least of a few samples: a connection accepted just now is counted before the
        # handshake it pushes out has closed its socket.)
        held = min(_target_fds(target) for _ in range(5) if time.sleep(0.05) is None)
        assert held < idle + DEFAULT_MAX_HANDSHAKES + 32, held
        m.unmount()
    assert cli("verify", pool, "--token-file", token).returncode == 0
    assert "Traceback" not in target.log_text()


def test_an_idle_handshake_is_closed_at_its_deadline(guarded: tuple[TargetProcess, Path]) -> None:
    target, _ = guarded
    with socket.create_connection(("127.0.0.1", target.port)) as s:
        # A liveness bound, not a measurement: a handshake left open past it fails the test.
        s.settimeout(MAX_HANDSHAKE_TIMEOUT + 10)
        while s.recv(4096):
            pass
