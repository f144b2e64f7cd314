"""The root of every error rpmemfs raises on purpose.

Each layer has one base class that derives from RpmemfsError, and its other errors derive from
that base:

| layer | base | others |
|---|---|---|
| CLI edge | CliError | |
| device DAX (devdax.py) | DevDaxError | |
| pool names (poolname.py) | PoolNameError | |
| pool format | PoolFormatError | |
| persistence | PmemError | |
| pool files | PlaceError | |
| filesystem | FilesystemError | FsError (carries an errno), MkfsError |
| durability | DurabilityError | |
| replication | ReplicationError | ReplicaError, PoolSetError, TableError |
| transport | TransportError | TokenError |
| target daemon | TargetError | StartError, PoolError, PoolDirError, PoolDevError, AuthzError |
| mount daemon | MountError | ProvisionError |
| offline commands (admin/) | AdminError | RepairError, GrowError |
| tools | SpawnError | DemoError, TimelineError |

tests/unit/test_errors_table.py fails when a subclass of RpmemfsError is missing here.

Two edges turn them into what a user sees, once each: the FUSE edge (rpmemfs/fuse.py) into an
errno, the CLI edge (rpmemfs/cli.py) into one line on stderr and a non-zero exit status.
Anything else that reaches an edge is a bug: EIO and a logged traceback at the FUSE edge, an
"internal error" line at the CLI edge.

Signals that never leave the module pair that uses them stay plain exceptions, because nobody
outside should catch them: LogFull and OutOfSpace (the filesystem retries or answers ENOSPC),
NeedSync (the FUSE edge runs a durability point and retries), ReplicaUnusable (the replica is
marked stale), WireError and VerbsError (a malformed frame: a TransportError on the initiator,
an error reply or a closed lane on the target), Violation (the target closes the lane), and
TransitionError (a replica state move the table forbids: a bug).
"""


class RpmemfsError(Exception):
    """An error rpmemfs reports on purpose; its message is meant for the user."""
