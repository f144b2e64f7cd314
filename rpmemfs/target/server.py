"""The listening daemon: accepts connections, runs each in its own task, stops on SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from rpmemfs.metrics_endpoint import MetricsEndpoint
from rpmemfs.sdnotify import notify
from rpmemfs.target.admission import (
    DEFAULT_ADMIN_RESERVE,
    DEFAULT_EMPTY_SESSION_TIMEOUT,
    DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HANDSHAKES_PER_PEER,
    DEFAULT_MAX_PER_TOKEN,
    Admission,
    Connection,
    FailedProofs,
    Full,
    Handshake,
)
from rpmemfs.target.authz import AuthzError, TokenBook
from rpmemfs.target.control import ControlService
from rpmemfs.target.frame_loop import FrameLoop
from rpmemfs.target.handshake import ClosedBeforeHello, HandshakeRefused, accept, refuse
from rpmemfs.target.lane_native import NativeLane
from rpmemfs.target.pools import PoolStore
from rpmemfs.target.sessions import SessionTable, TargetSession
from rpmemfs.transport.address import format_address
from rpmemfs.transport.sockio import SockIO, tune
from rpmemfs.transport.stream import STAGING_SIZE, FrameReader, PeerClosed
from rpmemfs.transport.tokens import TokenError
from rpmemfs.transport.wire import VERSION, Code, Role

log = logging.getLogger("rpmemfs.target")

HANDSHAKE_STAGING = 4096


@dataclass(frozen=True)
class TargetConfig:
    host: str
    port: int
    pool_dir: str
    tokens: TokenBook  # the tokens it accepts, and what each may do
    method: str  # "apm" or "gpspm": what the target advertises
    pmem_mode: str
    pmem_kind: str  # what the start-up probe mapped
    max_pool_size: int
    max_connections: int  # authenticated connections
    handshake_timeout: float
    frame_timeout: float
    idle_timeout: float
    spin_us: int = 0
    rdma: bool = True  # serve verbs lanes too, where an RDMA device has the listen address
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES  # unauthenticated connections, in total...
    max_handshakes_per_peer: int = DEFAULT_MAX_HANDSHAKES_PER_PEER  # ...and per peer address
    max_connections_per_token: int = DEFAULT_MAX_PER_TOKEN  # a pools token's, unless its line says
    admin_reserve: int = DEFAULT_ADMIN_RESERVE  # of max_connections, for admin tokens alone
    # A control connection whose session holds no pool, idle this long, is closed.
    empty_session_timeout: float = DEFAULT_EMPTY_SESSION_TIMEOUT
    metrics: MetricsEndpoint | None = None  # where to serve Prometheus metrics, and how
    protect: bool = True  # TCP traffic sealed (docs/wire.md); False: --wire-protection none
    # Reads the token files again (SIGHUP); raises AuthzError/TokenError/OSError when one is wrong.
    load_tokens: Callable[[], TokenBook] | None = None


async def listen(host: str, port: int) -> socket.socket:
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Server:
    def __init__(self, config: TargetConfig, store: PoolStore) -> None:
        self.config = config
        self.store = store
        self.sessions = SessionTable(store)
        self.info: dict[str, Any] = {
            "target": "rpmemfs",
            "wire_version": VERSION,
            "method": config.method,
            "pmem": config.pmem_kind,
            "max_pool_size": config.max_pool_size,
            "wire_protection": "aead" if config.protect else "none",
        }
        self.control = ControlService(store, self.sessions, config.method, self.info, config.tokens)
        self.admission = Admission(config.max_connections, config.max_handshakes,
                                   config.max_handshakes_per_peer,
                                   max_per_token=config.max_connections_per_token,
                                   admin_reserve=config.admin_reserve)
        self.failed_proofs = FailedProofs()
        self._full_logged = 0.0
        self._pushed_out_logged = (0.0, 0)  # when, and the count then

    async def run(self, listener: socket.socket) -> None:
        """Serve until SIGTERM or SIGINT; then close every connection and every pool. SIGHUP
        reads the token files again."""
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                stop_metrics = self._serve_metrics()
                # Announced only now, so whoever waits for the line may signal us right away.
                address = announce(listener)
                notify("READY=1", f"STATUS=serving {self.config.pool_dir} on {address}")
                log.info(
                    "target on %s serving %s: method %s, pmem %s, wire protection %s, tokens %s",
                    address, self.config.pool_dir, self.config.method, self.config.pmem_kind,
                    self.info["wire_protection"], self.config.tokens.describe(),
                )
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._stop_on_signal, signals, nursery.cancel_scope)
                        nursery.start_soon(self.control.watch_activity)
                        if self.config.rdma:
                            self._start_verbs(listener, nursery)
                        await self._accept_loop(listener, nursery)
                finally:
                    stop_metrics()
        finally:
            notify("STOPPING=1")
            listener.close()
            self.store.close_all()
            log.info("target stopped; pools persisted and closed")

    def _serve_metrics(self) -> Callable[[], None]:
        if self.config.metrics is None:
            return lambda: None
        from rpmemfs.target.metrics import serve_target_metrics

        try:
            return serve_target_metrics(self.config.metrics, self.metrics_snapshot)
        except OSError as exc:
            raise SystemExit(f"rpmemfs: cannot serve metrics on {self.config.metrics.url()}: "
                             f"{exc.strerror or exc}") from None

    def metrics_snapshot(self) -> dict[str, Any]:
        """What the metrics show, taken on the trio thread in one go."""
        return {"sessions": len(self.sessions), "connections": self.admission.authenticated,
                "handshakes": self.admission.handshakes,
                "handshakes_dropped": self.admission.dropped,
                "failed_proofs": self.failed_proofs.total, "pools": self.control.listing()}

    def _start_verbs(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        """Serve verbs on the same address and port number (rdmacm's port space is its own)."""
        from rpmemfs.target.verbs_server import VerbsService

        host, port = listener.getsockname()[:2]
        verbs = VerbsService.start(host, port, self.sessions, self.control.handle, self.config.spin_us / 1e6)
        if verbs is not None:
            self.control.verbs = verbs
            self.info["rdma"] = {"port": port, "device": verbs.device}
            nursery.start_soon(verbs.run)

    async def _stop_on_signal(self, signals: Any, scope: trio.CancelScope) -> None:
        async for signum in signals:
            if signum == signal.SIGHUP:
                self.reload_tokens()
                continue
            log.info("received %s: stopping", signal.Signals(signum).name)
            scope.cancel()
            return

    def reload_tokens(self) -> None:
        """Accept the tokens the files name now: rotation without a restart. A wrong file
        changes nothing (the error is logged); open sessions keep the token they proved."""
        if self.config.load_tokens is None:
            return
        try:
            book = self.config.load_tokens()
        except (AuthzError, TokenError, OSError) as exc:
            log.error("SIGHUP: tokens not reread, the ones in use stay: %s", exc)
            notify("STATUS=token reload failed; the previous tokens stay in use")
            return
        self.config.tokens.replace_with(book)
        log.info("SIGHUP: tokens reread: %s", book.describe())

    async def _accept_loop(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as exc:
                # EMFILE and friends: wait for descriptors to free up instead of spinning.
                log.error("accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            # Counted here, before its task starts: a burst of connections cannot overshoot.
            hs = self.admission.begin(addr[0])
            if hs is None:
                if time.monotonic() - self._full_logged > 10:
                    self._full_logged = time.monotonic()
                    log.warning("refusing connections (the latest from %s): %d authenticated "
                                "connections open, the cap, each holding a pool or busy", addr[0],
                                self.admission.authenticated)
                sock.close()
                continue
            nursery.start_soon(self._connection, sock, addr, hs)
            # Let the handshakes this one pushed out close their sockets before the next
            # accept: a burst must not hold descriptors past the caps.
            await trio.lowlevel.checkpoint()

    async def _connection(self, sock: socket.socket, addr: Any, hs: Handshake) -> None:
        peer = format_address(addr[0], addr[1])
        io = SockIO(sock)
        try:
            await self._serve(io, peer, addr[0], hs)
        except Exception:
            # A bug met by one connection must not take the others down with the nursery.
            log.exception("peer %s: internal error; closing its connection", peer)
        finally:
            io.close()
            self.admission.end_handshake(hs)  # (nothing, once it authenticated)

    async def _throttle(self, host: str, key: bytes | None) -> None:
        await trio.sleep(self.failed_proofs.failed(host, key))

    async def _serve(self, sock: SockIO, peer: str, host: str, hs: Handshake) -> None:
        cfg = self.config
        tune(sock.sock)
        # Small until the peer has authenticated: unauthenticated connections cost little.
        reader = FrameReader(sock, HANDSHAKE_STAGING)
        try:
            with hs.scope, trio.fail_after(cfg.handshake_timeout):
                role, session = await accept(sock, reader, peer, cfg.tokens, self.sessions, self.info,
                                             partial(self._throttle, host), protect=cfg.protect)
            if hs.dropped:
                # Pushed out by newer connections over the caps (admission.py); counted and
                # reported there, in one line for many.
                log.debug("peer %s: handshake closed: unauthenticated connections over the cap", peer)
                return
        except HandshakeRefused as exc:
            log.warning("refused %s: %s", peer, exc.reason)
            return
        except ClosedBeforeHello:
            # Initiators probe a target they lost every fraction of a second until it is
            # back: not worth a line at the default level.
            log.debug("peer %s closed before the handshake (a reachability probe)", peer)
            return
        except trio.TooSlowError:
            log.warning("refused %s: handshake not completed within %gs", peer, cfg.handshake_timeout)
            return
        except (PeerClosed, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("peer %s left during the handshake: %s", peer, exc)
            return
        grant = session.grant
        try:
            conn = self.admission.authenticate(hs, grant.name, grant.admin, grant.max_connections)
        except Full as exc:
            self._log_full(peer, str(exc))
            await refuse(sock, Code.PEER_REFUSED, str(exc))
            if role == Role.CONTROL:
                self.sessions.end(session)
            return
        self._log_pushed_out()
        try:
            with conn.scope:
                await self._serve_authenticated(sock, reader, peer, role, session, conn)
        finally:
            self.admission.end_authenticated(conn)
        if conn.dropped:
            log.debug("peer %s: connection of token %r closed: it held no pool and another needed "
                      "its room", peer, grant.name)

    def _log_full(self, peer: str, why: str) -> None:
        # A flood meets its cap many times a second: one line per interval says it.
        if time.monotonic() - self._full_logged > 10:
            self._full_logged = time.monotonic()
            log.warning("refused %s (and any more within 10 s): %s", peer, why)

    def _log_pushed_out(self) -> None:
        when, count = self._pushed_out_logged
        if self.admission.pushed_out > count and time.monotonic() - when > 10:
            log.warning("connections over a cap: %d connections holding no pool closed to make room "
                        "since the last report, the latest of token %r", self.admission.pushed_out - count,
                        self.admission.last_pushed_out)
            self._pushed_out_logged = (time.monotonic(), self.admission.pushed_out)

    async def _serve_authenticated(self, sock: SockIO, reader: FrameReader, peer: str, role: Role,
                                   session: TargetSession, conn: Connection) -> None:
        cfg = self.config
        reader.resize(STAGING_SIZE)
        native = None
        if role == Role.LANE:
            native = NativeLane(
                sock, reader, session.table, apm=cfg.method == "apm", spin_us=cfg.spin_us,
                idle_timeout=cfg.idle_timeout, frame_timeout=cfg.frame_timeout,
            )
        loop = FrameLoop(
            sock, reader, peer, session, self.control, native, idle_timeout=cfg.idle_timeout,
            frame_timeout=cfg.frame_timeout, empty_timeout=cfg.empty_session_timeout,
        )
        if role == Role.CONTROL:
            # Its lanes go with it, so a lane never needs pushing out on its own.
            conn.idle_and_empty = loop.idle_and_empty
            log.info("peer %s: session %s opened", peer, session.id.hex()[:8])
            try:
                await loop.run()
            finally:
                self.sessions.end(session)
                log.info("peer %s: session %s ended", peer, session.id.hex()[:8])
            return
        with trio.CancelScope() as scope:
            session.lanes.add(scope)
            try:
                await loop.run()
            finally:
                session.lanes.discard(scope)


def announce(listener: socket.socket) -> str:
    """Print the bound address on stdout: with port 0 this is how a caller learns the port."""
    host, port = listener.getsockname()[:2]
    address = format_address(host, port)
    print(f"rpmemfs target listening on {address}", file=sys.stdout, flush=True)
    return address


async def serve(config: TargetConfig, store: PoolStore) -> None:
    try:
        listener = await listen(config.host, config.port)
    except OSError as exc:
        raise SystemExit(
            f"rpmemfs: cannot listen on {format_address(config.host, config.port)}: {exc.strerror or exc}"
        ) from None
    await Server(config, store).run(listener)
