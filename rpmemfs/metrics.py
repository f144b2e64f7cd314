"""Prometheus metrics of a mount (`-o metrics=HOST:PORT`) and of a target (`--metrics
HOST:PORT`), served at /metrics; where, and who may read them: metrics_endpoint.py.

The server runs in a thread of its own; the daemons keep their state on their trio thread
without locks. So each scrape asks the trio thread for a snapshot (a plain dict, made there
in one go) and turns it into metric families here: a scrape never sees half an update, and
the fsync path pays nothing for it (its histograms are the daemon's own, latency.py).

The HTTP server is prometheus_client's WSGI app in the standard library's threading server,
as prometheus_client's start_http_server builds it, but for TLS: that one does the handshake
in the thread that accepts, so one connection that never says anything stops every scrape.
Here each connection's handshake happens in its own request thread, under a deadline.
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import trio
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from rpmemfs.latency import BOUNDS_S, Snapshot
from rpmemfs.metrics_endpoint import MetricsEndpoint
from rpmemfs.mountd.status import health as mount_health
from rpmemfs.transport.base import FLUSHES

log = logging.getLogger("rpmemfs.metrics")

REPLICA_STATES = ("connecting", "in-sync", "stale", "resyncing")
SNAPSHOT_TIMEOUT = 5.0  # a scrape waits this long for a daemon's loop, then reports it down
# A scraper gets this long for its TLS handshake and its request: one that stalls frees its
# thread then.
REQUEST_TIMEOUT = 10.0


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _add_histogram(family: HistogramMetricFamily, values: list[str], snap: Snapshot) -> None:
    buckets = [(f"{b:g}", float(c)) for b, c in zip(BOUNDS_S, snap.buckets, strict=False)]
    buckets.append(("+Inf", float(snap.buckets[-1])))
    family.add_metric(values, buckets, snap.sum_s)


class SnapshotCollector(Collector):
    """Turns a daemon's snapshot into metric families, at each scrape."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], token: trio.lowlevel.TrioToken,
                 families: Callable[[dict[str, Any]], Iterator[Metric]]) -> None:
        self._snapshot = snapshot
        self._token = token
        self._families = families

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("rpmemfs_up", "1 when the daemon answered this scrape")
        try:
            snap = _ask(self._snapshot, self._token)
        except Exception as exc:  # a daemon stuck or ending: say so, never fail the scrape
            log.warning("metrics: no snapshot from the daemon: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._families(snap)


def _ask(fn: Callable[[], dict[str, Any]], token: trio.lowlevel.TrioToken) -> dict[str, Any]:
    async def bounded() -> dict[str, Any]:
        with trio.fail_after(SNAPSHOT_TIMEOUT):
            return fn()

    return trio.from_thread.run(bounded, trio_token=token)


def mount_families(st: dict[str, Any]) -> Iterator[Metric]:
    """What a mount exposes, from Mounted.metrics_snapshot()."""
    info = InfoMetricFamily("rpmemfs_mount", "the mount: pool, mount point, pmem mode, epoch")
    info.add_metric([], {"pool": str(st["pool"]), "mountpoint": str(st["mountpoint"]),
                         "pmem": str(st["pmem_mode"]), "epoch": str(st["epoch"])})
    yield info
    for name, doc, key in (
        ("rpmemfs_pool_size_bytes", "pool file size", "size"),
        ("rpmemfs_pool_data_bytes", "bytes the pool holds for file data", "data_size"),
        ("rpmemfs_pool_used_bytes", "bytes of file data in use", "used"),
        ("rpmemfs_inodes", "files, directories and links", "inodes"),
        ("rpmemfs_min_replicas", "replicas in sync that fsync requires", "min_replicas"),
        ("rpmemfs_start_time_seconds", "when the mount started (unix time)", "started"),
        ("rpmemfs_oldest_barrier_seconds", "how long the oldest barrier still waiting for replicas "
         "has waited (a replica that stops answering shows here before replica_timeout)",
         "oldest_barrier_s"),
    ):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(st.get(key) or 0))
        yield g
    health = GaugeMetricFamily("rpmemfs_health", "0 healthy, 1 degraded (not every replica in sync), "
                               "2 failing (fsync returns EIO)")
    health.add_metric([], float(mount_health(st)[0]))
    yield health
    fenced = GaugeMetricFamily("rpmemfs_fenced", "1 when another primary took the replicas over")
    fenced.add_metric([], 1.0 if st.get("fenced") else 0.0)
    yield fenced
    fsyncs = _histogram("rpmemfs_fsync_seconds", "durability points (fsync, fdatasync, msync, "
                        "periodic commit), from call to return", [])
    _add_histogram(fsyncs, [], st["fsync_histogram"])
    yield fsyncs

    replicas: list[dict[str, Any]] = st.get("replicas") or []
    now = time.time()
    labels = ["replica"]
    state = GaugeMetricFamily("rpmemfs_replica_state", "1 for the replica's current state",
                              labels=["replica", "state"])
    flush = GaugeMetricFamily("rpmemfs_replica_flush", "1 for the flush the replica's barriers end "
                              "with (a native RDMA FLUSH of the persistent or the global-visibility "
                              "type, the appliance READ, the general-purpose SEND)",
                              labels=["replica", "flush"])
    in_sync = GaugeMetricFamily("rpmemfs_replica_in_sync", "1 when the replica takes every barrier",
                                labels=labels)
    lag = GaugeMetricFamily("rpmemfs_replica_lag_bytes", "bytes the replica misses (NaN: unknown "
                            "until it is compared in full)", labels=labels)
    lag_s = GaugeMetricFamily("rpmemfs_replica_lag_seconds", "replication=async: the age of the "
                              "oldest point the replica has not acknowledged (0: it holds them all; "
                              "out of sync: how long it has been)", labels=labels)
    behind = GaugeMetricFamily("rpmemfs_replica_behind_seconds", "how long the replica has been out "
                               "of sync (0 in sync)", labels=labels)
    sent = CounterMetricFamily("rpmemfs_replica_sent_bytes", "bytes replicated by barriers",
                               labels=labels)
    barriers = CounterMetricFamily("rpmemfs_replica_barriers", "barriers acknowledged", labels=labels)
    resyncs = CounterMetricFamily("rpmemfs_replica_resyncs", "resyncs started", labels=labels)
    progress = GaugeMetricFamily("rpmemfs_replica_resync_progress_ratio", "how far the resync under "
                                 "way is (0 to 1; 1 when none runs)", labels=labels)
    latency = _histogram("rpmemfs_replica_barrier_seconds", "barriers, from post to the replica's "
                         "acknowledgement", labels)
    for r in replicas:
        v = [f"{r['address']}/{r['name']}"]
        for s in REPLICA_STATES:
            state.add_metric([v[0], s], 1.0 if r.get("state") == s else 0.0)
        for f in FLUSHES:
            flush.add_metric([v[0], f], 1.0 if r.get("flush") == f else 0.0)
        in_sync.add_metric(v, 1.0 if r.get("state") == "in-sync" else 0.0)
        lb = r.get("lag_bytes")
        lag.add_metric(v, float(lb) if isinstance(lb, int) else math.nan)
        lag_s.add_metric(v, float(r.get("lag_seconds") or 0))
        since = r.get("behind_since")
        behind.add_metric(v, max(0.0, now - since) if isinstance(since, (int, float)) else 0.0)
        sent.add_metric(v, float(r.get("bytes") or 0))
        barriers.add_metric(v, float(r.get("barriers") or 0))
        resyncs.add_metric(v, float(r.get("resyncs") or 0))
        p = r.get("resync")
        progress.add_metric(v, p["done"] / p["total"] if isinstance(p, dict) and p.get("total") else 1.0)
        hist = st["replica_histograms"].get(v[0])
        if hist is not None:
            _add_histogram(latency, v, hist)
    yield from (state, flush, in_sync, lag, lag_s, behind, sent, barriers, resyncs, progress, latency)


def target_families(st: dict[str, Any]) -> Iterator[Metric]:
    """What a target exposes, from Server.metrics_snapshot()."""
    for name, doc, key in (
        ("rpmemfs_target_sessions", "sessions open", "sessions"),
        ("rpmemfs_target_connections", "authenticated connections open", "connections"),
        ("rpmemfs_target_handshakes", "connections that have not authenticated yet", "handshakes"),
    ):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(st[key]))
        yield g
    dropped = CounterMetricFamily("rpmemfs_target_handshakes_dropped", "handshakes closed to keep "
                                  "unauthenticated connections under their caps")
    dropped.add_metric([], float(st["handshakes_dropped"]))
    yield dropped
    failed = CounterMetricFamily("rpmemfs_target_failed_proofs", "handshakes refused for a wrong or "
                                 "unknown token (each answered after a per-address delay)")
    failed.add_metric([], float(st.get("failed_proofs", 0)))
    yield failed
    labels = ["pool"]
    counters = {
        "writes": CounterMetricFamily("rpmemfs_target_writes", "WRITE operations placed", labels=labels),
        "bytes": CounterMetricFamily("rpmemfs_target_written_bytes", "bytes placed by writes",
                                     labels=labels),
        "flushes": CounterMetricFamily("rpmemfs_target_flushes", "flushes served", labels=labels),
        "persisted_ranges": CounterMetricFamily("rpmemfs_target_persisted_ranges",
                                                "ranges made persistent", labels=labels),
        "reads": CounterMetricFamily("rpmemfs_target_reads", "READ operations served", labels=labels),
        "persisted_bytes": CounterMetricFamily("rpmemfs_target_persisted_bytes",
                                               "bytes made persistent by flushes", labels=labels),
    }
    persist = _histogram("rpmemfs_target_persist_seconds", "flushes' write-backs to the persistence "
                         "domain (general-purpose method)", labels)
    size = GaugeMetricFamily("rpmemfs_target_pool_size_bytes", "pool file size", labels=labels)
    open_ = GaugeMetricFamily("rpmemfs_target_pool_open", "sessions that have the pool open",
                              labels=labels)
    unfinished = GaugeMetricFamily("rpmemfs_target_pool_unfinished_resync", "1 when a resync of the "
                                   "pool began and did not end (not a consistent copy)", labels=labels)
    for name, p in sorted(st["pools"].items()):
        for key, family in counters.items():
            family.add_metric([name], float(p.get(key) or 0))
        size.add_metric([name], float(p.get("size") or 0))
        open_.add_metric([name], float(p.get("open") or 0))
        owner = p.get("owner") or {}
        unfinished.add_metric([name], 1.0 if owner.get("resync") else 0.0)
        buckets = p.get("persist_buckets")
        if buckets:
            _add_histogram(persist, [name], Snapshot(tuple(buckets), (p.get("persist_ns") or 0) / 1e9,
                                                     int(p.get("persists") or 0)))
    yield from (*counters.values(), persist, size, open_, unfinished)


def serve_snapshots(endpoint: MetricsEndpoint, snapshot: Callable[[], dict[str, Any]],
                    families: Callable[[dict[str, Any]], Iterator[Metric]]) -> Callable[[], None]:
    """Serve the families of a daemon's snapshots (called from its trio thread)."""
    return serve(endpoint, SnapshotCollector(snapshot, trio.lowlevel.current_trio_token(), families))


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT

    def setup(self) -> None:
        super().setup()  # (the deadline)
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a line per scrape is noise


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, family: socket.AddressFamily, address: tuple[str, int]) -> None:
        self.address_family = family
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper refused (no certificate, a wrong one, too slow): one line, no traceback.
        log.info("metrics: request from %s refused: %s", client_address[0], sys.exc_info()[1])


def serve(endpoint: MetricsEndpoint, collector: Collector) -> Callable[[], None]:
    """Serve /metrics at ``endpoint`` in a thread; returns what stops it. OSError (ssl.SSLError
    among them) when it cannot."""
    from prometheus_client import make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    family = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    server = _Server(family, (endpoint.host, endpoint.port))
    try:
        server.set_app(make_wsgi_app(registry))
        ctx = endpoint.tls_context()
        if ctx is not None:
            server.socket = ctx.wrap_socket(server.socket, server_side=True,
                                            do_handshake_on_connect=False)
    except ValueError as exc:  # its files changed since the options were checked
        server.server_close()
        raise OSError(str(exc)) from None
    except BaseException:
        server.server_close()
        raise
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    url = endpoint.url(server.server_port)
    if endpoint.open_to_all:
        log.warning("metrics at %s: %s", url, endpoint.readers())
    else:
        log.info("metrics at %s: %s", url, endpoint.readers())

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
