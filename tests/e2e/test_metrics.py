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

from rpmemfs.tools.processes import SpawnError, TargetProcess

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



# ------------------------------------------------------------ who may read them (issue 30, item 6)


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, _, hex_port = fields[1].rpartition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(host)
    return found


LOOPBACK_HEX = "0100007F"  # 127.0.0.1, as /proc/net/tcp writes it


def test_metrics_given_a_port_alone_are_served_on_loopback_only(work_dir: Path,
                                                                mount_pool: MountPool) -> None:
    """Metrics name every tenant's pools; a port given alone (`--metrics 9742`, `metrics=9743`)
    serves them on 127.0.0.1, and the daemons say who may read them."""
    ports = [_free_port() for _ in range(2)]
    (work_dir / "t").mkdir()
    t = TargetProcess(work_dir / "t", pmem="force", extra=["--metrics", str(ports[0])])
    t.start()
    try:
        pool = work_dir / "app.pool"
        res = cli("mkfs", pool, "--size", "64M", "--replica", f"{t.address}/app")
        assert res.returncode == 0, res.stderr
        m = mount_pool(pool, options=f"pmem=force,log_level=info,metrics={ports[1]}")
        for port in ports:
            assert _listening(port) == {LOOPBACK_HEX}, (port, _listening(port))
        assert _value(_scrape(ports[0]), "rpmemfs_target_pool_open", pool="app") == 1
        assert _value(_scrape(ports[1]), "rpmemfs_up") == 1
        said = (f"metrics at http://127.0.0.1:{ports[0]}/metrics: readable by every local user "
                "(loopback only)")
        assert said in t.log_text(), t.log_text()
        assert f"metrics at http://127.0.0.1:{ports[1]}/metrics: readable by every local user" in m.output()
    finally:
        t.close()


def _pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed, and a
    client certificate of another CA; keys mode 0600."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    out: dict[str, Path] = {}

    def write(name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        out[f"{name}.crt"] = d / f"{name}.crt"
        out[f"{name}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}.key"] = d / f"{name}.key"
        out[f"{name}.key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
        out[f"{name}.key"].chmod(0o600)

    def cert(name: str, key: ec.EllipticCurvePrivateKey,
             issuer: tuple[str, ec.EllipticCurvePrivateKey] | None, ca: bool = False,
             ip: str | None = None) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        by = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer[0])]) if issuer else subject
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(by)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ip:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                                critical=False)
        return b.sign(issuer[1] if issuer else key, hashes.SHA256())

    for ca_name, others in (("ca", ("server", "client")), ("other-ca", ("stranger",))):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        write(ca_name, ca_key, cert(ca_name, ca_key, None, ca=True))
        for name in others:
            key = ec.generate_private_key(ec.SECP256R1())
            write(name, key, cert(name, key, (ca_name, ca_key), ip="127.0.0.1" if name == "server" else None))
    return out


def _scrape_tls(port: int, pki: dict[str, Path], client: str | None = "client") -> str:
    import ssl

    ctx = ssl.create_default_context(cafile=str(pki["ca.crt"]))
    if client:
        ctx.load_cert_chain(pki[f"{client}.crt"], pki[f"{client}.key"])
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=10) as r:
        return str(r.read().decode())


def test_metrics_over_tls_are_read_only_with_a_client_certificate(work_dir: Path,
                                                                  mount_pool: MountPool) -> None:
    """Where metrics must reach further than loopback, TLS with a client CA decides who reads
    them: without a certificate of that CA, nothing; a connection that never says anything
    holds up no scrape; a real Prometheus with its certificate scrapes both daemons."""
    import http.client

    pki = _pki(work_dir)
    tls = ["--metrics-cert", str(pki["server.crt"]), "--metrics-key", str(pki["server.key"]),
           "--metrics-client-ca", str(pki["ca.crt"])]
    ports = [_free_port() for _ in range(2)]
    (work_dir / "t").mkdir()
    # The key is a secret: one others may read is refused, as a token file is.
    pki["server.key"].chmod(0o644)
    t = TargetProcess(work_dir / "t", pmem="force", extra=["--metrics", f"127.0.0.1:{ports[0]}", *tls])
    with pytest.raises(SpawnError, match=f"TLS key file {pki['server.key']} has mode 0644"):
        t.start()
    t.close()
    pki["server.key"].chmod(0o600)
    t = TargetProcess(work_dir / "t", pmem="force", extra=["--metrics", f"127.0.0.1:{ports[0]}", *tls])
    t.start()
    proc = None
    try:
        pool = work_dir / "app.pool"
        res = cli("mkfs", pool, "--size", "64M", "--replica", f"{t.address}/app")
        assert res.returncode == 0, res.stderr
        mount_pool(pool, options=f"pmem=force,metrics={ports[1]},metrics_cert={pki['server.crt']},"
                   f"metrics_key={pki['server.key']},metrics_client_ca={pki['ca.crt']}")
        assert (f"metrics at https://127.0.0.1:{ports[0]}/metrics: TLS, read only by scrapers with a "
                f"certificate from the CA in {pki['ca.crt']}") in t.log_text(), t.log_text()
        for port in ports:
            with pytest.raises((OSError, http.client.HTTPException)):
                _scrape(port)  # plain HTTP
            with pytest.raises(OSError):
                _scrape_tls(port, pki, None)
            with pytest.raises(OSError):
                _scrape_tls(port, pki, "stranger")
            # Someone who connects and says nothing: the others are served meanwhile.
            with socket.create_connection(("127.0.0.1", port)):
                text = _scrape_tls(port, pki)
            assert _value(text, "rpmemfs_up") == 1
        assert _value(_scrape_tls(ports[0], pki), "rpmemfs_target_pool_open", pool="app") == 1
        assert "metrics: request from 127.0.0.1 refused" in t.log_text()  # one line each
        assert "Traceback" not in t.log_text()

        prometheus = shutil.which("prometheus")
        assert prometheus, "prometheus is missing: scripts/install.sh --test installs Debian's prometheus"
        (work_dir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n  - job_name: rpmemfs\n    scheme: https\n"
            f"    tls_config:\n      ca_file: {pki['ca.crt']}\n      cert_file: {pki['client.crt']}\n"
            f"      key_file: {pki['client.key']}\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{ports[0]}', '127.0.0.1:{ports[1]}']\n")
        web = _free_port()
        log = open(work_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([prometheus, f"--config.file={work_dir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work_dir / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=work_dir)

        def up() -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/query?query=up", timeout=5) as r:
                    result = json.loads(r.read())["data"]["result"]
            except OSError:
                return 0
            return sum(1 for s in result if s["value"][1] == "1")

        assert wait_until(lambda: up() == 2, timeout=60), (work_dir / "prometheus.log").read_text()
        log.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        t.close()


def test_status_and_metrics_say_which_flush_each_replicas_barriers_end_with(
        work_dir: Path, targets: list[TargetProcess], mount_pool: MountPool) -> None:
    """Over tcp:// a barrier to an appliance-method target ends with its 8-byte READ, one to a
    general-purpose target with the SEND of its ranges: status --json and the metrics say so
    per replica, beside the method each target declared."""
    pool = work_dir / "app.pool"
    res = cli("mkfs", pool, "--size", "64M", *(a for t in targets for a in ("--replica", f"{t.address}/app")))
    assert res.returncode == 0, res.stderr
    port = _free_port()
    m = mount_pool(pool, options=f"pmem=force,metrics=127.0.0.1:{port}")
    write_fsync(m.path / "f", os.urandom(5000))
    res = cli("status", m.path, "--json")
    assert res.returncode == 0, res.stderr
    reps = json.loads(res.stdout)["replicas"]
    got = {r["address"]: (r["transport"], r["method"], r["flush"]) for r in reps}
    apm, gpspm = (t.address for t in targets)  # conftest: the first declares apm
    assert got == {apm: ("tcp", "apm", "read"), gpspm: ("tcp", "gpspm", "send")}, got
    text = _scrape(port)
    for address, flush in ((apm, "read"), (gpspm, "send")):
        for kind in ("persistent", "visibility", "read", "send"):
            want = 1 if kind == flush else 0
            assert _value(text, "rpmemfs_replica_flush", replica=f"{address}/app", flush=kind) == want
