"""POSIX ACLs in the xattr format the kernel passes (system.posix_acl_access / _default), and
the rules that tie them to a file's mode, as Linux applies them for ext4 (fs/posix_acl.c).

No library reads this format: pylibacl works through libacl on files, and its ACL(data=)
takes libacl's own copy_ext format, not the xattr one; the format is a 4-byte version and
8-byte entries, so it is parsed here.

The kernel checks access itself (FUSE_POSIX_ACL); the filesystem keeps the stored ACLs and
the mode in step: on chmod, on setting an access ACL, and on create under a default ACL.
"""

from __future__ import annotations

import errno
import stat
import struct
from typing import NamedTuple

from rpmemfs.fs.errors import FsError

ACCESS = b"system.posix_acl_access"
DEFAULT = b"system.posix_acl_default"
NAMES = (ACCESS, DEFAULT)

VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
_HEAD = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")


class Entry(NamedTuple):
    tag: int
    perm: int  # rwx as 4, 2, 1
    id: int  # uid or gid for USER and GROUP entries, UNDEFINED_ID for the others


Acl = list[Entry]


def parse(value: bytes) -> Acl:
    """The entries of an ACL xattr value, checked as the kernel checks them before storing
    (posix_acl_from_xattr, posix_acl_valid): EOPNOTSUPP for another format version (as the
    kernel answers), EINVAL for anything else malformed. No entries at all is an empty list
    (the kernel turns that into removing the ACL)."""
    if len(value) < _HEAD.size or (len(value) - _HEAD.size) % _ENTRY.size:
        raise FsError(errno.EINVAL, "malformed ACL")
    if _HEAD.unpack_from(value)[0] != VERSION:
        raise FsError(errno.EOPNOTSUPP, "unsupported ACL version")
    acl = [Entry(*_ENTRY.unpack_from(value, off))
           for off in range(_HEAD.size, len(value), _ENTRY.size)]
    if acl:
        _check(acl)
    return acl


def _check(acl: Acl) -> None:
    """posix_acl_valid: one USER_OBJ, USER entries, one GROUP_OBJ, GROUP entries, a MASK
    (required when there are named entries), one OTHER, in that order; perms within rwx."""
    order = [USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER]
    pos = 0
    named = False
    seen: set[int] = set()
    for e in acl:
        if e.perm & ~7 or e.tag not in order:
            raise FsError(errno.EINVAL, "malformed ACL entry")
        i = order.index(e.tag)
        if i < pos or (e.tag not in (USER, GROUP) and e.tag in seen):
            raise FsError(errno.EINVAL, "ACL entries out of order or repeated")
        if e.tag in (USER, GROUP):
            if e.id == UNDEFINED_ID:
                raise FsError(errno.EINVAL, "ACL entry without an id")
            named = True
        seen.add(e.tag)
        pos = i
    if not {USER_OBJ, GROUP_OBJ, OTHER} <= seen or (named and MASK not in seen):
        raise FsError(errno.EINVAL, "ACL misses a required entry")


def encode(acl: Acl) -> bytes:
    return _HEAD.pack(VERSION) + b"".join(
        _ENTRY.pack(e.tag, e.perm, e.id if e.tag in (USER, GROUP) else UNDEFINED_ID) for e in acl)


def equiv_mode(acl: Acl, mode: int) -> tuple[bool, int]:
    """posix_acl_equiv_mode: whether the ACL says no more than permission bits, and the mode
    with its rwx bits taken from the ACL (the group bits from the mask when there is one)."""
    bits = 0
    equivalent = True
    for e in acl:
        if e.tag == USER_OBJ:
            bits |= e.perm << 6
        elif e.tag == GROUP_OBJ:
            bits |= e.perm << 3
        elif e.tag == OTHER:
            bits |= e.perm
        elif e.tag == MASK:
            bits = (bits & ~0o070) | (e.perm << 3)
            equivalent = False
        else:
            equivalent = False
    return equivalent, (mode & ~0o777) | bits


def chmod(acl: Acl, mode: int) -> Acl:
    """posix_acl_chmod: the owner, other and mask (or group, without a mask) entries follow
    a new mode; named entries keep their perms."""
    has_mask = any(e.tag == MASK for e in acl)
    out: Acl = []
    for e in acl:
        if e.tag == USER_OBJ:
            e = e._replace(perm=(mode >> 6) & 7)
        elif e.tag == OTHER:
            e = e._replace(perm=mode & 7)
        elif e.tag == MASK or (e.tag == GROUP_OBJ and not has_mask):
            e = e._replace(perm=(mode >> 3) & 7)
        out.append(e)
    return out


def create(default: Acl, mode: int) -> tuple[Acl | None, int]:
    """posix_acl_create_masq: the access ACL a new inode gets from its directory's default
    ACL and the mode it was created with (each ANDed with the other, POSIX 1003.1e), and the
    resulting mode. None when that ACL says no more than the mode (then nothing is stored)."""
    bits = mode & 0o777
    equivalent = True
    out: Acl = []
    group_at = mask_at = -1
    for e in default:
        if e.tag == USER_OBJ:
            e = e._replace(perm=e.perm & (bits >> 6))
            bits &= (e.perm << 6) | ~0o700
        elif e.tag == OTHER:
            e = e._replace(perm=e.perm & bits)
            bits &= e.perm | ~0o007
        elif e.tag == GROUP_OBJ:
            group_at = len(out)
        elif e.tag == MASK:
            mask_at = len(out)
            equivalent = False
        else:
            equivalent = False
        out.append(e)
    at = mask_at if mask_at >= 0 else group_at
    if at >= 0:
        e = out[at]
        out[at] = e._replace(perm=e.perm & ((bits >> 3) & 7))
        bits &= (out[at].perm << 3) | ~0o070
    new_mode = (mode & ~0o777) | (bits & 0o777)
    return (None if equivalent else out), new_mode


def applies_to(mode: int) -> bool:
    """Symlinks carry no ACL (their permissions are never checked)."""
    return not stat.S_ISLNK(mode)
