"""Making a pool together with its replicas (what `rpmemfs mkfs --replica` does)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from rpmemfs.fs.mkfs import mkfs
from rpmemfs.mountd.errors import ProvisionError
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.layout import Header
from rpmemfs.replica.remote import create_remote, metadata_ranges
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import write_table
from rpmemfs.transport.base import DEFAULT_TIMEOUT


def record_replicas(path: str, specs: list[ReplicaSpec], token_file: str | None) -> None:
    """Write the replica list into the (fresh, local) pool so mount finds the replicas."""
    with PoolMapping.open(path, "msync") as pm:
        pm.persist(write_table(pm.buf, specs, token_file))


def create_replicas(path: str, size: int, specs: list[ReplicaSpec], token: bytes | None,
                    timeout: float = DEFAULT_TIMEOUT) -> None:
    """Create one pool per replica, in parallel, holding the new local pool's contents."""
    errors: list[str] = []
    with PoolMapping.open(path, "msync", readonly=True) as pm:
        ranges = metadata_ranges(pm.buf)

        async def one(spec: ReplicaSpec) -> None:
            try:
                await create_remote(spec, size, pm.buf, ranges, token=token, timeout=timeout)
            except Exception as e:  # each replica's failure is reported, none hides another
                errors.append(f"replica {spec}: {e}")

        async def all_() -> None:
            async with trio.open_nursery() as nursery:
                for spec in specs:
                    nursery.start_soon(one, spec)

        trio.run(all_)
    if errors:
        raise ProvisionError("; ".join(errors))


def create_pool(path: str, size: int, specs: list[ReplicaSpec], *, token: bytes | None = None,
                token_file: str | None = None, force: bool = False,
                progress: Callable[[int, int], None] | None = None) -> Header:
    """mkfs the local pool, record its replicas in it, and create them on their targets.

    MkfsError when the local pool cannot be made; ProvisionError when it was made but some
    replica could not be.
    """
    hdr = mkfs(path, size, force=force, progress=progress)
    if specs:
        record_replicas(path, specs, token_file)
        create_replicas(path, size, specs, token)
    return hdr
