"""The mount daemon's errors: one base for the layer."""

from rpmemfs.errors import RpmemfsError


class MountError(RpmemfsError):
    """A pool cannot be mounted, or a mount cannot be administered, as asked."""


class ProvisionError(MountError):
    """A pool was made but its replicas could not all be created."""
