"""Which transport reaches a replica: what its address says (``rdma://``, ``tcp://``), or for
a bare address verbs when this node has an RDMA device and TCP otherwise."""

from __future__ import annotations

import logging
import os

from rpmemfs.transport.base import DEFAULT_TIMEOUT, Session, Transport, TransportError
from rpmemfs.transport.tcp import TcpTransport

log = logging.getLogger("rpmemfs.transport")


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel shows, read without loading pyverbs."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def verbs_transport(src: str | None = None) -> Transport:
    """The verbs transport; TransportError (not ImportError) where pyverbs is missing."""
    try:
        from rpmemfs.transport.verbs import VerbsTransport
    except ImportError as exc:
        raise TransportError("rdma", f"the verbs transport needs pyverbs (rdma-core): {exc}") from None
    return VerbsTransport(src)


class AutoTransport:
    """Verbs when this node has an RDMA device and the target serves verbs, else TCP."""

    name = "auto"

    def __init__(self, src: str | None = None) -> None:
        self.src = src

    async def connect(
        self, address: str, token: bytes | None = None, *, lanes: int = 1, timeout: float = DEFAULT_TIMEOUT
    ) -> Session:
        if rdma_devices():
            try:
                return await verbs_transport(self.src).connect(address, token, lanes=lanes, timeout=timeout)
            except TransportError as exc:
                # A refusal by a target that serves TCP only, or pyverbs missing here: TCP
                # reaches it too. A dead target fails the TCP attempt below the same way.
                log.info("%s: verbs not usable (%s); using TCP", address, exc.reason)
        return await TcpTransport().connect(address, token, lanes=lanes, timeout=timeout)


def transport_for(kind: str, src: str | None = None) -> Transport:
    """The transport a replica address asks for: "tcp", "rdma" or "auto". Verbs connections
    start from ``src``, else from $RPMEMFS_RDMA_SRC, else wherever the routing table says
    (which picks the device)."""
    src = src or os.environ.get("RPMEMFS_RDMA_SRC") or None
    if kind == "tcp":
        return TcpTransport()
    if kind == "rdma":
        return verbs_transport(src)
    if kind == "auto":
        return AutoTransport(src)
    raise ValueError(f"unknown transport {kind!r}")
