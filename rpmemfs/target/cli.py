"""``python -m rpmemfs.target`` / ``rpmemfs target``: options, start-up checks, run."""

from __future__ import annotations

import argparse
import logging
import math
import os
import resource
import sys
from collections.abc import Sequence

import trio

from rpmemfs import logs
from rpmemfs.metrics_endpoint import metrics_endpoint
from rpmemfs.pmem import PMEM_MODES
from rpmemfs.target.admission import (
    DEFAULT_ADMIN_RESERVE,
    DEFAULT_EMPTY_SESSION_TIMEOUT,
    DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_HANDSHAKES_PER_PEER,
    DEFAULT_MAX_PER_TOKEN,
    MAX_HANDSHAKE_TIMEOUT,
)
from rpmemfs.target.authz import DEFAULT_NAME, AuthzError, Grant, TokenBook, read_authz
from rpmemfs.target.errors import TargetError
from rpmemfs.target.pooldevs import PoolDevError, parse_pool_dev
from rpmemfs.target.pooldir import PoolDirError, check_pool_dir
from rpmemfs.target.pools import PoolError, PoolStore
from rpmemfs.target.server import TargetConfig, serve
from rpmemfs.transport.address import parse_address
from rpmemfs.transport.tokens import (
    ROOT_STATE_DIR,
    STATE_ENV,
    TokenError,
    default_state_dir,
    generated_token,
    read_tokens,
)
from rpmemfs.units import parse_size

log = logging.getLogger("rpmemfs.target")

DEFAULT_PORT = 7420
# Waking a thread that sleeps costs about 100 us on a VM whose idle vCPUs halt; a barrier
# arriving within this long after the previous frame finds its lane awake. One fsync-heavy
# writer through FUSE sends a barrier every 300-400 us here, so 200 us missed most of them:
# a 4 KiB write + fsync with 2 replicas measured 556-566 us p50 with 200, 385-402 with 1000
# (and 375 without replicas). A lane that stays idle stops polling after this long.
DEFAULT_SPIN_US = 1000


class StartError(TargetError):
    """The target cannot start as configured; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rpmemfs target",
        description="Serve pools under a directory to rpmemfs initiators (the replica-node daemon).",
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to listen on (port 0: any)")
    p.add_argument("--pool-dir", required=True, metavar="DIR", help="directory that holds the pools")
    p.add_argument("--pool-dev", action="append", metavar="NAME=DEV",
                   help="pool NAME lives on the device DAX DEV (/dev/daxX.Y), held for the target's "
                   "life; its records stay in --pool-dir (repeatable)")
    p.add_argument(
        "--token-file", metavar="F",
        help="the admin token initiators must hold, one a line (a rotation adds the new one beside "
        "the old; SIGHUP rereads it); default: one generated in the state directory",
    )
    p.add_argument(
        "--state-dir", metavar="DIR",
        help="where a target without --token-file keeps the token it generated (default: "
        f"${STATE_ENV}, else {ROOT_STATE_DIR} for root, $XDG_STATE_HOME/rpmemfs for a user)",
    )
    p.add_argument(
        "--authz", metavar="FILE",
        help="more tokens, each limited to some pools or admin: lines NAME ROLE TOKEN-FILE [PATTERN...]",
    )
    p.add_argument(
        "--persist", choices=("auto", "apm", "gpspm"), default="auto",
        help="persistence method to advertise; apm declares that placed writes are durable "
        "(DDIO off) and needs a pmem mapping; auto = gpspm",
    )
    p.add_argument("--pmem", choices=PMEM_MODES, default="auto", help="how pools are mapped (as for mount)")
    p.add_argument("--max-pool-size", default="1T", metavar="SIZE", help="largest pool one may create")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="authenticated connections at most (default 1024)")
    p.add_argument("--max-connections-per-token", type=int, default=DEFAULT_MAX_PER_TOKEN, metavar="N",
                   help="authenticated connections one pools token may hold, lanes included, unless its "
                   f"--authz line says connections=N (default {DEFAULT_MAX_PER_TOKEN}; admin tokens: no "
                   "cap of their own)")
    p.add_argument("--admin-reserve", type=int, metavar="N",
                   help="of --max-connections, how many only admin tokens may use (default "
                   f"{DEFAULT_ADMIN_RESERVE}, or half of --max-connections if that is less)")
    p.add_argument("--max-handshakes", type=int, default=DEFAULT_MAX_HANDSHAKES, metavar="N",
                   help="connections that have not authenticated yet, at most; over it the oldest "
                   f"handshake of the peer with the most is closed (default {DEFAULT_MAX_HANDSHAKES})")
    p.add_argument("--max-handshakes-per-peer", type=int, default=DEFAULT_MAX_HANDSHAKES_PER_PEER,
                   metavar="N", help="the same, per peer address; over it that peer's oldest is closed "
                   f"(default {DEFAULT_MAX_HANDSHAKES_PER_PEER})")
    p.add_argument("--handshake-timeout", type=float, default=MAX_HANDSHAKE_TIMEOUT, metavar="S",
                   help=f"to authenticate after connecting, at most {MAX_HANDSHAKE_TIMEOUT:g} s "
                   "(the default)")
    p.add_argument("--frame-timeout", type=float, default=30.0, metavar="S", help="to finish a started frame")
    p.add_argument(
        "--idle-timeout", type=float, default=0.0, metavar="S",
        help="close connections idle this long (default 0: never; TCP keepalive finds dead peers)",
    )
    p.add_argument(
        "--empty-session-timeout", type=float, default=DEFAULT_EMPTY_SESSION_TIMEOUT, metavar="S",
        help="close a control connection whose session has no pool open after S seconds without "
        f"a request (default {DEFAULT_EMPTY_SESSION_TIMEOUT:g}; 0: never); a mount's, which "
        "holds its pool, never",
    )
    p.add_argument(
        "--spin-us", type=int, default=DEFAULT_SPIN_US, metavar="US",
        help="after each frame a lane polls this long before it sleeps (0: sleep at once); "
        f"default {DEFAULT_SPIN_US}",
    )
    p.add_argument(
        "--wire-protection", choices=("aead", "none"), default="aead",
        help="aead (default): TCP traffic is encrypted and authenticated (docs/wire.md); none: "
        "plaintext, for a trusted link only, and only with initiators that ask for none too",
    )
    p.add_argument(
        "--rdma", choices=("auto", "off"), default="auto",
        help="auto: also serve verbs initiators (rdmacm on the same address and port) when an "
        "RDMA device has the listen address; off: TCP only",
    )
    p.add_argument("--metrics", metavar="[HOST:]PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: on "
                   "127.0.0.1); they name every pool, so see docs/operations.md before exposing them")
    p.add_argument("--metrics-cert", metavar="F", help="serve metrics over TLS with this certificate (PEM)")
    p.add_argument("--metrics-key", metavar="F", help="... and its private key (mode 0600)")
    p.add_argument("--metrics-client-ca", metavar="F",
                   help="... and serve only scrapers whose client certificate this CA signed")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _own_tokens(args: argparse.Namespace) -> list[bytes]:
    """The target's admin tokens: --token-file's, or the state directory's (one, unless a
    rotation added another beside it)."""
    if args.token_file:
        return read_tokens(args.token_file)
    tokens, path = generated_token(args.state_dir or default_state_dir())
    log.info("no --token-file: initiators must hold the token in %s (this user's mounts and rpmemfs "
             "commands on this host use it; give others a copy and --token-file)", path)
    return tokens


def configure(args: argparse.Namespace) -> tuple[TargetConfig, PoolStore]:
    try:
        host, port = parse_address(args.listen, DEFAULT_PORT)
        max_pool = parse_size(args.max_pool_size)
    except ValueError as exc:
        raise StartError(str(exc)) from None
    try:
        metrics = None if args.metrics is None else metrics_endpoint(
            args.metrics, args.metrics_cert, args.metrics_key, args.metrics_client_ca)
    except ValueError as exc:
        raise StartError(f"--metrics: {exc}") from None
    if metrics is None and (args.metrics_cert or args.metrics_key or args.metrics_client_ca):
        raise StartError("--metrics-cert, --metrics-key and --metrics-client-ca need --metrics")
    for name in ("frame_timeout", "handshake_timeout"):
        if getattr(args, name) <= 0:
            raise StartError(f"--{name.replace('_', '-')} must be positive")
    if args.handshake_timeout > MAX_HANDSHAKE_TIMEOUT:
        # Each open handshake holds a slot: a long deadline lets a slow flood hold them all.
        raise StartError(f"--handshake-timeout is at most {MAX_HANDSHAKE_TIMEOUT:g} seconds")
    for name in ("max_connections", "max_handshakes", "max_handshakes_per_peer",
                 "max_connections_per_token"):
        if getattr(args, name) < 1:
            raise StartError(f"--{name.replace('_', '-')} must be at least 1")
    reserve = _admin_reserve(args)
    _raise_descriptor_limit(args.max_connections + args.max_handshakes)
    if not 0 <= args.spin_us <= 1_000_000:
        raise StartError("--spin-us must be between 0 and 1000000")
    for name in ("idle_timeout", "empty_session_timeout"):
        if getattr(args, name) < 0:
            raise StartError(f"--{name.replace('_', '-')} must be 0 (never) or positive")
    pool_dir = os.path.realpath(args.pool_dir)
    def load_tokens() -> TokenBook:
        book = TokenBook()
        book.add(_own_tokens(args), Grant(DEFAULT_NAME, admin=True))
        if args.authz:
            read_authz(args.authz, book)
        return book

    try:
        check_pool_dir(pool_dir, args.pool_dir)
        book = load_tokens()
    except (TokenError, AuthzError, PoolDirError) as exc:
        raise StartError(str(exc)) from None
    try:
        pool_devs = [parse_pool_dev(text) for text in args.pool_dev or []]
        store = PoolStore(pool_dir, args.pmem, max_pool, pool_devs)
    except PoolDevError as exc:
        raise StartError(str(exc)) from None
    try:
        kind = store.probe_kind()
    except PoolError as exc:
        raise StartError(str(exc)) from None
    # Pools on device DAX are placed in persistent memory: auto declares so. Pools in the
    # directory must then map as persistent memory too, or are refused at open (saying so).
    method = ("apm" if pool_devs else "gpspm") if args.persist == "auto" else args.persist
    if method == "apm" and kind not in ("dax", "force") and not pool_devs:
        raise StartError(
            f"--persist apm declares that placed writes are persistent, but pools in {pool_dir} map "
            f"as {kind!r}, not persistent memory: use a DAX file system or --pmem force, or "
            "--persist gpspm"
        )
    config = TargetConfig(
        host=host, port=port, pool_dir=pool_dir, tokens=book, method=method, pmem_mode=args.pmem,
        pmem_kind=kind, max_pool_size=max_pool, max_connections=args.max_connections,
        handshake_timeout=args.handshake_timeout, frame_timeout=args.frame_timeout,
        idle_timeout=args.idle_timeout or math.inf, spin_us=args.spin_us,
        rdma=args.rdma == "auto", max_handshakes=args.max_handshakes,
        max_handshakes_per_peer=args.max_handshakes_per_peer, metrics=metrics,
        max_connections_per_token=args.max_connections_per_token, admin_reserve=reserve,
        empty_session_timeout=args.empty_session_timeout or math.inf,
        protect=args.wire_protection == "aead",
        load_tokens=load_tokens,
    )
    return config, store


def _admin_reserve(args: argparse.Namespace) -> int:
    total: int = args.max_connections
    if args.admin_reserve is None:
        return min(DEFAULT_ADMIN_RESERVE, total // 2)
    reserve: int = args.admin_reserve
    if not 0 <= reserve < total:
        raise StartError(f"--admin-reserve must be 0 or more and below --max-connections ({total}): "
                         "pools tokens would have no connection left")
    return reserve


# Descriptors besides connections: pools, owner records, the listener, logs, verbs.
SPARE_DESCRIPTORS = 256


def _raise_descriptor_limit(connections: int) -> None:
    """Up to the hard limit, so that the connection caps, not EMFILE, decide who is served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + SPARE_DESCRIPTORS
    if soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        raise StartError(f"the connection caps need {want} file descriptors but the hard limit is "
                         f"{hard}: lower --max-connections/--max-handshakes or raise the limit")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        config, store = configure(args)
    except StartError as exc:
        print(f"rpmemfs: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(serve, config, store)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise
    return 0
