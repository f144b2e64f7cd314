"""The target daemon under hostile and unusual conditions, as a real process.

Raw connections here speak the wire format by hand (tests/e2e/test_target.py's RawConn), so they
can send what no well-behaved initiator would; a real initiator (rpmemfs.transport.connect)
connected at the same time must keep working through all of it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import rawwire
import trio

from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.tools.processes import SpawnError, TargetProcess
from rpmemfs.transport import TcpSession, TransportError, barrier, connect
from rpmemfs.transport.address import parse_address
from rpmemfs.transport.tokens import key_id, local_token
from rpmemfs.transport.wire import (
    F_CLOSE,
    HEADER,
    HELLO,
    HELLO_MAGIC,
    MAX_FLUSH_RANGES,
    NO_SESSION,
    VERSION,
    Cipher,
    Code,
    Frame,
    Hello,
    Op,
    Role,
    SendKind,
    encode_flush,
    pack_header,
    unpack_header,
)

pytestmark = pytest.mark.timeout(60)

POOL = 1 << 20
TOKEN = b"correct horse battery staple, and some more"


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return trio.run(fn, *args)


def pool_name() -> str:
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rpmemfs-target-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fresh_dir(scratch: Path) -> Path:
    d = scratch / uuid.uuid4().hex[:8]
    d.mkdir()
    return d


class Running:
    """A started TargetProcess that must end cleanly (exit 0, no traceback) at teardown."""

    def __init__(self, scratch: Path, **kw: Any) -> None:
        self.pool_dir = _fresh_dir(scratch)
        self.proc = TargetProcess(self.pool_dir, **kw)
        self.proc.start()

    @property
    def address(self) -> str:
        return self.proc.address

    def finish(self) -> str:
        code = self.proc.stop()
        log = self.proc.log_text()
        self.proc.close()
        assert code == 0, log
        assert "Traceback" not in log, log
        return log


@pytest.fixture(scope="module")
def open_target(scratch: Path) -> Iterator[Running]:
    """No token file (the token it generates), short frame deadline so stalled frames are cut quickly."""
    t = Running(scratch, extra=["--frame-timeout", "1", "--max-pool-size", "64M"])
    yield t
    t.finish()


@pytest.fixture(scope="module")
def token_target(scratch: Path) -> Iterator[Running]:
    token_file = scratch / "token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)
    t = Running(scratch, token_file=token_file)
    yield t
    t.finish()


# --------------------------------------------------------------------------- raw wire client


class RawConn:
    """A blocking socket speaking (or abusing) the wire format by hand: once its handshake
    is done, what it sends is sealed into records (tests/e2e/rawwire.py), so a target sees
    the bad frames themselves, not a bad record."""

    def __init__(self, address: str) -> None:
        host, port = parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=5)
        self.buf = b""
        self.records: rawwire.Records | None = None
        self.cipher = Cipher.NONE  # what the target chose in its CHALLENGE

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(self.records.seal(data) if self.records is not None else data)

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"closed after {len(self.buf)} of {n} bytes")
            self.buf += self.records.feed(chunk) if self.records is not None else chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def frame(self) -> tuple[Frame, bytes]:
        frame = unpack_header(self._exact(HEADER.size))
        return frame, self._exact(frame.length)

    def handshake(self, token: bytes | None = None, role: Role = Role.CONTROL, sid: bytes = NO_SESSION,
                  flags: int = 0) -> bytes:
        """As an initiator: a control connection names its token, a lane its session ``sid``.
        The token by default: the one the test run's targets generate."""
        token = token if token is not None else local_token()
        assert token is not None
        mine, hello = rawwire.hello(role, key_id(token) if role == Role.CONTROL else sid, flags=flags)
        self.send(hello)
        frame, payload = self.frame()
        assert frame.op == Op.CHALLENGE, (frame, payload)
        self.cipher = Cipher(frame.imm)
        answer, records, genuine = rawwire.answer_challenge(token, mine, hello, frame, payload)
        assert genuine
        self.send(answer)  # in the clear, as the AUTH is: sealed is what follows it
        self.records = records
        frame, payload = self.frame()
        assert frame.op == Op.OK, (frame, payload)
        return payload[:16]

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(request).encode()
        self.send(pack_header(Op.SEND, 0, 0, 0, len(body), 1, SendKind.CONTROL) + body)
        frame, payload = self.frame()
        assert frame.op == Op.SEND_REPLY, (frame, payload)
        reply: dict[str, Any] = json.loads(payload)
        return reply

    def closed_with_error(self) -> tuple[int, str]:
        """The target's closing ERROR frame (code, reason), then end of stream."""
        frame, payload = self.frame()
        assert frame.op == Op.ERROR and frame.flags & F_CLOSE, (frame, payload)
        assert self.eof(), "the target kept the connection open after a violation"
        return frame.imm, payload.decode()

    def eof(self) -> bool:
        try:
            return self.sock.recv(1) == b"" and not self.buf
        except ConnectionResetError:
            return True


def raw_session(address: str) -> tuple[RawConn, int, bytes]:
    """A raw control connection with a fresh pool registered: (conn, key, session id)."""
    ctl = RawConn(address)
    sid = ctl.handshake()
    reply = ctl.control({"op": "create", "name": pool_name(), "size": POOL})
    assert reply["ok"], reply
    return ctl, int(reply["key"]), sid


# --------------------------------------------------------------------------- authentication


def test_right_token_is_accepted(token_target: Running) -> None:
    async def main() -> None:
        async with await connect(token_target.address, TOKEN, lanes=1) as s:
            region = await s.create_pool(pool_name(), POOL)
            await barrier(s.lanes[0], region, [(0, b"authenticated")])

    run(main)


@pytest.mark.parametrize("token", [b"another token, as long as the right one", None])
def test_target_refuses_a_token_it_does_not_know(
    token_target: Running, open_target: Running, token: bytes | None
) -> None:
    """None: the token open_target generated, which this target (given its own) does not accept."""
    with pytest.raises(TransportError, match="token is not one this target accepts"):
        run(connect, token_target.address, token)


def test_initiator_tells_the_target_is_not_genuine() -> None:
    """A peer that knows which token an initiator holds (its key id is no secret) but not the
    token cannot prove itself, and the initiator stops there, its own proof unsent."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            hello = b""
            while len(hello) < HELLO.size:
                hello += conn.recv(HELLO.size - len(hello))
            challenge = Frame(Op.CHALLENGE, length=64, imm=Cipher.AES_256_GCM).pack()
            conn.sendall(challenge + rawwire.hello(Role.CONTROL, NO_SESSION)[0].public + os.urandom(32))
            conn.settimeout(5)
            try:
                got.append(conn.recv(4096))
            except OSError:
                got.append(b"?")

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(TransportError, match="not the genuine target, it was given a different token"):
            run(connect, f"127.0.0.1:{listener.getsockname()[1]}", TOKEN)
        thread.join(10)
        assert got == [b""]  # the initiator closed without answering the challenge
    finally:
        listener.close()


def test_target_refuses_a_wrong_answer_to_its_challenge(token_target: Running) -> None:
    raw = RawConn(token_target.address)
    try:
        mine, hello = rawwire.hello(Role.CONTROL, key_id(TOKEN))
        raw.send(hello)
        frame, payload = raw.frame()
        assert frame.op == Op.CHALLENGE
        # The target proved itself with the real token...
        _, raw.records, genuine = rawwire.answer_challenge(TOKEN, mine, hello, frame, payload)
        assert genuine
        # ... and refuses an initiator that answers with another one.
        wrong, _, _ = rawwire.answer_challenge(b"guess", mine, hello, frame, payload)
        raw.sock.sendall(wrong)
        code, reason = raw.closed_with_error()
        assert code == Code.AUTH_FAILED and "authentication failed" in reason
    finally:
        raw.close()


def _wrong_guess(address: str) -> float:
    """One handshake answering the challenge with a wrong token: seconds until refused."""
    raw = RawConn(address)
    try:
        mine, hello = rawwire.hello(Role.CONTROL, key_id(TOKEN))
        raw.send(hello)
        frame, payload = raw.frame()
        assert frame.op == Op.CHALLENGE
        started = time.monotonic()
        # The refusal comes sealed under the target's keys, which the real token gives.
        _, raw.records, _ = rawwire.answer_challenge(TOKEN, mine, hello, frame, payload)
        guess, _, _ = rawwire.answer_challenge(os.urandom(32), mine, hello, frame, payload)
        raw.sock.sendall(guess)
        code, _ = raw.closed_with_error()
        assert code == Code.AUTH_FAILED
        return time.monotonic() - started
    finally:
        raw.close()


def test_failed_proofs_are_throttled_per_peer_but_not_the_token_holder(scratch: Path) -> None:
    """Each wrong guess from an address is answered later than the one before (0.05 s
    doubling to 1.5 s: a lower bound, which a slow machine only lengthens); a client that
    holds the token, from the same address, is let in all the while."""
    token_file = scratch / "throttle-token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)
    t = Running(scratch, token_file=token_file)
    try:
        waits = [_wrong_guess(t.address) for _ in range(6)]
        assert sum(waits) >= 2.5, waits  # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 1.5 = 3.05 s
        assert waits[-1] >= 1.0, waits

        async def holder() -> None:
            async with await connect(t.address, TOKEN, lanes=1) as s:
                region = await s.create_pool(pool_name(), POOL)
                await _good_barrier(s, region, b"let in")

        run(holder)
    finally:
        log = t.finish()
    assert "authentication failed" in log, log


def test_a_replayed_target_proof_does_not_authenticate(token_target: Running) -> None:
    """Reflection: offering the target's own challenge as a nonce yields nothing usable."""
    a, b = RawConn(token_target.address), RawConn(token_target.address)
    try:
        mine, hello_a = rawwire.hello(Role.CONTROL, key_id(TOKEN))
        a.send(hello_a)
        frame_a, pa = a.frame()
        # b offers the target's own public key (from a's challenge) as its own
        hello_b = Hello(VERSION, Role.CONTROL, pa[:32], key_id(TOKEN)).pack()
        b.send(hello_b)
        _, pb = b.frame()
        _, a.records, genuine = rawwire.answer_challenge(TOKEN, mine, hello_a, frame_a, pa)
        assert genuine
        a.sock.sendall(Frame(Op.AUTH, length=32).pack() + pb[32:])
        assert a.closed_with_error()[0] == Code.AUTH_FAILED
    finally:
        a.close()
        b.close()


def _ns_cmd(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str, str]]:
    """Namespaces A and B joined by a veth pair (10.231.x.1 in A, .2 in B): (A, B, A's address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"rpmt-a-{tag}", f"rpmt-b-{tag}"
    net = f"10.231.{int(tag[:2], 16)}"
    steps = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b],
        ["ip", "-n", a, "addr", "add", f"{net}.1/30", "dev", f"va{tag}"],
        ["ip", "-n", b, "addr", "add", f"{net}.2/30", "dev", f"vb{tag}"],
        ["ip", "-n", a, "link", "set", f"va{tag}", "up"],
        ["ip", "-n", b, "link", "set", f"vb{tag}", "up"],
        ["ip", "-n", a, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            res = subprocess.run(step, capture_output=True, text=True, timeout=10)
            if res.returncode != 0:
                pytest.skip(f"cannot build network namespaces: {' '.join(step)}: {res.stderr.strip()}")
        yield a, b, f"{net}.1"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


_PROBE = """
import sys, trio
from rpmemfs.transport import connect, TransportError
async def main():
    try:
        async with await connect(sys.argv[1], sys.argv[2].encode() or None, lanes=1, timeout=5) as s:
            await s.create_pool("from-b", 1 << 20)
        print("ACCEPTED")
    except TransportError as exc:
        print("REFUSED", exc.reason)
trio.run(main)
"""


@pytest.mark.parametrize("with_token", [False, True])
def test_another_host_needs_the_token(
    scratch: Path, two_namespaces: tuple[str, str, str], with_token: bool
) -> None:
    """A target started without a token file still authenticates everyone: a peer on another
    host (network namespace) gets in with a copy of the token it generated, not without."""
    ns_a, ns_b, addr_a = two_namespaces
    target = Running(scratch, listen=f"{addr_a}:0", prefix=["ip", "netns", "exec", ns_a])
    generated = local_token()
    assert generated is not None
    try:
        res = subprocess.run(
            _ns_cmd(ns_b, sys.executable, "-c", _PROBE, target.address,
                    generated.decode() if with_token else TOKEN.decode()),
            capture_output=True, text=True, timeout=30,
        )
        assert res.returncode == 0, res.stderr
        if with_token:
            assert res.stdout.strip() == "ACCEPTED", res.stdout + res.stderr
            assert (target.pool_dir / "from-b").exists()
        else:
            assert res.stdout.startswith("REFUSED"), res.stdout + res.stderr
            assert "token is not one this target accepts" in res.stdout
            assert not (target.pool_dir / "from-b").exists()
    finally:
        log = target.finish()
    assert "no --token-file: initiators must hold the token in" in log


# --------------------------------------------------------------------------- pool names and sizes


HOSTILE = ["../x", "/etc/passwd", "a/b", ".hidden", "a\x00b", "x" * 300, "..", ".", "", "a b", "ok/../../x"]


def test_name_rules_as_a_unit() -> None:
    for name in HOSTILE:
        with pytest.raises(PoolNameError):
            check_name(name)
    for name in ("app", "app.pool", "node-2_replica.0", "x" * 128):
        assert check_name(name) == name


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_hostile_pool_names_are_refused(open_target: Running, scratch: Path) -> None:
    outside = _fresh_dir(scratch)
    victim = outside / "victim"
    victim.write_bytes(b"do not touch")
    (open_target.pool_dir / "escape").symlink_to(victim)
    (open_target.pool_dir / "dangling").symlink_to(outside / "would-be-created")
    before_parent = _tree(open_target.pool_dir.parent)
    passwd = os.stat("/etc/passwd")

    async def main() -> None:
        async with await connect(open_target.address, None, lanes=1) as s:
            for name in HOSTILE:
                for call in (s.create_pool(name, POOL), s.open_pool(name), s.remove_pool(name)):
                    with pytest.raises(TransportError) as err:
                        await call
                    assert not err.value.lane_lost
                    assert "pool name" in err.value.reason, err.value.reason
            for name in ("escape", "dangling"):
                for call in (s.create_pool(name, POOL), s.open_pool(name), s.remove_pool(name)):
                    # (create: the name is taken; open, remove: never through a link)
                    with pytest.raises(TransportError, match="already exists|is a symbolic link"):
                        await call
            # The session is still good for honest work.
            region = await s.create_pool(pool_name(), POOL)
            await barrier(s.lanes[0], region, [(0, b"fine")])

    run(main)
    assert victim.read_bytes() == b"do not touch"
    assert not (outside / "would-be-created").exists()
    assert os.stat("/etc/passwd").st_mtime_ns == passwd.st_mtime_ns
    after_parent = _tree(open_target.pool_dir.parent)
    created = after_parent - before_parent
    assert all(p.startswith(open_target.pool_dir.name + "/") for p in created), created


def test_sizes_over_the_limit_or_the_free_space_are_refused(open_target: Running) -> None:
    free = shutil.disk_usage(open_target.pool_dir).free

    async def main() -> None:
        async with await connect(open_target.address, None, lanes=0) as s:
            with pytest.raises(TransportError, match="exceeds this target's limit"):
                await s.create_pool(pool_name(), 128 << 20)
            for bad in (0, -4096, 4095):
                with pytest.raises(TransportError, match="multiple of 4096"):
                    await s.create_pool(pool_name(), bad)

    run(main)
    # A target whose limit is not the bound: the free-space check must be.
    big = Running(Path(open_target.pool_dir).parent, extra=["--max-pool-size", "1T"])
    try:
        size = (free + (1 << 30)) // 4096 * 4096

        async def over() -> None:
            async with await connect(big.address, None, lanes=0) as s:
                name = pool_name()
                with pytest.raises(TransportError, match="not enough free space") as err:
                    await s.create_pool(name, size)
                assert "available" in err.value.reason
                assert not (big.pool_dir / name).exists()
                await s.create_pool(pool_name(), POOL)

        run(over)
    finally:
        big.finish()


# --------------------------------------------------------------------------- malformed input


def _good_barrier(s: TcpSession, region: Any, tag: bytes) -> Awaitable[None]:
    return barrier(s.lanes[0], region, [(0, tag)])


def _hdr(op: int, key: int = 0, offset: int = 0, length: int = 0, imm: int = 0, flags: int = 0) -> bytes:
    return HEADER.pack(op, flags, 0, key, offset, length, 9, imm)


def _pre_auth_cases() -> list[tuple[str, bytes, int | None]]:
    def hello(magic: bytes, version: int, role: int) -> bytes:
        return HELLO.pack(magic, version, role, 0, 0, b"n" * 32, NO_SESSION)

    return [
        ("bad magic", hello(b"NOTRPMEM", VERSION, Role.CONTROL), Code.BAD_HELLO),
        ("bad version", hello(HELLO_MAGIC, VERSION + 7, Role.CONTROL), Code.VERSION),
        ("bad role", hello(HELLO_MAGIC, VERSION, 9), Code.BAD_HELLO),
        ("random bytes", os.urandom(64), Code.BAD_HELLO),
        ("truncated hello", HELLO_MAGIC + b"\x01", None),
    ]


def test_a_lane_must_name_a_live_session(open_target: Running) -> None:
    raw = RawConn(open_target.address)
    try:
        raw.send(rawwire.hello(Role.LANE, b"s" * 16)[1])
        # Refused at once: there is no session whose token it could prove.
        code, reason = raw.closed_with_error()
        assert code == Code.BAD_SESSION and "no live session" in reason
    finally:
        raw.close()


def _lane_cases(key: int) -> list[tuple[str, bytes, int | None]]:
    ok = _hdr(Op.WRITE, key, 0, 4) + b"good"
    return [
        ("truncated header", ok + _hdr(Op.WRITE, key, 0, 4)[:10], None),
        ("truncated payload", ok + _hdr(Op.WRITE, key, 0, 100) + b"short", None),
        ("unknown op", ok + _hdr(0x7E, key), Code.BAD_FRAME),
        ("reserved bits", ok + HEADER.pack(Op.WRITE, 0, 1, key, 0, 0, 1, 0), Code.BAD_FRAME),
        ("unknown flag", ok + _hdr(Op.WRITE, key, flags=0x80), Code.BAD_FRAME),
        ("bad key", _hdr(Op.WRITE, key ^ 0x5A5A5A5A, 0, 4) + b"evil", Code.BAD_KEY),
        ("out-of-bounds write", _hdr(Op.WRITE, key, POOL - 2, 4) + b"evil", Code.OUT_OF_BOUNDS),
        ("offset overflow", _hdr(Op.WRITE, key, (1 << 64) - 2, 4) + b"evil", Code.OUT_OF_BOUNDS),
        ("oversized length", _hdr(Op.WRITE, key, 0, 0xFFFFFFFF), Code.TOO_LARGE),
        ("oversized read", _hdr(Op.READ, key, 0, 0xFFFFFFFF), Code.TOO_LARGE),
        ("out-of-bounds read", _hdr(Op.READ, key, POOL, 1), Code.OUT_OF_BOUNDS),
        ("misaligned atomic", _hdr(Op.ATOMIC_WRITE, key, 4, 0, 1), Code.MISALIGNED),
        ("atomic with payload", _hdr(Op.ATOMIC_WRITE, key, 8, 8, 1), Code.BAD_FRAME),
        ("flush count lies", _hdr(Op.SEND, key, 0, 20, SendKind.FLUSH) + struct.pack("<IQQ", 5, 0, 1),
         Code.BAD_FRAME),
        ("flush out of bounds", _flush(key, [(POOL - 1, 2)]), Code.OUT_OF_BOUNDS),
        ("unknown send kind", _hdr(Op.SEND, key, 0, 0, 99), Code.BAD_FRAME),
        ("reply op from initiator", _hdr(Op.READ_RESP, key, 0, 0), Code.NOT_ALLOWED),
        ("random bytes", os.urandom(4096), None),
    ]


def _flush(key: int, ranges: list[tuple[int, int]]) -> bytes:
    body = encode_flush(ranges)
    return _hdr(Op.SEND, key, 0, len(body), SendKind.FLUSH) + body


def _expect_closed(raw: RawConn, code: int | None, case: str) -> None:
    """The connection ends: with an ERROR frame of ``code``, or (None) any ERROR or a bare close."""
    deadline = time.monotonic() + 5
    raw.sock.settimeout(5)
    try:
        frame, payload = raw.frame()
    except (EOFError, ConnectionResetError):
        assert code is None, f"{case}: closed without an ERROR frame"
        return
    assert time.monotonic() < deadline
    if frame.op == Op.SEND_REPLY:  # a valid earlier request in the case may be answered first
        frame, payload = raw.frame()
    assert frame.op == Op.ERROR and frame.flags & F_CLOSE, (case, frame, payload)
    if code is not None:
        assert frame.imm == code, (case, Code(frame.imm).name, payload)
    assert raw.eof(), f"{case}: connection left open"


def test_malformed_frames_close_only_their_connection(open_target: Running) -> None:
    """Every bad input closes its own connection; an initiator connected throughout is unharmed."""

    async def main() -> None:
        async with await connect(open_target.address, None, lanes=1, timeout=10) as good:
            region = await good.create_pool(pool_name(), POOL)
            lane = good.lanes[0]
            await _good_barrier(good, region, b"before")

            for case, data, code in _pre_auth_cases():
                raw = RawConn(open_target.address)
                try:
                    raw.send(data)
                    if case == "truncated hello":
                        raw.sock.shutdown(socket.SHUT_WR)
                    await trio.to_thread.run_sync(_expect_closed, raw, code, case)
                finally:
                    raw.close()
                await _good_barrier(good, region, case.encode())

            ctl, key, sid = raw_session(open_target.address)
            try:
                for case, data, code in _lane_cases(key):
                    raw = RawConn(open_target.address)
                    try:
                        raw.handshake(role=Role.LANE, sid=sid)
                        raw.send(data)
                        if case.startswith("truncated"):
                            raw.sock.shutdown(socket.SHUT_WR)
                        await trio.to_thread.run_sync(_expect_closed, raw, code, case)
                    finally:
                        raw.close()
                    await _good_barrier(good, region, case.encode())
                    assert await lane.read(region, 0, len(case)) == case.encode()
                # The abusive session's own control connection was never the one that broke.
                assert ctl.control({"op": "info"})["ok"]
            finally:
                ctl.close()
            assert not lane.closed
            await _good_barrier(good, region, b"after")
            assert await lane.read(region, 0, 5) == b"after"

    run(main)
    log = open_target.proc.log_text()
    for reason in ("closing lane: unknown op 0x7e", "closing lane: truncated frame", "bad magic",
                   "closing lane: WRITE with unregistered key",
                   f"initiator speaks wire version {VERSION + 7}"):
        assert reason in log, f"no logged reason {reason!r}"


def test_bad_control_requests_get_clean_refusals(open_target: Running) -> None:
    """Bad content in a well-framed control request is refused; the connection stays."""
    ctl = RawConn(open_target.address)
    try:
        ctl.handshake()
        bodies = [
            b"not json", b"[" * 60000, b"[1, 2]", b'{"op": "format-disk"}', b'{"op": "close", "key": 7}',
            b'{"op": "create", "name": "x", "size": "1G"}', b'{"op": "open", "name": 5}',
        ]
        for body in bodies:
            ctl.send(pack_header(Op.SEND, 0, 0, 0, len(body), 3, SendKind.CONTROL) + body)
            frame, payload = ctl.frame()
            assert frame.op == Op.SEND_REPLY and frame.id == 3, (body[:20], frame)
            reply = json.loads(payload)
            assert reply["ok"] is False and reply["error"], (body[:20], reply)
        assert ctl.control({"op": "info"})["method"] == "gpspm"
    finally:
        ctl.close()


def test_a_stalled_frame_is_cut_at_the_deadline(open_target: Running) -> None:
    ctl, key, sid = raw_session(open_target.address)
    raw = RawConn(open_target.address)
    try:
        raw.handshake(role=Role.LANE, sid=sid)
        raw.send(_hdr(Op.WRITE, key, 0, 1000) + b"only part of it")
        started = time.monotonic()
        raw.sock.settimeout(10)
        with pytest.raises((EOFError, ConnectionResetError)):
            raw.frame()
        assert time.monotonic() - started < 5  # --frame-timeout 1
    finally:
        raw.close()
        ctl.close()


def test_control_violation_ends_that_session_only(open_target: Running) -> None:
    async def main() -> None:
        async with await connect(open_target.address, None, lanes=1) as good:
            region = await good.create_pool(pool_name(), POOL)
            ctl, key, sid = raw_session(open_target.address)
            lane = RawConn(open_target.address)
            try:
                lane.handshake(role=Role.LANE, sid=sid)
                ctl.send(_hdr(Op.WRITE, key, 0, 4) + b"nope")  # data ops are for lanes
                await trio.to_thread.run_sync(_expect_closed, ctl, Code.NOT_ALLOWED, "write on control")
                # Its session ended with it: the lane that belonged to it is closed too.
                assert await trio.to_thread.run_sync(lane.eof), "lane outlived its session"
            finally:
                ctl.close()
                lane.close()
            await _good_barrier(good, region, b"unharmed")

    run(main)


def test_many_initiators_and_pools_at_once(open_target: Running) -> None:
    sessions, rounds = 6, 10

    async def one(n: int, results: dict[int, bytes]) -> None:
        async with await connect(open_target.address, None, lanes=2) as s:
            name = pool_name()
            region = await s.create_pool(name, POOL)
            for r in range(rounds):
                data = f"session {n} round {r}".encode()
                await barrier(s.lanes[r % 2], region, [(r * 64, data)], "apm" if r % 2 else "gpspm")
            results[n] = (open_target.pool_dir / name).read_bytes()[: rounds * 64]

    async def main() -> None:
        results: dict[int, bytes] = {}
        async with trio.open_nursery() as nursery:
            for n in range(sessions):
                nursery.start_soon(one, n, results)
        for n in range(sessions):
            for r in range(rounds):
                data = f"session {n} round {r}".encode()
                assert results[n][r * 64 : r * 64 + len(data)] == data

    run(main)


# --------------------------------------------------------------------------- start-up and stop


def test_apm_is_refused_without_a_pmem_mapping(scratch: Path) -> None:
    proc = TargetProcess(_fresh_dir(scratch), persist="apm", pmem="msync")
    try:
        with pytest.raises(SpawnError, match="exited with 2") as err:
            proc.start()
        assert "--persist apm" in str(err.value) and "'msync'" in str(err.value)
    finally:
        proc.close()


def test_apm_is_accepted_with_pmem_force(scratch: Path) -> None:
    target = Running(scratch, persist="apm", pmem="force")
    try:

        async def main() -> None:
            async with await connect(target.address, None, lanes=1) as s:
                assert s.info["method"] == "apm" and s.info["pmem"] == "force"
                region = await s.create_pool(pool_name(), POOL)
                assert region.method == "apm" and region.pmem == "force"
                await barrier(s.lanes[0], region, [(0, b"appliance")])
                assert (await s.stats(region.name))[region.name]["flushes"] == 1

        run(main)
    finally:
        target.finish()


def test_sigterm_stops_cleanly_with_sessions_open(scratch: Path) -> None:
    target = Running(scratch)
    name = pool_name()

    async def main() -> None:
        s = await connect(target.address, None, lanes=2)
        region = await s.create_pool(name, POOL)
        # Placed but never flushed by the initiator: the target persists it on the way out.
        await s.lanes[0].post_writes(region, [(4096, b"written before SIGTERM")])
        assert await s.lanes[0].read(region, 4096, 6) == b"writte"
        assert target.proc.proc is not None
        started = time.monotonic()
        target.proc.proc.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(target.proc.proc.wait, 10)
        assert code == 0 and time.monotonic() - started < 5
        with pytest.raises(TransportError):
            await barrier(s.lanes[1], region, [(0, b"too late")])
        await s.aclose()

    run(main)
    log = target.finish()
    assert "received SIGTERM" in log and "target stopped" in log
    with open(target.pool_dir / name, "rb") as f:
        f.seek(4096)
        assert f.read(22) == b"written before SIGTERM"


def test_port_in_use_is_a_clean_start_error(open_target: Running, scratch: Path) -> None:
    proc = TargetProcess(_fresh_dir(scratch), listen=open_target.address)
    try:
        with pytest.raises(SpawnError, match="cannot listen on"):
            proc.start()
    finally:
        proc.close()


# --------------------------------------------------------------------------- flush range lists


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_flush_list_costs_what_arrived_not_what_its_header_claims(open_target: Running) -> None:
    """Lanes that announce the largest flush list and send almost none of it: the target holds
    only their staging buffers, not the 4 MiB each header claims (which it used to allocate)."""
    lanes = 64
    claim = MAX_FLUSH_RANGES
    ctl, key, sid = raw_session(open_target.address)
    conns: list[RawConn] = []
    assert open_target.proc.proc is not None
    pid = open_target.proc.proc.pid
    try:
        before = _rss_kib(pid)
        for _ in range(lanes):
            lane = RawConn(open_target.address)
            conns.append(lane)
            lane.handshake(role=Role.LANE, sid=sid)
            length = 4 + 16 * claim
            lane.send(_hdr(Op.SEND, key, 0, length, SendKind.FLUSH) + struct.pack("<I", claim)
                      + struct.pack("<QQ", 0, 4096))
        # Every lane's bytes reached the target: a control request after them is answered,
        # and the target is still serving.
        assert ctl.control({"op": "stats"})["ok"]
        time.sleep(0.5)
        grown = _rss_kib(pid) - before
        # 64 claims of 4 MiB would be 256 MiB; what is really held is 64 KiB staging a lane.
        assert grown < 64 << 10, f"target grew by {grown} KiB for {lanes} unsent flush lists"
    finally:
        for c in conns:
            c.close()
        ctl.close()


def test_a_long_flush_list_is_merged_bounds_checked_and_counted(open_target: Running) -> None:
    """A list larger than the staging buffer (read piece by piece) naming the same bytes over
    and over is answered once, every range counted; a bad range in its last piece closes the
    lane after the earlier pieces were checked, and the session's other lane is unharmed."""
    n = 20_000  # 320 KiB of ranges: five staging buffers
    ctl = RawConn(open_target.address)
    lane = RawConn(open_target.address)
    other = RawConn(open_target.address)
    try:
        sid = ctl.handshake()
        name = pool_name()
        reply = ctl.control({"op": "create", "name": name, "size": POOL})
        assert reply["ok"], reply
        key = int(reply["key"])
        lane.handshake(role=Role.LANE, sid=sid)
        other.handshake(role=Role.LANE, sid=sid)
        lane.send(_hdr(Op.WRITE, key, 100, 5) + b"hello")
        lane.send(_flush(key, [(i % 64 * 4096, 4096 + i % 7) for i in range(n)]))
        frame, payload = lane.frame()
        assert frame.op == Op.SEND_REPLY, (frame, payload)
        stats = ctl.control({"op": "stats", "name": name})["pools"][name]
        assert stats["persisted_ranges"] == n and stats["flushes"] == 1, stats
        assert (open_target.pool_dir / name).read_bytes()[100:105] == b"hello"

        bad = [(0, 4096)] * (n - 1) + [(POOL - 1, 2)]
        lane.send(_flush(key, bad))
        _expect_closed(lane, Code.OUT_OF_BOUNDS, "bad range at the end of a long list")
        other.send(_flush(key, [(0, 4096)]))
        frame, _ = other.frame()
        assert frame.op == Op.SEND_REPLY
    finally:
        lane.close()
        other.close()
        ctl.close()


def test_a_hello_of_another_version_is_answered_with_code_1_and_a_bad_hello_with_code_2(
        open_target: Running) -> None:
    """docs/wire.md: the HELLO and the answer to a version the target does not speak (ERROR
    code 1, VERSION, saying which version it speaks) read the same to every version, so an
    initiator of version 1 (or a later one) learns why; a malformed HELLO is code 2."""

    def hello(magic: bytes, version: int) -> bytes:
        return HELLO.pack(magic, version, Role.CONTROL, 0, 0, b"n" * 32, NO_SESSION)

    for data, code, said in ((hello(HELLO_MAGIC, 1), 1, f"this target speaks {VERSION}"),
                             (hello(HELLO_MAGIC, VERSION + 1), 1, f"this target speaks {VERSION}"),
                             (hello(b"NOTRPMEM", VERSION), 2, "bad magic")):
        raw = RawConn(open_target.address)
        try:
            raw.send(data)
            got, reason = raw.closed_with_error()
            assert (got, Code(got).name) == (code, ["VERSION", "BAD_HELLO"][code - 1]), reason
            assert said in reason, reason
        finally:
            raw.close()
