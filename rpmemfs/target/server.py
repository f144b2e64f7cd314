"""The listening daemon: accepts connections, runs each in its own task, stops on SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

import trio

from rpmemfs.target.authz import TokenBook
from rpmemfs.target.control import ControlService
from rpmemfs.target.datapath import FrameLoop
from rpmemfs.target.handshake import ClosedBeforeHello, HandshakeRefused, accept
from rpmemfs.target.lane_native import NativeLane
from rpmemfs.target.pools import PoolStore
from rpmemfs.target.sessions import SessionTable
from rpmemfs.transport.address import format_address
from rpmemfs.transport.sockio import SockIO, tune
from rpmemfs.transport.stream import STAGING_SIZE, FrameReader, PeerClosed
from rpmemfs.transport.wire import VERSION, Role

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
    max_connections: int
    handshake_timeout: float
    frame_timeout: float
    idle_timeout: float
    spin_us: int = 0
    native: bool = True  # lanes' receive loops in C threads
    rdma: bool = True  # serve verbs lanes too, where an RDMA device has the listen address


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
        }
        self.control = ControlService(store, self.sessions, config.method, self.info)
        self._connections = 0

    async def run(self, listener: socket.socket) -> None:
        """Serve until SIGTERM or SIGINT; then close every connection and every pool."""
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                # Announced only now, so whoever waits for the line may signal us right away.
                address = announce(listener)
                log.info(
                    "target on %s serving %s: method %s, pmem %s, tokens %s",
                    address, self.config.pool_dir, self.config.method, self.config.pmem_kind,
                    ", ".join(f"{g.name} ({'admin' if g.admin else 'pools'})"
                              for g in self.config.tokens.grants()),
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._stop_on_signal, signals, nursery.cancel_scope)
                    nursery.start_soon(self.control.watch_activity)
                    if self.config.rdma:
                        self._start_verbs(listener, nursery)
                    await self._accept_loop(listener, nursery)
        finally:
            listener.close()
            self.store.close_all()
            log.info("target stopped; pools persisted and closed")

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
            log.info("received %s: stopping", signal.Signals(signum).name)
            scope.cancel()
            return

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
            if self._connections >= self.config.max_connections:
                log.warning("refusing %s: %d connections already open", addr[0], self._connections)
                sock.close()
                continue
            nursery.start_soon(self._connection, sock, addr)

    async def _connection(self, sock: socket.socket, addr: Any) -> None:
        peer = format_address(addr[0], addr[1])
        self._connections += 1
        io = SockIO(sock)
        try:
            await self._serve(io, peer, addr[0])
        except Exception:
            # A bug met by one connection must not take the others down with the nursery.
            log.exception("peer %s: internal error; closing its connection", peer)
        finally:
            io.close()
            self._connections -= 1

    async def _serve(self, sock: SockIO, peer: str, host: str) -> None:
        cfg = self.config
        tune(sock.sock)
        # Small until the peer has authenticated: unauthenticated connections cost little.
        reader = FrameReader(sock, HANDSHAKE_STAGING)
        try:
            with trio.fail_after(cfg.handshake_timeout):
                role, session = await accept(sock, reader, peer, cfg.tokens, self.sessions, self.info)
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
        reader.resize(STAGING_SIZE)
        apm = cfg.method == "apm"
        native = None
        if role == Role.LANE and cfg.native:
            native = NativeLane(
                sock, reader, session.table, apm=apm, spin_us=cfg.spin_us,
                idle_timeout=cfg.idle_timeout, frame_timeout=cfg.frame_timeout,
            )
        loop = FrameLoop(
            sock, reader, peer, session, role, self.control,
            apm=apm, idle_timeout=cfg.idle_timeout, frame_timeout=cfg.frame_timeout, native=native,
        )
        if role == Role.CONTROL:
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
