"""Who may do what on a target: the tokens it accepts, each with a name, a role and pools.

The target's own token (``--token-file``, or the one it generated) is an ``admin`` token: every
pool and every operation. ``--authz FILE`` adds tokens limited to some pools, one a line::

    # name   role    token file                 pool names (shell patterns), limits
    alice    pools   /etc/rpmemfs/alice.token   alice-* shared quota=10G pools=4
    ops      admin   /etc/rpmemfs/ops.token

A ``pools`` token may create, open, probe, remove and list only pools whose names match one
of its patterns; what it asks about any other pool is refused (code ``denied``), and listings
show it only its own pools. ``quota=SIZE`` and ``pools=N`` bound what those pools hold on this
target (quota.py). ``connections=N``, on a line of either role, bounds the connections its
token holds at once (admission.py). Administrative operations (``evict``: dropping another session's
registration) need an ``admin`` token.

Whoever may change the file decides who gets in, so it is checked as token files are (a
regular file of the target's user or root that neither group nor others may change); it names
token files rather than holding tokens, so others may read it. A file that grants nothing is
refused, at start and on reload: a truncated file must not take every tenant's access away.
"""

from __future__ import annotations

import collections
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rpmemfs.target.errors import TargetError
from rpmemfs.target.pools import PoolError
from rpmemfs.transport.control_ops import OPS
from rpmemfs.transport.tokens import TokenError, key_id, read_owned, read_tokens
from rpmemfs.units import count, human, parse_size

ROLES = ("admin", "pools")
DEFAULT_NAME = "default"
# Operations that act on the target as a whole or on other initiators' sessions (declared so
# in control_ops.py). Members compare equal to their names, so a request's op string is found.
ADMIN_OPS = frozenset(op for op, spec in OPS.items() if spec.admin)
V = TypeVar("V")
# A file of grants: thousands of lines at most.
MAX_AUTHZ_FILE = 1 << 20
LIMITS = ("quota", "pools")


class AuthzError(TargetError):
    """The authorization file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Grant:
    """What the holder of one token may do."""

    name: str
    admin: bool
    pools: tuple[str, ...] = ()  # patterns; an admin may use every pool
    quota: int | None = None  # bytes its pools may hold on this target (pools tokens only)
    max_pools: int | None = None  # how many pools it may have there
    # Authenticated connections it may hold at once (None: the target's default for its role).
    max_connections: int | None = None

    @property
    def limited(self) -> bool:
        return self.quota is not None or self.max_pools is not None

    def limits(self) -> str:
        """For the log: its limits, or nothing."""
        shown = ([f"quota {human(self.quota)}"] if self.quota is not None else []) + (
            [f"at most {count(self.max_pools, 'pool')}"] if self.max_pools is not None else [])
        return f", {', '.join(shown)}" if shown else ""

    def allows(self, pool: str) -> bool:
        return self.admin or any(fnmatch.fnmatchcase(pool, p) for p in self.pools)

    def check(self, op: object, request: Mapping[str, Any]) -> None:
        """PoolError (code ``denied``) unless this token may make ``request``."""
        if op in ADMIN_OPS and not self.admin:
            raise PoolError(f"{op} needs an admin token; token {self.name!r} may only use its pools",
                            "denied")
        name = request.get("name")
        if isinstance(name, str) and not self.allows(name):
            raise PoolError(f"token {self.name!r} may not use pool {name[:128]!r}", "denied")

    def visible(self, pools: Mapping[str, V]) -> dict[str, V]:
        """The entries of a listing this token may see."""
        return {n: v for n, v in pools.items() if self.allows(n)}


class TokenBook:
    """The tokens a target accepts, by key id (what an initiator's HELLO names)."""

    def __init__(self) -> None:
        self._by_id: dict[bytes, tuple[bytes, Grant]] = {}

    def add(self, tokens: Sequence[bytes], grant: Grant) -> None:
        """Accept ``tokens`` (one token file's: several while it is being rotated) for ``grant``."""
        if any(g.name == grant.name for _, g in self._by_id.values()):
            raise AuthzError(f"two tokens are named {grant.name!r}")
        for token in tokens:
            kid = key_id(token)
            if kid in self._by_id:
                raise AuthzError(f"token {grant.name!r} is the same token as {self._by_id[kid][1].name!r}")
            self._by_id[kid] = (token, grant)

    def find(self, kid: bytes) -> tuple[bytes, Grant] | None:
        return self._by_id.get(bytes(kid))

    def named(self, name: str) -> Grant | None:
        return next((g for _, g in self._by_id.values() if g.name == name), None)

    def grants(self) -> Iterable[Grant]:
        return dict.fromkeys(g for _, g in self._by_id.values())

    def describe(self) -> str:
        """For the log: each name, its role, and how many tokens it has."""
        counts = collections.Counter(g for _, g in self._by_id.values())
        return ", ".join(f"{g.name} ({'admin' if g.admin else 'pools'}, {n} token{'s' if n > 1 else ''}"
                         f"{g.limits()})" for g, n in counts.items())

    def replace_with(self, other: TokenBook) -> None:
        """Accept ``other``'s tokens from now on (a reload); sessions already open keep theirs."""
        self._by_id = dict(other._by_id)


def _limits(where: str, words: list[str]) -> tuple[int | None, int | None]:
    """quota=SIZE and pools=N among a line's words (no pool name holds '=')."""
    found: dict[str, int] = {}
    for word in words:
        key, _, value = word.partition("=")
        if key not in LIMITS:
            raise AuthzError(f"{where}: unknown limit {word!r}; the limits are quota=SIZE, pools=N "
                             "and connections=N")
        if key in found:
            raise AuthzError(f"{where}: {key}= is given twice")
        try:
            found[key] = parse_size(value) if key == "quota" else int(value)
        except ValueError:
            raise AuthzError(f"{where}: {word!r}: {key}= needs "
                             f"{'a size like 10G' if key == 'quota' else 'a whole number'}") from None
        if found[key] < 1:
            raise AuthzError(f"{where}: {word!r}: a limit of 0 lets the token create nothing; "
                             "give it no pool patterns instead, or remove its line")
    return found.get("quota"), found.get("pools")


def connection_cap(where: str, words: list[str]) -> tuple[int | None, list[str]]:
    """``connections=N`` among a line's words (the connections its token may hold at once, on
    either role), and the other words."""
    caps = [w for w in words if w.startswith("connections=")]
    if len(caps) > 1:
        raise AuthzError(f"{where}: connections= is given twice")
    if not caps:
        return None, words
    value = caps[0].partition("=")[2]
    if not value.isdigit() or int(value) < 1:
        raise AuthzError(f"{where}: {caps[0]!r}: connections= needs a whole number of at least 1")
    return int(value), [w for w in words if w != caps[0]]


def read_authz(path: str, book: TokenBook) -> None:
    """Add the tokens listed in ``path`` to ``book``; AuthzError naming the line if one is
    wrong, or when the file may be changed by others or grants nothing."""
    try:
        lines = read_owned(path, "authorization file", MAX_AUTHZ_FILE, secret=False
                           ).decode("utf-8").splitlines()
    except TokenError as exc:
        raise AuthzError(exc.reason) from None
    except UnicodeDecodeError as exc:
        raise AuthzError(f"cannot read authorization file {path}: {exc}") from None
    granted = 0
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}"
        if len(words) < 3:
            raise AuthzError(f"{where}: expected NAME ROLE TOKEN-FILE [POOL-PATTERN...] "
                             "[quota=SIZE] [pools=N] [connections=N]")
        name, role, token_file = words[0], words[1], words[2]
        connections, rest = connection_cap(where, words[3:])
        patterns = tuple(w for w in rest if "=" not in w)
        quota, max_pools = _limits(where, [w for w in rest if "=" in w])
        if role not in ROLES:
            raise AuthzError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        if role == "pools" and not patterns:
            raise AuthzError(f"{where}: a pools token needs at least one pool name pattern")
        if role == "admin" and patterns:
            raise AuthzError(f"{where}: an admin token may use every pool; give it no patterns")
        if role == "admin" and (quota or max_pools):
            raise AuthzError(f"{where}: an admin token has no limits; give quota= and pools= to "
                             "pools tokens")
        try:
            tokens = read_tokens(token_file)
        except TokenError as exc:
            raise AuthzError(f"{where}: {exc.reason}") from None
        try:
            book.add(tokens, Grant(name, role == "admin", patterns, quota, max_pools, connections))
        except AuthzError as exc:
            raise AuthzError(f"{where}: {exc}") from None
        granted += 1
    if not granted:
        raise AuthzError(f"authorization file {path} grants nothing (no NAME ROLE TOKEN-FILE line): "
                         "refusing it, as a file emptied by mistake; to withdraw every token it "
                         "granted, start the target without --authz")
