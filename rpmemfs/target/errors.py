"""The target daemon's errors: one base for the layer."""

from rpmemfs.errors import RpmemfsError


class TargetError(RpmemfsError):
    """Something the target daemon refused or could not do; the message says what."""
