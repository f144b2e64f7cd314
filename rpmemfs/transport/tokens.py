"""Tokens: reading and making token files, a token's public id, and the local target's token.

A token is a shared secret; whoever holds it may talk to the targets that accept it. So a
token file readable by anyone but its owner is refused (as OpenSSH refuses such a private
key), and so is a token too short to resist guessing (under MIN_TOKEN_BITS). The same check
(read_owned) guards every file whose content decides who gets in: a target's authz file, the
private key of a metrics server.

A target started without ``--token-file`` generates its own token once, in its state
directory (``<state dir>/token``, mode 0600), and keeps it across restarts. Mounts and
commands that are given no token use the token in their own user's default state directory:
so on one host, whoever may read that file (its owner, root) reaches that user's targets,
and nobody else gets anything. The default state directory is $RPMEMFS_STATE_DIR when set,
else /var/lib/rpmemfs for root and $XDG_STATE_HOME/rpmemfs (~/.local/state/rpmemfs) for
other users.

A token file may hold several tokens, one a line: a target accepts every one of them, and an
initiator proves the last (the newest). So a token is rotated by adding the new one beside
the old, and then removing the old one (docs/access.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
from enum import Enum
from typing import Self

from rpmemfs.transport.base import TransportError

MAX_TOKEN_FILE = 4096
MIN_TOKEN_BITS = 128
GENERATED_BYTES = 32  # 256 bits, written as 64 hex digits
KEY_ID_SIZE = 16
STATE_ENV = "RPMEMFS_STATE_DIR"
ROOT_STATE_DIR = "/var/lib/rpmemfs"
TOKEN_NAME = "token"
NAME_ANOTHER = "name the target's token file with --token-file F (a mount: -o token_file=F)"
_KEY_ID_LABEL = b"rpmemfs token id\x00"
_HEX = re.compile(rb"[0-9a-fA-F]+")
_BASE64 = re.compile(rb"[A-Za-z0-9+/=_-]+")


class TokenError(TransportError):
    """A token file or state directory cannot be used; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)


def token_bits(token: bytes) -> int:
    """How many bits of secret ``token`` can hold at most, from its alphabet: 4 per hex
    digit, 6 per base64 character, else 8 per byte."""
    if _HEX.fullmatch(token):
        return 4 * len(token)
    if _BASE64.fullmatch(token):
        return 6 * len(token)
    return 8 * len(token)


def key_id(token: bytes) -> bytes:
    """A token's public name: an initiator says which token it proves with (a target may
    accept several), without revealing anything that helps guess the token."""
    return hashlib.sha256(_KEY_ID_LABEL + token).digest()[:KEY_ID_SIZE]


class Origin(Enum):
    """How an initiator's token was chosen; the text names its file in a refusal's message."""

    GIVEN = "the token file given, {path}"
    RECORDED = "the token file recorded in the pool, {path}"
    LOCAL = "this user's local token, {path} (used when no token file is given)"


class Token(bytes):
    """The token an initiator proves, with the file it came from: when a target refuses it,
    the message says which file that was (a wrong default is the usual cause)."""

    path: str
    origin: Origin

    def __new__(cls, value: bytes, path: str, origin: Origin) -> Self:
        token = super().__new__(cls, value)
        token.path, token.origin = path, origin
        return token


def refused_hint(token: bytes) -> str:
    """What a refusal of ``token`` adds to its message: which token file was tried, and how
    to name another."""
    if not isinstance(token, Token):
        return ""
    return f"; the token tried is {token.origin.value.format(path=token.path)}: {NAME_ANOTHER}"


def _private(st: os.stat_result, what: str) -> None:
    """Refuse a file or directory that someone other than its owner could use or change."""
    if st.st_uid not in (os.geteuid(), 0):
        raise TokenError(f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")


def read_owned(path: str, what: str, limit: int, *, secret: bool = True) -> bytes:
    """What ``path`` holds (at most ``limit`` bytes); TokenError unless it is a regular file of
    this user (or root) that neither group nor others may change, nor read when it holds a
    ``secret`` (a token, a private key). The one check for every file whose content decides
    who gets in: whoever may change such a file may let themselves in."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise TokenError(f"cannot read {what} {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"{what} {path} is not a regular file")
        _private(st, f"{what} {path}")
        mode = stat.S_IMODE(st.st_mode)
        if secret and mode & 0o077:
            raise TokenError(f"{what} {path} has mode {mode:04o}: group or others may read or "
                             f"change it; make it private (chmod 600 {path})")
        if mode & 0o022:
            raise TokenError(f"{what} {path} has mode {mode:04o}: group or others may change it; "
                             f"make it writable by its owner alone (chmod go-w {path})")
        if st.st_size > limit:
            raise TokenError(f"{what} {path} is larger than {limit} bytes")
        return os.read(fd, limit)
    except OSError as exc:
        raise TokenError(f"cannot read {what} {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def read_tokens(path: str) -> list[bytes]:
    """Every token in ``path``, one a line (surrounding whitespace stripped, blank lines and
    repeats skipped), as a target accepts them; TokenError when the file is not a private
    regular file, holds none, or one of them is too short."""
    lines = read_owned(path, "token file", MAX_TOKEN_FILE).splitlines()
    found: list[bytes] = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token in found:
            continue
        if token_bits(token) < MIN_TOKEN_BITS:
            where = f"line {number} of {path}" if len(lines) > 1 else path
            raise TokenError(
                f"the token in {where} holds at most {token_bits(token)} bits; at least "
                f"{MIN_TOKEN_BITS} are needed (make one with `rpmemfs token new FILE`)"
            )
        found.append(token)
    if not found:
        raise TokenError(f"token file {path} is empty")
    return found


def read_token_file(path: str, origin: Origin = Origin.GIVEN) -> Token:
    """The token an initiator proves from ``path``: its last (newest) one; TokenError as
    read_tokens."""
    return Token(read_tokens(path)[-1], path, origin)


def chosen_token(given: str | None, recorded: str | None) -> Token | None:
    """The token an initiator proves: the token file given, else the one its pool records,
    else None (its user's local token, read when it connects)."""
    if given:
        return read_token_file(given, Origin.GIVEN)
    return read_token_file(recorded, Origin.RECORDED) if recorded else None


def new_token_file(path: str) -> None:
    """Write a fresh 256-bit token to ``path`` (mode 0600); FileExistsError if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, secrets.token_hex(GENERATED_BYTES).encode() + b"\n")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def default_state_dir() -> str:
    env = os.environ.get(STATE_ENV)
    if env:
        return env
    if os.geteuid() == 0:
        return ROOT_STATE_DIR
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "rpmemfs")


def check_state_dir(path: str) -> None:
    """TokenError unless ``path`` is a directory of this user that nobody else may change."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise TokenError(f"state directory {path}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise TokenError(f"state directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise TokenError(
            f"state directory {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
            "refusing to use it"
        )
    if st.st_mode & 0o022:
        raise TokenError(
            f"state directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may change "
            f"what is in it (chmod 700 {path})"
        )


def make_state_dir(path: str) -> None:
    """Create ``path`` (mode 0700) unless it exists; then check it is this user's alone."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    check_state_dir(path)


def generated_token(state_dir: str) -> tuple[list[bytes], str]:
    """The tokens a target without --token-file accepts: those in ``state_dir``'s token file
    (made there now, with one token, if there is none yet), and its path."""
    make_state_dir(state_dir)
    path = os.path.join(state_dir, TOKEN_NAME)
    if not os.path.lexists(path):
        # Made aside and linked in: two targets starting together end with the same token.
        tmp = f"{path}.{os.getpid()}.new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            new_token_file(tmp)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        except OSError as exc:
            raise TokenError(f"cannot make a token in {state_dir}: {exc.strerror}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return read_tokens(path), path


def local_token() -> Token | None:
    """The token of this user's local targets (see the module's text), or None when there
    is none this user may read."""
    state_dir = default_state_dir()
    path = os.path.join(state_dir, TOKEN_NAME)
    if not os.path.lexists(path):
        return None
    check_state_dir(state_dir)
    return read_token_file(path, Origin.LOCAL)


def no_token() -> str:
    """Why an initiator given no token has none, and what to do."""
    path = os.path.join(default_state_dir(), TOKEN_NAME)
    return (f"no token: none was given and this user has no local token ({path} does not exist): "
            f"{NAME_ANOTHER}, or run as the user whose local target generated its token there "
            f"(${STATE_ENV}, /var/lib/rpmemfs for root, $XDG_STATE_HOME/rpmemfs for a user)")
