"""Replication: replica specs and pool sets, the replica table in the pool, the replica set.

The filesystem hands this layer lists of pool byte ranges and asks for them to be durable;
it never sees a transport, and this layer never sees a file.
"""

from rpmemfs.replica.remote import create_remote, metadata_ranges
from rpmemfs.replica.replica import Replica, ReplicaState
from rpmemfs.replica.replica_set import ReplicaError, ReplicaSet
from rpmemfs.replica.spec import PoolSet, PoolSetError, ReplicaSpec, is_poolset, parse_poolset, read_poolset
from rpmemfs.replica.table import TableError, TableRead, inspect_table, read_table, write_table

__all__ = [
    "PoolSet",
    "PoolSetError",
    "Replica",
    "ReplicaError",
    "ReplicaSet",
    "ReplicaSpec",
    "ReplicaState",
    "TableError",
    "TableRead",
    "create_remote",
    "inspect_table",
    "is_poolset",
    "metadata_ranges",
    "parse_poolset",
    "read_poolset",
    "read_table",
    "write_table",
]
