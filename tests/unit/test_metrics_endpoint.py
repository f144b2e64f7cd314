"""Where metrics are served and who may read them (issue 30, item 6): the options of a target
and a mount, checked without serving anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpmemfs.metrics_endpoint import MetricsEndpoint, metrics_endpoint
from rpmemfs.mountd.errors import MountError
from rpmemfs.mountd.options import parse_options


def test_a_port_alone_is_loopback_and_the_log_says_who_reads() -> None:
    for text in ("9742", ":9742"):
        assert metrics_endpoint(text) == MetricsEndpoint("127.0.0.1", 9742)
    assert metrics_endpoint("[::1]:9742").host == "::1"
    local = metrics_endpoint("9742")
    assert not local.open_to_all and "every local user (loopback only)" in local.readers()
    wide = metrics_endpoint("0.0.0.0:9742")
    assert wide.open_to_all and "anyone who can reach this address" in wide.readers()
    assert wide.url() == "http://0.0.0.0:9742/metrics"
    with pytest.raises(ValueError, match="port must be a number"):
        metrics_endpoint("99999")
    assert parse_options(["metrics=9743"]).metrics == MetricsEndpoint("127.0.0.1", 9743)
    assert parse_options([]).metrics is None


def test_tls_options_must_come_together_and_the_key_be_private(tmp_path: Path) -> None:
    key, cert = tmp_path / "k", tmp_path / "c"
    key.write_text("not a key")
    key.chmod(0o644)
    cert.write_text("not a certificate")
    with pytest.raises(ValueError, match="needs both the certificate and its key"):
        metrics_endpoint("9742", cert=str(cert))
    with pytest.raises(ValueError, match="over TLS only"):
        metrics_endpoint("9742", client_ca=str(cert))
    with pytest.raises(ValueError, match=f"TLS key file {key} has mode 0644"):
        metrics_endpoint("9742", str(cert), str(key))
    key.chmod(0o600)
    with pytest.raises(ValueError, match=f"cannot serve metrics over TLS \\(certificate {cert} with key"):
        metrics_endpoint("9742", str(cert), str(key))
    with pytest.raises(MountError, match="metrics_cert=, metrics_key= apply only with metrics="):
        parse_options([f"metrics_cert={cert},metrics_key={key}"])
    key.chmod(0o640)
    with pytest.raises(MountError, match="metrics=: TLS key file"):
        parse_options([f"metrics=9743,metrics_cert={cert},metrics_key={key}"])
