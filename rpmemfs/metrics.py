"""Serving Prometheus metrics at /metrics, for a mount (`-o metrics=HOST:PORT`) and for a target
(`--metrics HOST:PORT`); where, and who may read them: metrics_endpoint.py. What each daemon
exposes is its own: mountd/metrics.py and target/metrics.py turn its snapshot into metric
families, with the histogram helpers here.

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
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import trio
from prometheus_client.core import (
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from rpmemfs.latency import BOUNDS_S, Snapshot
from rpmemfs.metrics_endpoint import MetricsEndpoint

log = logging.getLogger("rpmemfs.metrics")

SNAPSHOT_TIMEOUT = 5.0  # a scrape waits this long for a daemon's loop, then reports it down
# A scraper gets this long for its TLS handshake and its request: one that stalls frees its
# thread then.
REQUEST_TIMEOUT = 10.0


def histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def add_histogram(family: HistogramMetricFamily, values: list[str], snap: Snapshot) -> None:
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
