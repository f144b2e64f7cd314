"""Making a pool together with its replicas (what `rpmemfs mkfs --replica` does)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from rpmemfs.fs.mkfs import mkfs, remove_pool
from rpmemfs.mountd.errors import ProvisionError
from rpmemfs.pmem import PoolMapping
from rpmemfs.pool.layout import Header
from rpmemfs.replica.remote import create_remote, metadata_ranges
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import write_table
from rpmemfs.transport.base import DEFAULT_TIMEOUT
from rpmemfs.transport.choose import transport_for
from rpmemfs.transport.protection import DEFAULT as DEFAULT_PROTECTION


def record_replicas(path: str, specs: list[ReplicaSpec], token_file: str | None) -> None:
    """Write the replica list into the (fresh, local) pool so mount finds the replicas."""
    with PoolMapping.open(path, "msync") as pm:
        pm.persist(write_table(pm.buf, specs, token_file))


def create_replicas(path: str, size: int, specs: list[ReplicaSpec], token: bytes | None,
                    timeout: float = DEFAULT_TIMEOUT, wire_protection: str = DEFAULT_PROTECTION) -> None:
    """Create one pool per replica, in parallel, holding the new local pool's contents; all
    or none: when one cannot be made, those that were are removed again (ProvisionError says
    why, and whether that removal failed somewhere)."""
    errors: list[str] = []
    made: list[ReplicaSpec] = []
    with PoolMapping.open(path, "msync", readonly=True) as pm:
        ranges = metadata_ranges(pm.buf)

        async def one(spec: ReplicaSpec) -> None:
            try:
                await create_remote(spec, size, pm.buf, ranges, token=token, timeout=timeout,
                                    wire_protection=wire_protection)
                made.append(spec)
            except Exception as e:  # each replica's failure is reported, none hides another
                errors.append(f"replica {spec}: {e}")

        async def undo(spec: ReplicaSpec) -> None:
            try:
                with trio.fail_after(timeout):
                    async with await transport_for(spec.transport, wire_protection=wire_protection).connect(
                            spec.address, token, lanes=0, timeout=timeout) as session:
                        await session.remove_pool(spec.name)
            except Exception as e:
                errors.append(f"replica {spec} was made but could not be removed again ({e}): "
                              "remove it on its target")

        async def all_() -> None:
            async with trio.open_nursery() as nursery:
                for spec in specs:
                    nursery.start_soon(one, spec)
            if errors:
                async with trio.open_nursery() as nursery:
                    for spec in made:
                        nursery.start_soon(undo, spec)

        trio.run(all_)
    if errors:
        raise ProvisionError("; ".join(errors))


def create_pool(path: str, size: int, specs: list[ReplicaSpec], *, token: bytes | None = None,
                token_file: str | None = None, force: bool = False,
                progress: Callable[[int, int], None] | None = None,
                wire_protection: str = DEFAULT_PROTECTION) -> Header:
    """mkfs the local pool, record its replicas in it, and create them on their targets.

    MkfsError when the local pool cannot be made; ProvisionError when some replica could not
    be: then the local pool is removed again, and so are the replicas that were made.
    """
    hdr = mkfs(path, size, force=force, progress=progress)
    if specs:
        try:
            record_replicas(path, specs, token_file)
            create_replicas(path, size, specs, token, wire_protection=wire_protection)
        except BaseException:
            # Half a replicated pool is no pool: nothing is left to mount, or to need --force.
            remove_pool(path)
            raise
    return hdr
