"""Prometheus metrics of a real mount (-o metrics=) and a real target (--metrics): the
exposition passes `promtool check metrics`, says what happened (fsyncs, replica states, lag),
and a real Prometheus server with docs/monitoring/alerts.yml fires the replica alert when a
target dies. The alert rules and the dashboard in docs/ are checked too."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MountPool
from helpers import Mount, cli, wait_until, write_fsync
from prometheus_client.parser import text_string_to_metric_families

from rpmemfs.tools.processes import TargetProcess

DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(text: str, name: str, **labels: str) -> float:
    return _samples(text)[(name, frozenset(labels.items()))]


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: scripts/install.sh --test installs Debian's prometheus"
    return subprocess.run([tool, *args], input=stdin, capture_output=True, text=True, timeout=60)


@pytest.fixture
def watched(work_dir: Path, mount_pool: MountPool) -> Iterator[tuple[list[TargetProcess], list[int], Mount]]:
    """Two targets with metrics, and a pool replicated to both, mounted with metrics."""
    ports = [_free_port() for _ in range(3)]
    procs = []
    for i in range(2):
        d = work_dir / f"t{i}"
        d.mkdir()
        t = TargetProcess(d, pmem="force", extra=["--metrics", f"127.0.0.1:{ports[i]}"],
                          log_path=work_dir / f"t{i}.log")
        t.start()
        procs.append(t)
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", *(a for t in procs for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
    m = mount_pool(pool, options=f"pmem=force,min_replicas=1,replica_timeout=2,metrics=127.0.0.1:{ports[2]}")
    yield procs, ports, m
    for t in procs:
        t.close()


def test_mount_and_target_metrics_pass_promtool_and_say_what_happened(
        watched: tuple[list[TargetProcess], list[int], Mount]) -> None:
    targets, ports, m = watched
    mnt = m.path
    for i in range(10):
        write_fsync(mnt / f"f{i}", os.urandom(9000))
    text = _scrape(ports[2])
    res = _promtool("check", "metrics", stdin=text)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _value(text, "rpmemfs_up") == 1
    assert _value(text, "rpmemfs_fsync_seconds_count") >= 10
    assert _value(text, "rpmemfs_health") == 0
    assert _value(text, "rpmemfs_pool_used_bytes") >= 90000
    replicas = [f"{t.address}/app" for t in targets]
    for r in replicas:
        assert _value(text, "rpmemfs_replica_in_sync", replica=r) == 1
        assert _value(text, "rpmemfs_replica_state", replica=r, state="in-sync") == 1
        assert _value(text, "rpmemfs_replica_barriers_total", replica=r) >= 10
        assert _value(text, "rpmemfs_replica_barrier_seconds_count", replica=r) >= 10
        assert _value(text, "rpmemfs_replica_sent_bytes_total", replica=r) >= 90000
    for port in ports[:2]:
        ttext = _scrape(port)
        res = _promtool("check", "metrics", stdin=ttext)
        assert res.returncode == 0, res.stdout + res.stderr
        assert _value(ttext, "rpmemfs_target_sessions") == 1
        assert _value(ttext, "rpmemfs_target_written_bytes_total", pool="app") >= 90000
        assert _value(ttext, "rpmemfs_target_pool_unfinished_resync", pool="app") == 0
        # Every fsync's flush was written back by the target (in the lanes' C loops) and timed.
        assert _value(ttext, "rpmemfs_target_persist_seconds_count", pool="app") >= 10
        assert _value(ttext, "rpmemfs_target_persisted_bytes_total", pool="app") >= 90000
    # The same on the target's listing.
    listing = cli("pools", targets[0].address)
    assert listing.returncode == 0, listing.stderr
    header, row = listing.stdout.splitlines()[1], listing.stdout.splitlines()[2]
    assert "persisted" in header and "persist p99" in header, listing.stdout
    assert "<= " in row or "> " in row, listing.stdout

    targets[1].kill()
    write_fsync(mnt / "after", os.urandom(9000))
    text = _scrape(ports[2])
    assert _value(text, "rpmemfs_health") == 1
    assert _value(text, "rpmemfs_replica_in_sync", replica=replicas[1]) == 0
    assert _value(text, "rpmemfs_replica_state", replica=replicas[1], state="stale") == 1
    assert _value(text, "rpmemfs_replica_lag_bytes", replica=replicas[1]) > 0
    assert _value(text, "rpmemfs_replica_in_sync", replica=replicas[0]) == 1


def test_alert_rules_and_dashboard_are_valid() -> None:
    res = _promtool("check", "rules", str(DOCS / "alerts.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    dash = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all("rpmemfs_" in e for e in exprs)


def test_a_real_prometheus_fires_the_replica_alert_when_a_target_dies(
        work_dir: Path, watched: tuple[list[TargetProcess], list[int], Mount]) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is missing: scripts/install.sh --test installs Debian's prometheus"
    targets, ports, m = watched
    # The documented rule, with its minute shortened so the test need not wait one.
    rules = (DOCS / "alerts.yml").read_text().replace("for: 1m", "for: 2s", 1)
    (work_dir / "alerts.yml").write_text(rules)
    (work_dir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files: [alerts.yml]\n"
        f"scrape_configs:\n  - job_name: rpmemfs-mount\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{ports[2]}']\n"
        f"  - job_name: rpmemfs-target\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{ports[0]}', '127.0.0.1:{ports[1]}']\n")
    web = _free_port()
    log = open(work_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([prometheus, f"--config.file={work_dir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work_dir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=work_dir)

    def api(path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{web}{path}", timeout=5) as r:
            return json.loads(r.read())

    def up() -> int:
        try:
            return sum(1 for r in api("/api/v1/query?query=up")["data"]["result"] if r["value"][1] == "1")
        except OSError:
            return 0

    def firing() -> list[dict[str, str]]:
        """The labels of the alerts firing now."""
        try:
            alerts = api("/api/v1/alerts")["data"]["alerts"]
        except OSError:
            return []
        return [a["labels"] for a in alerts if a["state"] == "firing"]

    try:
        assert wait_until(lambda: up() >= 3, timeout=60), (work_dir / "prometheus.log").read_text()
        time.sleep(3)
        assert firing() == []  # all in sync: nothing fires
        targets[1].kill()
        write_fsync(m.path / "after", os.urandom(9000))
        wanted = {"alertname": "RpmemfsReplicaNotInSync", "replica": f"{targets[1].address}/app"}
        assert wait_until(lambda: any(wanted.items() <= a.items() for a in firing()), timeout=60), firing()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()

