"""Opening a file to write it: never through a symbolic link, never into a file someone else
put at its name.

Every file rpmemfs writes at a path a user names, or in a directory others share, is opened
here: a pool that mkfs, recover or promote make, `-o log=FILE`, a mount's log beside its
control socket, the tools' logs and reports. In a world-writable sticky directory (/tmp,
/dev/shm) another user may plant a symbolic link at that name, pointing at a file only the
writing user (root, say) may change. The kernel refuses to follow it where
fs.protected_symlinks is set, and not every host sets it; so the last component is opened with
O_NOFOLLOW and a link there is refused in one line (RefusedPath), never followed. Directories
on the way are followed: the user named them.

- create: a new file, with O_EXCL; whatever is at the name is refused.
- replace (mkfs --force, recover --force): the name is unlinked and a new file created with
  O_EXCL, so what stood there (another user's file, a hard link to some other file) loses its
  name and is never written. A symbolic link is refused rather than removed: a user who
  linked the name on purpose learns where the file really is.
- append, overwrite (logs, reports): an existing regular file is written only when it is the
  caller's and has one name (a hard link planted by another user is another file's name too,
  and fs.protected_hardlinks is not everywhere either); other kinds (/dev/null, a FIFO) are
  written as they are, and one that nobody reads is refused rather than waited for.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

_NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY


class RefusedPath(OSError):
    """The file is not written: its name is a symbolic link, or the file there may be another's;
    the message says which and what to do."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _link(path: str) -> RefusedPath:
    return RefusedPath(errno.ELOOP, f"{path} is a symbolic link: refusing to write through it "
                                    "(name the file itself, or remove the link)")


def refuse_link(path: str) -> None:
    """RefusedPath when ``path`` itself is a symbolic link."""
    if os.path.islink(path):
        raise _link(path)


def opener(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that follows no link at the last component (also for PoolMapping.open)."""
    try:
        return os.open(path, flags | _NO_LINK, mode)
    except OSError:
        # ELOOP, or EACCES where O_CREAT meets a link in a sticky directory
        refuse_link(path)
        raise


def create(path: str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """A new file at ``path``; FileExistsError when there is anything there (RefusedPath for a
    link)."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NO_LINK, mode)
    except FileExistsError:
        refuse_link(path)
        raise


def replace(path: str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """A new file at ``path`` in place of what is there (see the module's text)."""
    refuse_link(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        return create(path, flags, mode)
    except FileExistsError:
        raise RefusedPath(errno.EEXIST, f"{path} was made again by someone else while it was "
                                        "being replaced: refusing to write it") from None


def _existing(path: str, flags: int, mode: int) -> int:
    # O_NONBLOCK: a FIFO nobody reads is refused (ENXIO) rather than waited for forever.
    fd = opener(path, flags | os.O_CREAT | os.O_NONBLOCK, mode)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if st.st_uid != os.geteuid():
                raise RefusedPath(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this "
                                               f"user (uid {os.geteuid()}): refusing to write into "
                                               "it (remove it, or name another file)")
            if st.st_nlink != 1:
                raise RefusedPath(errno.EMLINK, f"{path} has {st.st_nlink} names (hard links), "
                                                "so it may be another file too: refusing to write "
                                                "into it (remove it, or name another file)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append(path: str, mode: int = 0o600) -> int:
    """``path`` opened to append to, made (``mode``) when missing (see the module's text)."""
    return _existing(path, os.O_WRONLY | os.O_APPEND, mode)


def overwrite(path: str, mode: int = 0o644, flags: int = os.O_WRONLY) -> int:
    """``path`` opened to write from its start, made when missing, emptied when it is a file
    (see the module's text)."""
    fd = _existing(path, flags, mode)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """A report or other output of a tool, written to ``path`` (see overwrite)."""
    with os.fdopen(overwrite(os.fspath(path)), "w", encoding="utf-8") as f:
        f.write(text)
