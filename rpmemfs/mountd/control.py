"""The mount daemon's control socket: `rpmemfs status` asks it, whatever the mount options.

One Unix socket per mount, named after the mountpoint, in a directory of the mount's user
alone, mode 0700, owner checked by the daemon and by every client before use. For root it is
/run/rpmemfs. For another user it is in the user's runtime directory where there is one
($XDG_RUNTIME_DIR, else /run/user/UID, each used only when it is the user's, mode 0700), else
/tmp/rpmemfs-UID; another user can make that one first, and then it is refused (never used),
naming who made it. A client looks in each of them in that order, so that `rpmemfs status`
finds a mount started where the runtime directory was another or none (at boot, from cron).

The protocol is a line in ("status", "verify [CHUNK]", "sync", "flush", "umount"), JSON
lines back: any number of progress lines ({"progress": bytes done, "total": bytes}) for long
requests, then the answer. `umount` answers twice: once the kernel let go of the mountpoint,
and once more when the pool is closed; the connection ends when the daemon has exited.

The clients are other processes that may die, hang, or send anything at any moment: nothing
one of them does ends more than its own request. A client that goes away stops the lines
sent to it; the work it asked for is the daemon's and runs to its end.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pwd
import select
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

log = logging.getLogger("rpmemfs.mountd.control")
MAX_REQUEST = 256
REQUEST_SECONDS = 5.0  # a client that has not sent its request line by then gets no more time
# A line to a client that does not read for this long ends its connection: a send is never
# cut short by a cancellation (a half line would garble what follows), so this bounds it.
SEND_SECONDS = 10.0
_CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class ControlDirError(OSError):
    """The control socket directory is not this user's alone; it is never used (whoever made
    it could answer status requests with made-up states, or take the requests)."""


ROOT_DIR = "/run/rpmemfs"


def _users_alone(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def socket_dirs() -> list[str]:
    """Where this user's control sockets may be, the one a new mount uses first (see the
    module's text)."""
    uid = os.geteuid()
    if uid == 0:
        return [ROOT_DIR]
    found: list[str] = []
    # A runtime directory that is not this user's alone (one kept across su, say) is passed over.
    for runtime in (os.environ.get("XDG_RUNTIME_DIR", ""), f"/run/user/{uid}"):
        mine = os.path.join(runtime, "rpmemfs")
        if os.path.isabs(runtime) and _users_alone(runtime) and mine not in found:
            found.append(mine)
    return [*found, f"/tmp/rpmemfs-{uid}"]


def check_socket_dir(path: str) -> None:
    """ControlDirError unless ``path`` is a directory (not a link) of this user, mode 0700;
    FileNotFoundError when there is none."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ControlDirError(f"control socket directory {path} is not a directory; refusing to use it")
    if st.st_uid != os.geteuid():
        raise ControlDirError(
            f"control socket directory {path} belongs to uid {st.st_uid}{_who(st.st_uid)}, not to "
            f"this user (uid {os.geteuid()}): someone else made it first; refusing to use it (have "
            "it removed, or set XDG_RUNTIME_DIR to a directory of yours with mode 0700, for this "
            "mount and the commands that ask it)"
        )
    if st.st_mode & 0o077:
        raise ControlDirError(
            f"control socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; others may "
            f"reach or replace its sockets: refusing to use it (chmod 700 {path})"
        )


def _who(uid: int) -> str:
    try:
        return f" ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""


def socket_path(mountpoint: str, *, resolved: bool = False, serving: bool = False) -> str:
    """The socket of the daemon serving ``mountpoint``: the first of socket_dirs() that holds
    it, else where a new mount puts it; ``serving``: where the daemon about to serve it puts
    it (the first of socket_dirs(), whatever is left elsewhere). ``resolved``: the path is the
    kernel's own (from the mount table) and is not resolved again, which would stat the mount
    itself and hang on a daemon that does not answer."""
    path = mountpoint if resolved else os.path.realpath(mountpoint)
    name = hashlib.sha256(path.encode()).hexdigest()[:20] + ".sock"
    dirs = socket_dirs()
    for directory in [] if serving else dirs:
        try:
            check_socket_dir(directory)  # what another user made is never looked into
            if stat.S_ISSOCK(os.lstat(os.path.join(directory, name)).st_mode):
                return os.path.join(directory, name)
        except OSError:
            continue
    return os.path.join(dirs[0], name)


def log_path(socket: str) -> str:
    """Where the daemon with the control socket ``socket`` logs when it forked off with
    neither `-o log=` nor a syslog socket: beside the socket, in its user's directory."""
    return socket.removesuffix(".sock") + ".log"


class Asker:
    """The client of one request, as its handler sees it: ``await send(doc)`` sends it a line.

    Sending never raises: once the client is gone (it closed, died, or stopped reading for
    SEND_SECONDS) ``gone`` is True and further lines are dropped.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._lock = trio.Lock()  # lines from concurrent senders (a ticker, the answer) never interleave
        self.gone = False

    async def __call__(self, doc: dict[str, Any]) -> None:
        if self.gone:
            return
        line = json.dumps(doc).encode() + b"\n"
        async with self._lock:
            if self.gone:
                return
            with trio.move_on_after(SEND_SECONDS) as scope:
                scope.shield = True
                try:
                    await self._stream.send_all(line)
                except _CLIENT_GONE as exc:
                    log.info("control client went away: %s", exc)
                    self.gone = True
            if scope.cancelled_caught:
                log.info("control client does not read; dropping it")
                self.gone = True

    def present(self) -> bool:
        """Whether the client is still there: it has not closed its connection (a client that
        gave up waiting must not have its request carried out after it said it was not). One
        that only shut down its sending side is still there."""
        if self.gone:
            return False
        p = select.poll()
        p.register(self._stream.socket.fileno(), select.POLLHUP)
        return not p.poll(0)

    def hold(self) -> int:
        """A second descriptor of the connection, for a line after the event loop has ended
        (tell_held). It is never closed: the client sees the connection end when this process
        has exited."""
        return os.dup(self._stream.socket.fileno())


# A request's handler gets its argument words and the asker (progress lines go through it);
# it returns the answer.
Send = Asker
Handler = Callable[[list[str], Send], Awaitable[dict[str, Any]]]


def tell_held(fds: list[int], doc: dict[str, Any]) -> None:
    """One last line to each connection kept by Asker.hold, without blocking on any."""
    line = json.dumps(doc).encode() + b"\n"
    for fd in fds:
        try:
            os.set_blocking(fd, False)
            os.write(fd, line)
        except OSError:
            pass  # that client is gone; nobody is waiting there


def prepare_dir(path: str) -> None:
    """Make the directory of socket ``path`` (mode 0700) unless it exists; ControlDirError
    unless it is this user's alone."""
    directory = os.path.dirname(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    check_socket_dir(directory)


async def serve(path: str, handlers: Mapping[str, Handler],
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer on the socket at path (from socket_path, taken BEFORE mounting: resolving
    the mountpoint afterwards would ask this very daemon, which is busy right here)."""
    prepare_dir(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left behind by a daemon that was killed
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(8)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        async def answer(stream: trio.SocketStream) -> None:
            await _answer(stream, handlers)

        await trio.serve_listeners(answer, [listener])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _read_request(stream: trio.SocketStream) -> bytes:
    request = b""
    with trio.move_on_after(REQUEST_SECONDS):
        while b"\n" not in request and len(request) < MAX_REQUEST:
            chunk = await stream.receive_some(MAX_REQUEST)
            if not chunk:
                break
            request += chunk
    return request.partition(b"\n")[0]


async def _answer(stream: trio.SocketStream, handlers: Mapping[str, Handler]) -> None:
    """One connection: its request, the handler's lines, the answer. Whatever the client does
    (garbage, nothing, gone at any point) and whatever the handler raises ends here; only
    a cancellation (the daemon is stopping) goes on."""
    asker = Asker(stream)
    try:
        async with stream:
            request = await _read_request(stream)
            words = request.decode(errors="replace").split()
            handler = handlers.get(words[0]) if words else None
            if handler is None:
                log.info("control socket: unknown request %r", request[:40])
                await asker({"error": "unknown request" if words else "no request"})
                return
            try:
                answer = await handler(words[1:], asker)
            except Exception as exc:  # a bug behind one request must not end the daemon
                log.exception("control request %r failed", words[0])
                answer = {"error": f"internal error in {words[0]}: {exc!r}"}
            await asker(answer)
    except _CLIENT_GONE as exc:
        log.info("control client went away: %s", exc)


def _connect(path: str, timeout: float | None) -> socket.socket:
    check_socket_dir(os.path.dirname(path))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(path)
    except BaseException:
        s.close()
        raise
    return s


def listener_pid(point: str, timeout: float = 2.0) -> int | None:
    """The pid of the daemon listening on the control socket of the mount at ``point`` (the
    kernel's path), from the socket's credentials: nothing is asked of the daemon, so one that
    is stuck tells it too. None when nobody listens there."""
    try:
        with _connect(socket_path(point, resolved=True), timeout) as s:
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid: int = struct.unpack("3i", creds)[0]
    return pid or None


def query(mountpoint: str, request: str = "status", timeout: float | None = 10.0,
          progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Ask the daemon serving mountpoint; OSError when none answers."""
    with _connect(socket_path(mountpoint), timeout) as s:
        s.sendall(request.encode() + b"\n")
        with s.makefile("rb") as f:
            for line in f:
                doc = json.loads(line)
                if isinstance(doc, dict) and "progress" in doc and len(doc) == 2:
                    if progress is not None:
                        progress(int(doc["progress"]), int(doc["total"]))
                    continue
                return doc  # type: ignore[no-any-return]
    raise OSError(f"the daemon serving {mountpoint} closed the control socket without an answer")


EXIT_WAIT = 60.0  # after its last line the daemon only has to end its process


def unmount(point: str, timeout: float | None) -> dict[str, Any]:
    """Ask the daemon serving the mount at ``point`` (the kernel's path for it) to unmount,
    and wait until it has exited.

    The answer is the daemon's refusal ({"error": ...}: busy, say; it stays mounted), or its
    last word, {"closed": bool, "clean": bool, ...} (closed False: it exited without saying
    the pool is closed, or did not exit; "error" says more). OSError (or ValueError for what
    is not an answer) when no daemon answers within ``timeout``: nothing was done then.
    """
    with _connect(socket_path(point, resolved=True), timeout) as s:
        s.sendall(b"umount\n")
        with s.makefile("rb") as f:
            first = f.readline()
            if not first:
                raise OSError("the daemon closed the control socket without an answer")
            doc = json.loads(first)
            if not isinstance(doc, dict):
                raise ValueError(f"unexpected answer {first[:80]!r}")
            if "error" in doc:
                return doc
            pid = doc.get("pid")
            last: dict[str, Any] = {"closed": False, "clean": False}
            # The kernel has let go; closing the pool takes the last durability point, which
            # is bounded by the replicas' timeout, not by ours.
            s.settimeout(None)
            try:
                for line in [first, *f]:
                    got = json.loads(line)
                    if isinstance(got, dict) and "closed" in got:
                        last = got
            except (OSError, ValueError) as e:
                return {**last, "closed": False, "error": f"its last word was lost: {e}"}
            # The connection ends when the daemon's process does: its last word may come
            # just before.
    if isinstance(pid, int):
        try:
            _wait_exit(pid, EXIT_WAIT)
        except OSError as e:
            return {**last, "closed": False, "error": str(e)}
    return last


def _wait_exit(pid: int, timeout: float) -> None:
    """Wait until process ``pid`` has exited (it is not our child); OSError if it has not
    within ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise OSError(f"the daemon (pid {pid}) has not exited {timeout:g} s after closing its pool")
    finally:
        os.close(fd)


async def with_progress(total: int, send: Send,
                        work: Callable[[Callable[[int], None]], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``work`` while progress lines go to the asker twice a second.

    The work is the daemon's once started: an asker that goes away (killed, say) only
    stops the lines, and the work runs to its end. Cancelling it halfway would lose the
    replica's connection in the middle of a request (transport/conn.py) with the replica
    still counted in sync; only the end of the mount cancels it (the mount daemon's _sync)."""
    done = [0]
    finished = trio.Event()

    def count(n: int) -> None:
        done[0] += n

    async def ticker() -> None:
        # Sends are never cancelled (a half line would garble the answer after it), so
        # this ends between them, when the work has.
        while not send.gone:
            with trio.move_on_after(0.5):
                await finished.wait()
            if finished.is_set():
                return
            await send({"progress": done[0], "total": total})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        try:
            return await work(count)
        finally:
            finished.set()
