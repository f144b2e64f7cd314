"""The admin layer's errors: one base, and one class per kind of command."""

from rpmemfs.errors import RpmemfsError


class AdminError(RpmemfsError):
    """Base of RepairError and GrowError: an offline command refused or could not finish."""


class RepairError(AdminError):
    """The repair could not be done; the message says why. The local pool is untouched, or,
    for recover, not created."""


class GrowError(AdminError):
    """The pool could not be grown; the message says what was changed and what to do."""
