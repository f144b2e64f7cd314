"""A session's registrations in C memory, where the lanes' C receive loops look keys up.

A slot is filled, then made live; a lane uses a slot's mapping only between counting itself
in ``inflight`` and seeing ``live`` set (rpmem_lane.c). So a pool may be unmapped once its
slot is retired and no lane is inside a frame that uses it.
"""

from __future__ import annotations

from typing import Any

from rpmemfs.native import ffi, lib
from rpmemfs.target.pools import Pool, PoolError

# Pools one session may have open at once; an initiator opens one per replica it serves.
MAX_REGIONS = 64


class RegionTable:
    def __init__(self) -> None:
        self.c: Any = ffi.new(f"struct rpm_region[{MAX_REGIONS}]")
        # What each slot points into, kept alive here for as long as a lane could use it.
        self._keep: list[Pool | None] = [None] * MAX_REGIONS

    def publish(self, key: int, pool: Pool, writable: bool = True) -> int:
        base = ffi.cast("char *", pool.mapping.base)
        for slot in range(MAX_REGIONS):
            if lib.rpm_region_publish(
                ffi.addressof(self.c, slot), key, base, pool.size, int(pool.mapping.is_pmem),
                int(writable), pool.counters.c,
            ) == 0:
                self._keep[slot] = pool
                return slot
        raise PoolError(f"a session may have at most {MAX_REGIONS} pools open", "busy")

    def retire(self, slot: int) -> int:
        """Take the slot out of use; returns how many lanes are still using its mapping."""
        return int(lib.rpm_region_retire(ffi.addressof(self.c, slot)))

    def inflight(self, slot: int) -> int:
        return int(lib.rpm_region_inflight(ffi.addressof(self.c, slot)))
