"""Which copy a promote takes, and whether it may promote at all.

Every acknowledged fsync is on the primary and on ``min_replicas`` replicas: with the default
(half the other nodes, rounded up) that is a majority of the copies. Two majorities always
share a node, so a promote that reaches a majority of the copies reaches at least one that
holds every acknowledged point; with fewer it might not, and it refuses (a partitioned node
cannot promote a second primary either: it reaches only itself).

Among the copies reached, the most recent is the one written by the latest primary (the
header's epoch generation: a new primary's epoch reaches every replica with its first
durability point, before that point is acknowledged), then the one holding the latest point
(its position stamp's sequence number, which goes on across primaries in the same log). A
copy whose resync was cut short mixes two points in time and is never taken. Of equals, this
node's own copy wins: nothing has to be copied.
"""

from __future__ import annotations

from rpmemfs.ha.ocf import Ocf, OcfError
from rpmemfs.ha.survey import Copy, Survey
from rpmemfs.pool.layout import epoch_gen


def recency(c: Copy) -> tuple[int, int, bool]:
    return (epoch_gen(c.epoch), c.seq, c.local)


def choose(found: Survey, nodes: int, majority: int) -> Copy | None:
    """The copy to promote; None when the pool was never made (no node has a copy and every
    node answered). OcfError when promoting would risk acknowledged data or two pools."""
    if not found.copies:
        absent = all("does not exist" in why for why in found.unusable.values())
        if len(found.reached) == nodes and absent:
            return None
        raise OcfError(Ocf.ERR_GENERIC, f"no copy of the pool was reached ({found.describe()}); "
                       "not promoting")
    pools = {(c.uuid, c.size) for c in found.copies}
    if len(pools) > 1:
        raise OcfError(Ocf.ERR_CONFIGURED, "the nodes hold copies of different pools (uuid or size "
                       f"differ: {found.describe()}); remove the stray one")
    if len(found.copies) < majority:
        raise OcfError(Ocf.ERR_GENERIC, f"only {len(found.copies)} of {nodes} copies reached, "
                       f"{majority} needed: a copy not reached may hold acknowledged writes "
                       f"({found.describe()}); not promoting")
    whole = [c for c in found.copies if c.resync is None]
    if not whole:
        raise OcfError(Ocf.ERR_GENERIC, "every copy reached had its resync cut short "
                       f"({found.describe()}); `rpmemfs promote --unfinished-resync` by hand")
    return max(whole, key=recency)
