"""Quotas of pools tokens on one target: the bytes and the number of pools a token's pools
hold, checked before each create and grow (``quota=SIZE pools=N`` in the authz file).

A ``pools`` token's usage is every pool here (a file in the pool directory, or a pool on a
device DAX given by --pool-dev) whose name matches one of its patterns, whoever made it: the
pools it may write, grow and remove. Counting by name rather than by creator leaves nothing
to record and nothing to fall out of step: pools made before quotas existed, or made for a
tenant by an administrator, count as the tenant's at once, and there is no way around it,
since every byte a token can have this target allocate is in a pool its patterns name. A
pool that two tokens' patterns both name (``shared``) counts toward each of them. Admin
tokens have no quota, and a tenant's quota never refuses an admin's create: a tenant who
fills its quota leaves the rest of the target to the others.

The check and the reservation are made on the target's trio thread with no wait between
them, and a create or grow under way counts at the size it will have until it is done (the
file grows while fallocate runs in a worker thread): two creates racing cannot both take the
room there is for one.
"""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.target.authz import Grant
from rpmemfs.target.pools import PoolError, PoolStore
from rpmemfs.units import count, human


@dataclass(frozen=True)
class Usage:
    bytes: int
    pools: int


class Quotas:
    def __init__(self, store: PoolStore) -> None:
        self._store = store
        self._pending: list[tuple[str, int]] = []  # creates and grows under way: name, size

    def sizes(self) -> dict[str, int]:
        """Every pool here and its size, those being made or grown at the size they will have."""
        out: dict[str, int] = {}
        devices = self._store.devices
        for name in self._store.names():
            if name in devices:
                size = devices.size(name)
                if size is not None:
                    out[name] = size
                continue
            try:
                st = self._store.dir.lstat(check_name(name))
            except (PoolNameError, OSError):
                continue  # the target's own files (dot names), or gone meanwhile
            if stat.S_ISREG(st.st_mode):
                out[name] = st.st_size
        for name, size in self._pending:
            out[name] = max(size, out.get(name, 0))
        return out

    def usage(self, grant: Grant, sizes: dict[str, int] | None = None) -> Usage:
        mine = [size for name, size in (self.sizes() if sizes is None else sizes).items()
                if grant.allows(name)]
        return Usage(sum(mine), len(mine))

    def report(self, grants: Iterable[Grant]) -> dict[str, dict[str, Any]]:
        """Usage against limits of each of ``grants`` that has limits (`rpmemfs pools`)."""
        sizes = self.sizes()
        out: dict[str, dict[str, Any]] = {}
        for g in grants:
            if g.limited and not g.admin:
                used = self.usage(g, sizes)
                out[g.name] = {"quota": g.quota, "max_pools": g.max_pools, "used": used.bytes,
                               "pools": used.pools}
        return out

    @contextlib.contextmanager
    def making(self, grant: Grant, name: str, size: object, *, grow: bool) -> Iterator[None]:
        """Hold ``size`` bytes for pool ``name`` (created, or grown to that size) while the
        caller makes it; PoolError (code ``quota``) when that would take ``grant``'s pools
        over its limits. A size that is no size is left for the pool store to refuse."""
        entry = None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            if grant.limited and not grant.admin:
                self._check(grant, name, size, grow)
            entry = (name, size)
            self._pending.append(entry)
        try:
            yield
        finally:
            if entry is not None:
                self._pending.remove(entry)

    def _check(self, grant: Grant, name: str, size: int, grow: bool) -> None:
        sizes = self.sizes()
        had = sizes.get(name)
        if (had is None) == grow:
            return  # growing no pool, or creating one that exists: the store says so
        used = self.usage(grant, sizes)
        after = used.bytes - (had or 0) + size
        if had is None and grant.max_pools is not None and used.pools >= grant.max_pools:
            raise PoolError(
                f"token {grant.name!r} may have at most {count(grant.max_pools, 'pool')} on this "
                f"target and has {used.pools}: pool {name!r} would be one more (its quota; remove "
                "one of its pools, or ask the target's administrator for more)", "quota")
        if grant.quota is not None and size > (had or 0) and after > grant.quota:
            raise PoolError(
                f"token {grant.name!r} may hold {human(grant.quota)} on this target and its pools "
                f"hold {human(used.bytes)}: pool {name!r} at {human(size)} would take them to "
                f"{human(after)} (its quota; remove one of its pools, or ask the target's "
                "administrator for more)", "quota")
