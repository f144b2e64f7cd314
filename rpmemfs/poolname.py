"""Pool names: what an initiator may ask a target for, and where that lands under the target's
pool directory.

A pool name is one plain file name inside the pool directory, never a path. The checks are
strict on purpose: every name an initiator sends is untrusted, and a name that could be read
two ways (hidden files, '..') is refused rather than interpreted; target/pooldir.py opens
names without following symbolic links.

The rules are one contract with two sides: the target refuses a name that breaks them, and
the initiator's replica specs (replica/spec.py) refuse the same names before any connection.
So they live here, beneath both, rather than in either layer.
"""

from __future__ import annotations

import re

from rpmemfs.errors import RpmemfsError

MAX_NAME = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._-]+")


class PoolNameError(RpmemfsError, ValueError):
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
