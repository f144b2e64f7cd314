"""The replication layer's base error: what it refused or could not do, said in its message."""

from rpmemfs.errors import RpmemfsError


class ReplicationError(RpmemfsError):
    """Base of ReplicaError, PoolSetError and TableError."""
