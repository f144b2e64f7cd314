"""The offline commands: what an operator runs over a pool that is not mounted.

- ``promote_pool`` (promote.py): a failover's new primary, claimed so that the old primary is
  fenced before anything is copied;
- ``recover_pool`` (recover.py): a lost or damaged local pool rebuilt from one replica;
- ``sync_pool`` (sync.py): every replica compared and repaired from the local pool;
- ``grow_pool`` (grow.py): a pool and its replicas grown;
- ``verify`` (verify.py): every replica compared with the local pool.

recover and promote read a whole pool from one replica the same way (source.py). The commands
sit on the replication layer (specs, the replica table, the replica set, fencing's probes,
chunk checksums) and the pool files; none runs inside a mount, and the mount daemon never
imports them: a live pool is verified and repaired by its own daemon (replica/live_verify.py).
The reports' text for the CLI (``format_sync``, ``format_report``) lives beside each command.
"""

from rpmemfs.admin.errors import AdminError, GrowError, RepairError
from rpmemfs.admin.grow import grow_pool
from rpmemfs.admin.promote import promote_pool
from rpmemfs.admin.recover import recover_pool
from rpmemfs.admin.sync import SyncReport, format_sync, sync_pool
from rpmemfs.admin.verify import format_report, verify

__all__ = [
    "AdminError",
    "GrowError",
    "RepairError",
    "SyncReport",
    "format_report",
    "format_sync",
    "grow_pool",
    "promote_pool",
    "recover_pool",
    "sync_pool",
    "verify",
]
