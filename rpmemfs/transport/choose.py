"""Which transport reaches a replica: what its address says (``rdma://``, ``tcp://``), or for
a bare address verbs when this node has an RDMA device and TCP otherwise.

This is the edge where a transport is built, so it is where the verbs settings are read from
the environment (:meth:`VerbsSettings.from_env`) unless the caller passes them in. The wire
protection its connections ask for is always passed in (protection.py): it is the initiator's
configuration, never the environment's.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from rpmemfs.transport.base import DEFAULT_TIMEOUT, Session, Transport, TransportError
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION
from rpmemfs.transport.tcp import TcpTransport
from rpmemfs.transport.verbs_config import VerbsSettings, rdma_devices

__all__ = ["AutoTransport", "VerbsSettings", "rdma_devices", "transport_for", "verbs_transport"]

log = logging.getLogger("rpmemfs.transport")


def verbs_transport(settings: VerbsSettings, wire_protection: str = DEFAULT_PROTECTION) -> Transport:
    """The verbs transport; TransportError (not ImportError) where pyverbs is missing."""
    try:
        from rpmemfs.transport.verbs import VerbsTransport
    except ImportError as exc:
        raise TransportError("rdma", f"the verbs transport needs pyverbs (rdma-core): {exc}") from None
    return VerbsTransport(settings, wire_protection)


class AutoTransport:
    """Verbs when this node has an RDMA device and the target serves verbs, else TCP."""

    name = "auto"

    def __init__(self, settings: VerbsSettings, wire_protection: str = DEFAULT_PROTECTION) -> None:
        self.settings = settings
        self.wire_protection = wire_protection

    async def connect(
        self, address: str, token: bytes | None = None, *, lanes: int = 1, timeout: float = DEFAULT_TIMEOUT
    ) -> Session:
        if rdma_devices():
            try:
                verbs = verbs_transport(self.settings, self.wire_protection)
                return await verbs.connect(address, token, lanes=lanes, timeout=timeout)
            except TransportError as exc:
                # A refusal by a target that serves TCP only, or pyverbs missing here: TCP
                # reaches it too. A dead target fails the TCP attempt below the same way.
                log.info("%s: verbs not usable (%s); using TCP", address, exc.reason)
        return await TcpTransport(self.wire_protection).connect(address, token, lanes=lanes,
                                                                timeout=timeout)


def transport_for(kind: str, src: str | None = None, settings: VerbsSettings | None = None, *,
                  wire_protection: str = DEFAULT_PROTECTION) -> Transport:
    """The transport a replica address asks for: "tcp", "rdma" or "auto", its connections
    protected as ``wire_protection`` says. Verbs runs with ``settings``, else with those of the
    environment; its connections start from ``src``, else from $RPMEMFS_RDMA_SRC, else wherever
    the routing table says (which picks the device)."""
    if kind == "tcp":
        return TcpTransport(wire_protection)
    if kind not in ("rdma", "auto"):
        raise ValueError(f"unknown transport {kind!r}")
    if settings is None:
        settings = VerbsSettings.from_env(src)
    elif src:
        settings = replace(settings, src=src)
    if kind == "rdma":
        return verbs_transport(settings, wire_protection)
    return AutoTransport(settings, wire_protection)
