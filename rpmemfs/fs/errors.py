"""The filesystem layer's errors: one base, so that callers can catch the layer as a whole."""

from __future__ import annotations

import os

from rpmemfs.errors import RpmemfsError


class FilesystemError(RpmemfsError):
    """Something the filesystem layer refused or could not do."""


class FsError(FilesystemError, OSError):
    """A filesystem call failed with an errno (the FUSE edge answers with it)."""

    def __init__(self, err: int, what: str = "") -> None:
        super().__init__(err, what or os.strerror(err))


class MkfsError(FilesystemError):
    """A pool cannot be made as asked."""
