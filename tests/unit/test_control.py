"""The control socket against clients that misbehave: garbage, nothing, a request cut short,
a client gone in the middle of its progress lines, one that never reads, a handler that
raises. Each ends its own request only: the socket keeps answering, the work asked for runs
to its end."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rpmemfs.mountd import control


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Unix socket paths are short (108 bytes); pytest's tmp_path may not be.
    d = tempfile.mkdtemp(prefix="rpm-ctl-")
    yield os.path.join(d, "c.sock")
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


class Work:
    """Handlers the tests ask for, and what became of the work they started."""

    def __init__(self) -> None:
        self.finished = trio.Event()
        self.lines_sent = 0
        self.held: list[int] = []

    def handlers(self) -> dict[str, control.Handler]:
        async def status(args: list[str], send: control.Send) -> dict[str, Any]:
            return {"ok": True, "args": args}

        async def slow(args: list[str], send: control.Send) -> dict[str, Any]:
            # Progress lines while it works, like verify; it must end whatever the client did.
            for i in range(int(args[0]) if args else 30):
                await send({"progress": i, "total": 30})
                self.lines_sent += 1
                await trio.sleep(0.01)
            self.finished.set()
            return {"done": True}

        async def flood(args: list[str], send: control.Send) -> dict[str, Any]:
            big = "x" * 65536
            for _ in range(400):  # 25 MiB: far beyond any socket buffer
                await send({"pad": big})
                if send.gone:
                    break
            self.finished.set()
            return {"done": True, "gone": send.gone}

        async def boom(args: list[str], send: control.Send) -> dict[str, Any]:
            raise RuntimeError("a bug behind one request")

        async def hold(args: list[str], send: control.Send) -> dict[str, Any]:
            self.held.append(send.hold())
            return {"held": True}

        return {"status": status, "slow": slow, "flood": flood, "boom": boom, "hold": hold}


async def _connect(path: str) -> trio.SocketStream:
    s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await s.connect(path)
    return trio.SocketStream(s)


async def _lines(stream: trio.SocketStream) -> list[dict[str, Any]]:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


async def _ask(path: str, request: bytes) -> list[dict[str, Any]]:
    stream = await _connect(path)
    async with stream:
        await stream.send_all(request)
        return await _lines(stream)


def _serving(path: str, work: Work, body: Callable[[], Awaitable[None]]) -> None:
    """Run the control socket at ``path`` while ``body`` runs; then it must still answer."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(control.serve, path, work.handlers())
            with trio.fail_after(30):
                await body()
                assert await _ask(path, b"status still\n") == [{"ok": True, "args": ["still"]}]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_garbage_and_unknown_requests_are_answered_and_forgotten(sock_path: str) -> None:
    async def body() -> None:
        assert await _ask(sock_path, b"\xff\xfe\x00garbage\n") == [{"error": "unknown request"}]
        assert await _ask(sock_path, b"\n") == [{"error": "no request"}]
        # A request line longer than any request, without a newline: read no further. The
        # rest is never read, so the client may see its connection reset instead of the answer.
        try:
            assert await _ask(sock_path, b"a" * 100_000) == [{"error": "unknown request"}]
        except trio.BrokenResourceError:
            pass
        assert await _ask(sock_path, b"status a b\nand more\n") == [{"ok": True, "args": ["a", "b"]}]

    _serving(sock_path, Work(), body)


def test_clients_that_send_nothing_or_leave_at_once(sock_path: str, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    monkeypatch.setattr(control, "REQUEST_SECONDS", 0.2)

    async def body() -> None:
        for _ in range(5):  # connect and close without a word
            stream = await _connect(sock_path)
            await stream.aclose()
        half = await _connect(sock_path)  # half a request, then gone
        await half.send_all(b"sta")
        await half.aclose()
        quiet = await _connect(sock_path)  # connected, silent: told so after REQUEST_SECONDS
        async with quiet:
            assert await _lines(quiet) == [{"error": "no request"}]
        rude = await _connect(sock_path)  # resets the connection instead of closing it
        rude.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        await rude.send_all(b"slow 5\n")
        await rude.aclose()
        await trio.sleep(0.3)

    _serving(sock_path, Work(), body)


def test_a_client_gone_mid_progress_ends_only_its_lines(sock_path: str) -> None:
    work = Work()

    async def body() -> None:
        stream = await _connect(sock_path)
        await stream.send_all(b"slow 60\n")
        first = await stream.receive_some(100)
        assert b"progress" in first
        await stream.aclose()  # gone while the work goes on
        await work.finished.wait()  # ...and the work ran to its end
        assert work.lines_sent == 60

    _serving(sock_path, work, body)


def test_a_client_that_never_reads_is_dropped(sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "SEND_SECONDS", 0.3)
    work = Work()

    async def body() -> None:
        stream = await _connect(sock_path)
        async with stream:
            await stream.send_all(b"flood\n")
            await work.finished.wait()  # the handler was not held up for good

    _serving(sock_path, work, body)


def test_a_handler_that_raises_answers_an_internal_error(sock_path: str) -> None:
    async def body() -> None:
        (answer,) = await _ask(sock_path, b"boom\n")
        assert "internal error in boom" in answer["error"] and "a bug behind one request" in answer["error"]

    _serving(sock_path, Work(), body)


def test_a_held_connection_gets_one_more_line_and_ends_with_the_holder(sock_path: str) -> None:
    work = Work()

    async def body() -> None:
        stream = await _connect(sock_path)
        await stream.send_all(b"hold\n")
        got = b""
        while b"\n" not in got:
            got += await stream.receive_some(100)
        assert json.loads(got) == {"held": True}
        control.tell_held(work.held, {"closed": True})
        assert await stream.receive_some(100) == b'{"closed": true}\n'
        for fd in work.held:  # what the daemon's exit does
            os.close(fd)
        assert await stream.receive_some(100) == b""
        await stream.aclose()

    _serving(sock_path, work, body)


def test_unmount_client_reports_a_refusal_and_the_last_word(sock_path: str, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """control.unmount against a stand-in daemon: a refusal comes back as it is; otherwise
    the last word, once the connection has ended."""
    monkeypatch.setattr(control, "socket_path", lambda point, resolved=False: sock_path)
    refuse = {"error": "busy"}
    held: list[int] = []

    async def umount(args: list[str], send: control.Send) -> dict[str, Any]:
        if refuse:
            return dict(refuse)
        held.append(send.hold())
        return {"unmounting": True}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(control.serve, sock_path, {"umount": umount})
            assert await trio.to_thread.run_sync(control.unmount, "/x", 5.0) == {"error": "busy"}
            refuse.clear()

            async def close_later() -> None:
                while not held:
                    await trio.sleep(0.01)
                control.tell_held(held, {"closed": True, "clean": True})
                await trio.sleep(0.2)
                os.close(held[0])

            nursery.start_soon(close_later)
            last = await trio.to_thread.run_sync(control.unmount, "/x", 5.0)
            assert last == {"closed": True, "clean": True}
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert Path(sock_path).exists() is False


def test_an_asker_that_closed_is_not_present_one_that_only_stopped_sending_is(sock_path: str) -> None:
    seen: list[bool] = []
    asked = [trio.Event()]

    async def look(args: list[str], send: control.Send) -> dict[str, Any]:
        asked[0].set()
        await trio.sleep(0.2)  # meanwhile the client does what its argument says
        seen.append(send.present())
        return {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(control.serve, sock_path, {"look": look})
            for how in ("close", "shut_wr"):
                stream = await _connect(sock_path)
                await stream.send_all(b"look\n")
                await asked[0].wait()
                if how == "close":
                    await stream.aclose()
                else:
                    await stream.send_eof()
                    assert await _lines(stream) == [{}]
                    await stream.aclose()
                asked[0] = trio.Event()
                while len(seen) < (1 if how == "close" else 2):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen == [False, True]
