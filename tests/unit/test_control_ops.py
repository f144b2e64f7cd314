"""The control operations' one declaration (rpmemfs/transport/control_ops.py) against both of
its readers: every declared op has a handler on the target and a method on the client, an op
not declared is refused, the requests the client sends are the bytes they always were, and
each op's reply, from a real target's control service over a real pool directory (no daemon),
carries the fields declared for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rpmemfs.target.authz import Grant, TokenBook
from rpmemfs.target.control import ControlService
from rpmemfs.target.pools import PoolStore
from rpmemfs.target.server import Server, TargetConfig
from rpmemfs.target.sessions import TargetSession
from rpmemfs.transport.control_client import ControlClient
from rpmemfs.transport.control_ops import OPS, ControlOp, Kind, build_request, find_op

MIB = 1 << 20


class Refused(Exception):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(reply["error"])
        self.reply = reply


class InProcess:
    """A control channel straight into a target's control service, the JSON as the wire
    carries it; what went each way is kept."""

    peer = "in-process"

    def __init__(self, service: ControlService, session: TargetSession) -> None:
        self.service = service
        self.session = session
        self.replies: dict[str, dict[str, Any]] = {}

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        reply = await self.service.handle(self.session, json.loads(json.dumps(msg)))
        if not reply.get("ok"):
            raise Refused(reply)
        self.replies[msg["op"]] = reply
        return reply


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    tmp_path.chmod(0o700)
    store = PoolStore(str(tmp_path), "force", 1 << 30)
    config = TargetConfig(host="127.0.0.1", port=0, pool_dir=str(tmp_path), tokens=TokenBook(),
                          method="gpspm", pmem_mode="force", pmem_kind="force", max_pool_size=1 << 30,
                          max_connections=1024, handshake_timeout=2.0, frame_timeout=30.0, idle_timeout=0.0)
    yield Server(config, store)
    store.close_all()


def _session(server: Server, grant: Grant | None = None) -> TargetSession:
    return server.sessions.new("peer", grant or Grant("default", True), b"")


def test_every_declared_op_has_a_target_handler_and_a_client_method(server: Server) -> None:
    assert set(OPS) == set(ControlOp)
    assert set(server.control.handlers) == set(ControlOp)
    for op in ControlOp:
        assert callable(getattr(ControlClient, op.value, None)), f"the client has no method for {op.value!r}"
        assert find_op(op.value) is op


def test_the_target_refuses_an_op_not_declared(server: Server) -> None:
    session = _session(server)
    # A list or an object as op was once an internal error that closed the connection.
    for op in ("format-disk", "CREATE", "create ", 5, None, ["create"], {"op": "create"}):
        reply = trio.run(server.control.handle, session, {"op": op, "name": "p"})
        assert reply == {"ok": False, "error": f"unknown control op {str(op)[:40]!r}", "code": "request"}
        assert not isinstance(op, str) or find_op(op) is None


def test_only_an_admin_token_may_ask_for_an_admin_op(server: Server) -> None:
    limited = _session(server, Grant("alice", False, ("alice-*",)))
    for op, spec in OPS.items():
        reply = trio.run(server.control.handle, limited, {"op": op.value, "name": "alice-1"})
        assert (reply.get("code") == "denied") == spec.admin, (op, reply)


@pytest.mark.parametrize(("request_", "code", "error"), [
    ({"op": "create"}, "bad-name", "pool name must be a string"),
    ({"op": "create", "name": "p0", "size": "1G"}, "size", "pool size must be an integer number of bytes"),
    ({"op": "grow", "name": "p0", "size": "1G"}, "size", "pool size must be a multiple of 4096 bytes"),
    ({"op": "open", "name": "p0", "epoch": [1]}, "request",
     "epoch must be [previous, current], two unsigned 64-bit integers"),
    ({"op": "close", "key": "x"}, "bad-key", "no pool is registered with key 'x' in this session"),
    ({"op": "resync"}, "bad-key", "no pool is registered with key None in this session"),
    ({"op": "stats", "name": 5}, "bad-name", "pool name must be a string"),
])
def test_a_missing_or_mistyped_field_is_refused_with_its_code(
        server: Server, request_: dict[str, Any], code: str, error: str) -> None:
    reply = trio.run(server.control.handle, _session(server), request_)
    assert reply == {"ok": False, "error": error, "code": code}


def test_fields_are_read_by_kind_in_the_order_the_handler_asks(server: Server) -> None:
    session = _session(server)

    async def main() -> None:
        key = (await server.control.handle(session, {"op": "create", "name": "p0", "size": MIB}))["key"]
        for op, bad, error in (
            ("resync", {"active": 1}, 'resync needs "active": true or false'),
            ("checksum", {"offset": "x"}, "checksum offset must be a non-negative integer"),
            ("checksum", {"offset": 0, "length": 4096, "chunk": True},
             "checksum chunk must be a non-negative integer"),
        ):
            reply = await server.control.handle(session, {"op": op, "key": key, **bad})
            assert reply == {"ok": False, "error": error, "code": "request"}
        # Both the size and the epoch are wrong: the size is found first, as it always was.
        twice_wrong = {"op": "create", "name": "p1", "size": "1G", "epoch": "x"}
        assert (await server.control.handle(session, twice_wrong))["code"] == "size"

    trio.run(main)


class Canned:
    """A channel that keeps what is sent and answers every op with a well-formed reply."""

    peer = "canned"

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(json.dumps(msg))
        region = {"name": "p", "key": 7, "size": MIB, "uuid": None, "method": "gpspm", "pmem": "force"}
        return {"ok": True, "crcs": [1, 2], "pools": {}, **region}


def test_the_requests_on_the_wire_are_what_they_were() -> None:
    channel = Canned()
    ops = ControlClient(channel)

    async def main() -> None:
        await ops.create("p", MIB)
        await ops.create("p", MIB, rdma=True)
        await ops.open("p")
        await ops.open("p", (1, 2), holder={"host": "h", "pid": 3}, takeover=True, rdma=True)
        await ops.open("p", (1, 2), holder={})
        await ops.open("p", None, holder={"host": "h"}, takeover=True)
        await ops.probe("p")
        await ops.pools()
        await ops.evict("p")
        await ops.grow("p", 2 * MIB)
        await ops.resync(7, True)
        await ops.close(7)
        await ops.remove("p")
        await ops.checksum(7, 0, 8192, 4096)
        await ops.stats()
        await ops.stats("p")
        await ops.info()
        await ops.rdma()

    trio.run(main)
    assert channel.sent == [
        '{"op": "create", "name": "p", "size": 1048576}',
        '{"op": "create", "name": "p", "size": 1048576, "rdma": true}',
        '{"op": "open", "name": "p"}',
        '{"op": "open", "name": "p", "epoch": [1, 2], "holder": {"host": "h", "pid": 3}, "takeover": true, '
        '"rdma": true}',
        '{"op": "open", "name": "p", "epoch": [1, 2]}',
        '{"op": "open", "name": "p"}',
        '{"op": "probe", "name": "p"}',
        '{"op": "pools"}',
        '{"op": "evict", "name": "p"}',
        '{"op": "grow", "name": "p", "size": 2097152}',
        '{"op": "resync", "key": 7, "active": true}',
        '{"op": "close", "key": 7}',
        '{"op": "remove", "name": "p"}',
        '{"op": "checksum", "key": 7, "offset": 0, "length": 8192, "chunk": 4096}',
        '{"op": "stats"}',
        '{"op": "stats", "name": "p"}',
        '{"op": "info"}',
        '{"op": "rdma"}',
    ]


def test_a_request_is_built_only_as_declared() -> None:
    with pytest.raises(TypeError, match="has no field 'key'"):
        build_request(ControlOp.PROBE, {"name": "p", "key": 1})
    with pytest.raises(TypeError, match="needs 'size'"):
        build_request(ControlOp.CREATE, {"name": "p"})
    with pytest.raises(TypeError, match="'size' must be"):
        build_request(ControlOp.CREATE, {"name": "p", "size": True})
    assert not Kind.COUNT.accepts(True) and Kind.FLAG.accepts(False) and Kind.EPOCH.accepts([1, 2])


def test_every_reply_carries_the_fields_declared_for_it(server: Server) -> None:
    channel = InProcess(server.control, _session(server))
    ops = ControlClient(channel)

    async def main() -> None:
        made = ops.region(await ops.create("p", MIB))
        await ops.probe("p")
        claimed = ops.region(await ops.open("p", (0, 1 << 32), holder={"host": "h"}))
        await ops.resync(claimed.key, True)
        await ops.resync(claimed.key, False)
        assert len(await ops.checksum(claimed.key, 0, 8192, 4096)) == 2
        assert "p" in await ops.stats("p")
        await ops.pools()
        assert (await ops.info())["method"] == "gpspm"
        assert (await ops.evict("p"))["evicted"] == "peer"
        await ops.close(made.key)
        assert (await ops.grow("p", 2 * MIB))["grown"] is True
        await ops.remove("p")
        with pytest.raises(Refused, match="does not serve RDMA"):
            await ops.rdma()  # no verbs here: its reply is declared, not checked

    trio.run(main)
    assert set(channel.replies) == {op.value for op in ControlOp} - {ControlOp.RDMA.value}
    for op, reply in channel.replies.items():
        missing = set(OPS[ControlOp(op)].reply) - set(reply)
        assert not missing, f"the reply to {op!r} lacks {sorted(missing)}: {reply}"
