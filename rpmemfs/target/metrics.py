"""What a target exposes to Prometheus: its snapshot (sessions, connections, per-pool counters)
as metric families, served by rpmemfs/metrics.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rpmemfs.latency import Snapshot
from rpmemfs.metrics import add_histogram, histogram, serve_snapshots
from rpmemfs.metrics_endpoint import MetricsEndpoint


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
    persist = histogram("rpmemfs_target_persist_seconds", "flushes' write-backs to the persistence "
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
            add_histogram(persist, [name], Snapshot(tuple(buckets), (p.get("persist_ns") or 0) / 1e9,
                                                     int(p.get("persists") or 0)))
    yield from (*counters.values(), persist, size, open_, unfinished)


def serve_target_metrics(endpoint: MetricsEndpoint, snapshot: Callable[[], dict[str, Any]]
                          ) -> Callable[[], None]:
    """Serve the target's snapshots at ``endpoint`` as target_families() says (called from its trio
    thread); returns what stops it. OSError when it cannot."""
    return serve_snapshots(endpoint, snapshot, target_families)
