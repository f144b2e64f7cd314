"""The pool directory, held open: every file a target touches is opened relative to it.

Paths are resolved again at every use, so a check made on a path says nothing about the file
a later open gets: someone who can change the directory could swap a pool for a symbolic link
between the two and have the target write wherever the link points. So the directory is
opened once, at start, and every pool, owner record and temporary file is opened relative to
that descriptor with O_NOFOLLOW (a name is one component: '/' is refused in pool names), and
what got opened is checked on the descriptor itself (fstat): a regular file, on the pool
directory's device, owned by the user the target runs as. The directory must belong to that
user and be writable by nobody else, which leaves nobody to swap anything in the first place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.target.errors import TargetError


class PoolDirError(TargetError):
    """The pool directory cannot be used safely; the message says what to change."""


def check_pool_dir(path: str, shown: str | None = None) -> None:
    """PoolDirError unless ``path`` is a directory of this user that nobody else may change."""
    shown = shown or path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise PoolDirError(f"pool directory {shown}: {exc.strerror}") from None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise PoolDirError(f"pool directory {shown} does not exist or is not a directory")
    if st.st_uid != os.geteuid():
        raise PoolDirError(f"pool directory {shown} belongs to uid {st.st_uid}, not to the user the target "
                           f"runs as (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise PoolDirError(
            f"pool directory {shown} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may "
            f"add, remove or swap pool files in it; make it private (chmod 700 {shown})"
        )


class PoolDir:
    """Files in one pool directory, by name, never through a symbolic link."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dev = os.fstat(self.fd).st_dev

    def close(self) -> None:
        os.close(self.fd)

    def open(self, name: str, flags: int, mode: int = 0o600, *, what: str = "pool") -> int:
        """A descriptor of file ``name`` (a pool name, or '.' + one for the target's own
        files), checked to be a regular file of this user on this directory's device.
        PoolNameError when there is no such file or it is not one; OSError otherwise."""
        check_name(name.removeprefix("."))
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK  # (a FIFO would block)
        try:
            fd = os.open(name, flags, mode, dir_fd=self.fd)
        except FileNotFoundError:
            raise PoolNameError(f"{what} {name!r} does not exist") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PoolNameError(f"{what} {name!r} is a symbolic link; pools must be regular files"
                                    ) from None
            raise
        try:
            self._check(fd, name, what)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def opener(self, name: str, flags: int) -> int:
        """``open`` in the shape PoolMapping.open takes."""
        return self.open(name, flags)

    def _check(self, fd: int, name: str, what: str) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PoolNameError(f"{what} {name!r} is not a regular file")
        if st.st_dev != self._dev:
            raise PoolNameError(f"{what} {name!r} is on another file system than the pool directory")
        if st.st_uid != os.geteuid():
            raise PoolNameError(f"{what} {name!r} belongs to uid {st.st_uid}, not to the target's user")

    def create(self, name: str, flags: int, mode: int = 0o600) -> int:
        """A new file ``name``; FileExistsError if the name is taken (by anything, a link too)."""
        check_name(name.removeprefix("."))
        return os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                       dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str, *, missing_ok: bool = False) -> None:
        with contextlib.suppress(*((FileNotFoundError,) if missing_ok else ())):
            os.unlink(name, dir_fd=self.fd)

    def rename(self, old: str, new: str) -> None:
        os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def sync(self) -> None:
        """Make the directory's entries durable (after a create, rename or unlink)."""
        os.fsync(self.fd)

    def read_record(self, name: str, limit: int, what: str) -> bytes:
        """A small record beside the pools (a file of ours: PoolNameError otherwise), read up
        to ``limit`` + 1 bytes so that the caller sees one that is too long."""
        fd = self.open(name, os.O_RDONLY, what=what)
        try:
            return os.read(fd, limit + 1)
        finally:
            os.close(fd)

    def write_record(self, name: str, data: bytes) -> None:
        """Replace the record ``name`` durably before returning: write and fsync a new file,
        rename it over the old one, fsync the directory."""
        tmp = f"{name}.tmp"
        self.unlink(tmp, missing_ok=True)  # left by a target that was killed mid-way
        fd = self.create(tmp, os.O_WRONLY)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rename(tmp, name)
        self.sync()

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))
