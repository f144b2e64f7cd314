"""Where a daemon serves its Prometheus metrics (a target's ``--metrics``, a mount's
``-o metrics=``), and who may read them.

A target's metrics name every pool it holds, with its size and counters; a mount's name its
pool file, mount point and epoch. The wire protocol shows a restricted token its own pools
only, so the metrics must not be what tells a tenant about the others: a port given alone is
served on the loopback address, and the start-up log says who may read what is served. Where
they must reach further, TLS with client certificates decides who reads: the daemon's
certificate and key, and the CA whose certificate a scraper must show. (prometheus_client has
no basic authentication for its server; a client certificate is the stronger of the two
anyway.) The key is a secret, checked as a token file is.

Kept apart from metrics.py so that checking the options costs no import of prometheus_client.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass

from rpmemfs.transport.address import format_address, parse_address
from rpmemfs.transport.tokens import TokenError, read_owned

LOOPBACK = "127.0.0.1"
MAX_KEY_FILE = 1 << 20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


@dataclass(frozen=True)
class MetricsEndpoint:
    host: str
    port: int
    cert: str | None = None  # the daemon's certificate (PEM): serve over TLS
    key: str | None = None  # its private key
    client_ca: str | None = None  # scrapers must show a certificate this CA signed

    def url(self, port: int | None = None) -> str:
        scheme = "https" if self.cert else "http"
        return f"{scheme}://{format_address(self.host, self.port if port is None else port)}/metrics"

    @property
    def open_to_all(self) -> bool:
        """Whether anyone who can reach it from another host may read it."""
        return not self.client_ca and not is_loopback(self.host)

    def readers(self) -> str:
        """Who may read the metrics, for the start-up log."""
        if self.client_ca:
            return f"TLS, read only by scrapers with a certificate from the CA in {self.client_ca}"
        who = ("every local user (loopback only)" if is_loopback(self.host)
               else "anyone who can reach this address")
        return (f"{'TLS without client certificates: ' if self.cert else ''}readable by {who}, "
                "with every pool's name and counters; a client CA chooses who reads "
                "(docs/operations.md, Prometheus)")

    def tls_context(self) -> ssl.SSLContext | None:
        """The server side's TLS context, or None for plain HTTP; ValueError when the
        certificate, key or CA cannot be used."""
        if self.cert is None or self.key is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(cafile=self.client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            what = f"certificate {self.cert} with key {self.key}"
            if self.client_ca:
                what += f", client CA {self.client_ca}"
            raise ValueError(f"cannot serve metrics over TLS ({what}): "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        return ctx


def metrics_endpoint(address: str, cert: str | None = None, key: str | None = None,
                     client_ca: str | None = None) -> MetricsEndpoint:
    """Where and how to serve metrics: ``HOST:PORT``, or ``PORT`` alone (loopback), with TLS
    when ``cert`` and ``key`` are given; ValueError saying what is wrong."""
    text = address.strip()
    if text.removeprefix(":").isdigit():
        port = int(text.removeprefix(":"))
        if port > 65535:
            raise ValueError(f"bad address {text!r}: port must be a number from 0 to 65535")
        host = LOOPBACK
    else:
        host, port = parse_address(text, 0)
    if (cert is None) != (key is None):
        raise ValueError("TLS for metrics needs both the certificate and its key")
    if client_ca is not None and cert is None:
        raise ValueError("client certificates are asked for over TLS only: give the daemon's "
                         "certificate and key too")
    if key is not None:
        try:
            read_owned(key, "TLS key file", MAX_KEY_FILE)
        except TokenError as exc:
            raise ValueError(exc.reason) from None
    endpoint = MetricsEndpoint(host, port, cert, key, client_ca)
    endpoint.tls_context()  # refused now, with the reason, rather than when serving
    return endpoint
