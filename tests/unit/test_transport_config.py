"""The transport's configuration and loss reporting, without a target.

Verbs settings come from the environment only where a transport is built (transport_for), and
say what the environment variables always said. A connection interrupted in any of its steps
is lost with the reason that step gives (conn.py's one handler chain).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio

from rpmemfs.transport.base import TransportError
from rpmemfs.transport.choose import AutoTransport, transport_for
from rpmemfs.transport.conn import _CALLING, _HANDSHAKE, _REPLYING, _SENDING, Connection, _Step
from rpmemfs.transport.sockio import SockIO
from rpmemfs.transport.tcp import TcpTransport
from rpmemfs.transport.verbs_config import VerbsSettings

ENV = ("RPMEMFS_RDMA_SRC", "RPMEMFS_VERBS_SPIN_US", "RPMEMFS_VERBS_FLUSH")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_settings_default_to_what_an_empty_environment_gives() -> None:
    assert VerbsSettings.from_env() == VerbsSettings(src=None, spin_us=1000, native_flush=True)


def test_settings_from_the_environment() -> None:
    env = {"RPMEMFS_RDMA_SRC": "10.0.0.1", "RPMEMFS_VERBS_SPIN_US": "0", "RPMEMFS_VERBS_FLUSH": "read"}
    assert VerbsSettings.from_env(env=env) == VerbsSettings("10.0.0.1", 0, False)
    assert VerbsSettings.from_env("10.0.0.2", env=env).src == "10.0.0.2"  # given beats the environment
    assert VerbsSettings.from_env(env={"RPMEMFS_VERBS_FLUSH": "native"}).native_flush
    assert VerbsSettings.from_env(env={"RPMEMFS_RDMA_SRC": ""}).src is None


def test_transport_for_reads_the_environment_when_it_builds_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPMEMFS_VERBS_SPIN_US", "7")
    monkeypatch.setenv("RPMEMFS_RDMA_SRC", "10.0.0.1")
    auto = transport_for("auto")
    assert isinstance(auto, AutoTransport)
    assert auto.settings == VerbsSettings("10.0.0.1", 7, True)
    given = VerbsSettings(spin_us=3)
    auto = transport_for("auto", settings=given)
    assert isinstance(auto, AutoTransport) and auto.settings is given
    auto = transport_for("auto", "10.0.0.9", given)
    assert isinstance(auto, AutoTransport) and auto.settings == VerbsSettings("10.0.0.9", 3, True)
    assert isinstance(transport_for("tcp"), TcpTransport)
    with pytest.raises(ValueError, match="unknown transport"):
        transport_for("udp")


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _loss(conn: Connection) -> TransportError:
    with pytest.raises(TransportError) as info:
        conn.check()
    assert info.value.lane_lost
    return info.value


@pytest.mark.parametrize(("step", "timed_out", "lost"), [
    (_SENDING, "timed out after 5s sending to the target", "connection lost while sending: boom"),
    (_CALLING, "timed out after 5s waiting for the target", "connection lost: boom"),
    (_REPLYING, "timed out after 5s waiting for the target's reply", "connection lost: boom"),
    (_HANDSHAKE, "timed out after 5s in the handshake", "connection lost in the handshake: boom"),
])
def test_an_interrupted_step_loses_the_connection_with_its_reason(
    sockets: tuple[socket.socket, socket.socket], step: _Step, timed_out: str, lost: str
) -> None:
    async def main() -> None:
        for exc, reason in ((trio.TooSlowError(), timed_out), (OSError("boom"), lost)):
            conn = Connection(SockIO(socket.socket(fileno=socket.dup(sockets[0].fileno()))), "t:1", 5)
            with pytest.raises(TransportError) as info:
                conn._failed(exc, step)
            assert info.value.reason == reason and info.value.lane_lost
            # Lost already: a later failure reports the first reason.
            with pytest.raises(TransportError, match=reason):
                conn._failed(OSError("later"), step)

    trio.run(main)


def test_a_cancelled_wait_loses_the_connection(sockets: tuple[socket.socket, socket.socket]) -> None:
    async def main() -> None:
        conn = Connection(SockIO(sockets[0]), "t:1", 5)
        with trio.move_on_after(0.01) as scope:
            await conn.reply(1)  # the peer never answers
        assert scope.cancelled_caught
        assert _loss(conn).reason == "an operation was cancelled while waiting for its reply"

    trio.run(main)


def test_a_deadline_loses_the_connection(sockets: tuple[socket.socket, socket.socket]) -> None:
    async def main() -> None:
        conn = Connection(SockIO(sockets[0]), "t:1", 0.01)
        with pytest.raises(TransportError, match="timed out after 0.01s waiting for the target's reply"):
            await conn.reply(1)
        assert conn.lost

    trio.run(main)
