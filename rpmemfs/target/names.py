"""Pool names: what an initiator may ask for, and where that lands under the pool directory.

A pool name is one plain file name inside the pool directory, never a path. The checks are
strict on purpose: every name an initiator sends is untrusted, and a name that could be read
two ways (hidden files, '..', a symlink) is refused rather than interpreted.
"""

from __future__ import annotations

import os
import re
import stat

from rpmemfs.target.errors import TargetError

MAX_NAME = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._-]+")


class PoolNameError(TargetError, ValueError):
    """The name is refused; the message says why, in terms the initiator's user can act on."""


def _show(name: str) -> str:
    shown = repr(name)
    return shown if len(shown) <= 48 else shown[:40] + "...'"


def check_name(name: object) -> str:
    """``name`` if it is an acceptable pool name; PoolNameError otherwise."""
    if not isinstance(name, str):
        raise PoolNameError("pool name must be a string")
    if not name:
        raise PoolNameError("pool name is empty")
    shown = _show(name)
    if "\x00" in name:
        raise PoolNameError(f"pool name {shown} contains a NUL byte")
    if "/" in name:
        raise PoolNameError(f"pool name {shown} contains '/': a pool is a plain name, not a path")
    if len(name) > MAX_NAME:
        raise PoolNameError(f"pool name {shown} is {len(name)} characters long (limit {MAX_NAME})")
    if name.startswith("."):
        raise PoolNameError(f"pool name {shown} starts with '.'")
    if ".." in name:
        raise PoolNameError(f"pool name {shown} contains '..'")
    if not _ALLOWED.fullmatch(name):
        raise PoolNameError(f"pool name {shown} may contain only letters, digits, '.', '_' and '-'")
    return name


def pool_path(pool_dir: str, name: str, *, must_exist: bool) -> str:
    """The path of pool ``name`` in ``pool_dir`` (an absolute, resolved directory).

    Refuses a path that is a symlink or resolves outside the directory, and, when
    ``must_exist``, anything but an existing regular file (a FIFO would block the opener).
    """
    path = os.path.join(pool_dir, check_name(name))
    if os.path.dirname(os.path.realpath(path)) != pool_dir:
        raise PoolNameError(f"pool {_show(name)} resolves outside the pool directory")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if must_exist:
            raise PoolNameError(f"pool {_show(name)} does not exist") from None
        return path
    if stat.S_ISLNK(st.st_mode):
        raise PoolNameError(f"pool {_show(name)} is a symbolic link; pools must be regular files")
    if not stat.S_ISREG(st.st_mode):
        raise PoolNameError(f"pool {_show(name)} is not a regular file")
    return path
