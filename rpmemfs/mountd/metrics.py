"""What a mount exposes to Prometheus: its status snapshot as metric families, served by
rpmemfs/metrics.py. Beside the status document's other readings (mountd/status.py: the health
and the table), so that the health a monitor scrapes is the one `rpmemfs status` says.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from rpmemfs.metrics import add_histogram, histogram, serve_snapshots
from rpmemfs.metrics_endpoint import MetricsEndpoint
from rpmemfs.mountd.status import health as mount_health
from rpmemfs.transport.base import FLUSHES

REPLICA_STATES = ("connecting", "in-sync", "stale", "resyncing")


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
    fsyncs = histogram("rpmemfs_fsync_seconds", "durability points (fsync, fdatasync, msync, "
                       "periodic commit), from call to return", [])
    add_histogram(fsyncs, [], st["fsync_histogram"])
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
    latency = histogram("rpmemfs_replica_barrier_seconds", "barriers, from post to the replica's "
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
            add_histogram(latency, v, hist)
    yield from (state, flush, in_sync, lag, lag_s, behind, sent, barriers, resyncs, progress, latency)


def serve_mount_metrics(endpoint: MetricsEndpoint, snapshot: Callable[[], dict[str, Any]]
                         ) -> Callable[[], None]:
    """Serve the mount's snapshots at ``endpoint`` as mount_families() says (called from its trio
    thread); returns what stops it. OSError when it cannot."""
    return serve_snapshots(endpoint, snapshot, mount_families)
