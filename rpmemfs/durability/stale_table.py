"""Which replicas are out of sync, kept in the pool's replica table as it changes.

A replica that missed a barrier must be known as stale to whoever opens the pool next, even
if this daemon dies right after the fsync that left it behind: so the table is rewritten, and
persisted, before that fsync returns (the durability point calls :meth:`StaleTable.update`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from rpmemfs.ranges import Ranges
from rpmemfs.replica.replica import Replica, ReplicaState
from rpmemfs.replica.spec import ReplicaSpec
from rpmemfs.replica.table import write_table

log = logging.getLogger("rpmemfs.mount")


class StaleTable:
    def __init__(self, buf: memoryview, specs: list[ReplicaSpec], token_file: str | None,
                 stale: set[str]) -> None:
        self._buf = buf
        self._specs = specs
        self._token_file = token_file
        self.stale = stale  # "ADDR/NAME" of the replicas the table names stale

    def rewrite(self, replicas: Iterable[Replica]) -> Ranges:
        """Write the table now (its replica list changed); the ranges written."""
        self.stale = {str(r.spec) for r in replicas if r.state != ReplicaState.IN_SYNC}
        return write_table(self._buf, self._specs, self._token_file, sorted(self.stale))

    def update(self, replicas: Iterable[Replica]) -> Ranges:
        """Write the table if the set of out-of-sync replicas changed; the ranges written
        (to persist, and to carry to the replicas), else nothing."""
        behind = {str(r.spec) for r in replicas if r.state != ReplicaState.IN_SYNC}
        if behind == self.stale:
            return []
        if behind - self.stale:
            log.error("replicas now out of sync: %s", ", ".join(sorted(behind - self.stale)))
        self.stale = behind
        return write_table(self._buf, self._specs, self._token_file, sorted(self.stale))
