"""The root of every error rpmemfs raises on purpose.

Each layer has one base class that derives from RpmemfsError (PoolFormatError for the pool's
format, FsError for the filesystem, ReplicaError for replication, TransportError for the
transports, and so on); a layer's other errors derive from its base. Two edges turn them into
what a user sees, once each: the FUSE edge (rpmemfs/fuse.py) into an errno, the CLI edge
(rpmemfs/cli.py) into one line on stderr and a non-zero exit status. Anything else that
reaches an edge is a bug: EIO and a logged traceback at the FUSE edge, an "internal error"
line at the CLI edge.
"""


class RpmemfsError(Exception):
    """An error rpmemfs reports on purpose; its message is meant for the user."""
