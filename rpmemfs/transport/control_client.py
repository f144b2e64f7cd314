"""The one client of the control operations (control_ops.py), over either transport.

A TCP session sends its control requests on its control connection, and so does a verbs
session: its control plane is that same TCP connection, with ``"rdma": true`` added to the
opens so that the target registers each pool for RDMA too. :class:`ControlClient` has one
method per declared op, named as the op, which builds the request from the declaration and
reads what the reply means (a region, checksums, counters); :class:`SessionControl` is the
pool half of the Session interface (base.Session) over it, which both sessions inherit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from rpmemfs.transport.base import METHODS, RemoteRegion, TransportError
from rpmemfs.transport.control_ops import ControlOp, build_request


class ControlChannel(Protocol):
    """Where control requests go (tcp.TcpLane: the control connection): one JSON request and
    its reply; a refusal raises TransportError and leaves the channel usable."""

    @property
    def peer(self) -> str: ...

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]: ...


class ControlClient:
    def __init__(self, channel: ControlChannel) -> None:
        self._channel = channel
        self.peer = channel.peer

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """A request as the caller wrote it: for callers that speak the protocol themselves."""
        return await self._channel.request(request)

    async def _call(self, op: ControlOp, **fields: Any) -> dict[str, Any]:
        return await self._channel.request(build_request(op, fields))

    async def create(self, name: str, size: int, *, rdma: bool = False) -> dict[str, Any]:
        """Create a zero-filled pool and register it; the reply describes the region."""
        return await self._call(ControlOp.CREATE, name=name, size=size, rdma=rdma or None)

    async def open(self, name: str, epoch: tuple[int, int] | None = None, *,
                   holder: Mapping[str, Any] | None = None, takeover: bool = False,
                   rdma: bool = False) -> dict[str, Any]:
        """Register a pool; with ``epoch``, claim it (base.Session.open_pool says how)."""
        claim = epoch is not None
        return await self._call(
            ControlOp.OPEN, name=name, epoch=list(epoch) if epoch is not None else None,
            holder=dict(holder) if claim and holder else None, takeover=True if claim and takeover else None,
            rdma=rdma or None,
        )

    async def probe(self, name: str) -> dict[str, Any]:
        return await self._call(ControlOp.PROBE, name=name)

    async def pools(self) -> dict[str, Any]:
        return await self._call(ControlOp.POOLS)

    async def evict(self, name: str) -> dict[str, Any]:
        return await self._call(ControlOp.EVICT, name=name)

    async def grow(self, name: str, size: int) -> dict[str, Any]:
        return await self._call(ControlOp.GROW, name=name, size=size)

    async def resync(self, key: int, active: bool) -> dict[str, Any]:
        return await self._call(ControlOp.RESYNC, key=key, active=active)

    async def close(self, key: int) -> dict[str, Any]:
        return await self._call(ControlOp.CLOSE, key=key)

    async def remove(self, name: str) -> dict[str, Any]:
        return await self._call(ControlOp.REMOVE, name=name)

    async def checksum(self, key: int, offset: int, length: int, chunk: int) -> list[int]:
        """CRC-32C of each ``chunk`` bytes of [offset, offset + length) of a registered pool."""
        reply = await self._call(ControlOp.CHECKSUM, key=key, offset=offset, length=length, chunk=chunk)
        crcs = reply.get("crcs")
        if not isinstance(crcs, list) or len(crcs) != -(-length // chunk):
            raise TransportError(self.peer, "target answered a checksum request with the wrong count")
        return [int(c) for c in crcs]

    async def stats(self, name: str | None = None) -> dict[str, Any]:
        """The target's counters per pool."""
        reply = await self._call(ControlOp.STATS, name=name)
        pools = reply.get("pools", {})
        return pools if isinstance(pools, dict) else {}

    async def info(self) -> dict[str, Any]:
        return await self._call(ControlOp.INFO)

    async def rdma(self) -> dict[str, Any]:
        """Enable verbs for the session (verbs.py); the reply says where its lanes connect."""
        return await self._call(ControlOp.RDMA)

    def region(self, reply: Mapping[str, Any]) -> RemoteRegion:
        """The registered pool a create or open reply describes."""
        method = reply.get("method")
        if method not in METHODS:
            raise TransportError(self.peer, f"target advertises persistence method {method!r}, unknown here")
        try:
            uuid = reply.get("uuid")
            return RemoteRegion(
                name=str(reply["name"]),
                key=int(reply["key"]),
                size=int(reply["size"]),
                uuid=bytes.fromhex(uuid) if uuid else None,
                method=method,
                pmem=str(reply.get("pmem", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(self.peer, f"target described the pool badly: {exc!r}") from None


class SessionControl:
    """The pool operations of base.Session over the session's :class:`ControlClient`, written
    once for both transports. A verbs session opens its pools for RDMA too (``rdma_pools``) and
    reads their registrations with what its lanes allow (``registered``)."""

    ops: ControlClient
    rdma_pools = False

    def registered(self, reply: dict[str, Any]) -> RemoteRegion:
        """The region a create or open reply describes, as this session's barriers use it."""
        return self.ops.region(reply)

    async def create_pool(self, name: str, size: int) -> RemoteRegion:
        return self.registered(await self.ops.create(name, size, rdma=self.rdma_pools))

    async def open_pool(self, name: str, epoch: tuple[int, int] | None = None, *,
                        holder: Mapping[str, Any] | None = None, takeover: bool = False) -> RemoteRegion:
        return self.registered(await self.ops.open(name, epoch, holder=holder, takeover=takeover,
                                                   rdma=self.rdma_pools))

    async def probe_pool(self, name: str) -> dict[str, Any]:
        return await self.ops.probe(name)

    async def mark_resync(self, region: RemoteRegion, active: bool) -> None:
        await self.ops.resync(region.key, active)

    async def grow_pool(self, name: str, size: int) -> None:
        await self.ops.grow(name, size)

    async def close_pool(self, region: RemoteRegion) -> None:
        await self.ops.close(region.key)

    async def remove_pool(self, name: str) -> None:
        await self.ops.remove(name)

    async def checksum(self, region: RemoteRegion, offset: int, length: int, chunk: int) -> list[int]:
        return await self.ops.checksum(region.key, offset, length, chunk)

    async def stats(self, name: str | None = None) -> dict[str, Any]:
        return await self.ops.stats(name)

    async def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """One control request as the caller wrote it, and its reply."""
        return await self.ops.request(request)
