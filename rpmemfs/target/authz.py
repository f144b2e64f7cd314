"""Who may do what on a target: the tokens it accepts, each with a name, a role and pools.

The target's own token (``--token-file``, or the one it generated) is an ``admin`` token: every
pool and every operation. ``--authz FILE`` adds tokens limited to some pools, one a line::

    # name   role    token file                 pool names (shell patterns)
    alice    pools   /etc/rpmemfs/alice.token   alice-* shared
    ops      admin   /etc/rpmemfs/ops.token

A ``pools`` token may create, open, probe, remove and list only pools whose names match one
of its patterns; what it asks about any other pool is refused (code ``denied``), and listings
show it only its own pools. Administrative operations (``evict``: dropping another session's
registration) need an ``admin`` token.
"""

from __future__ import annotations

import collections
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rpmemfs.target.errors import TargetError
from rpmemfs.target.pools import PoolError
from rpmemfs.transport.tokens import TokenError, key_id, read_tokens

ROLES = ("admin", "pools")
DEFAULT_NAME = "default"
# Operations that act on the target as a whole or on other initiators' sessions.
ADMIN_OPS = frozenset({"evict"})
V = TypeVar("V")


class AuthzError(TargetError):
    """The authorization file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Grant:
    """What the holder of one token may do."""

    name: str
    admin: bool
    pools: tuple[str, ...] = ()  # patterns; an admin may use every pool

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

    def grants(self) -> Iterable[Grant]:
        return dict.fromkeys(g for _, g in self._by_id.values())

    def describe(self) -> str:
        """For the log: each name, its role, and how many tokens it has."""
        counts = collections.Counter(g for _, g in self._by_id.values())
        return ", ".join(f"{g.name} ({'admin' if g.admin else 'pools'}, {n} token{'s' if n > 1 else ''})"
                         for g, n in counts.items())

    def replace_with(self, other: TokenBook) -> None:
        """Accept ``other``'s tokens from now on (a reload); sessions already open keep theirs."""
        self._by_id = dict(other._by_id)


def read_authz(path: str, book: TokenBook) -> None:
    """Add the tokens listed in ``path`` to ``book``; AuthzError naming the line if one is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthzError(f"cannot read authorization file {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}"
        if len(words) < 3:
            raise AuthzError(f"{where}: expected NAME ROLE TOKEN-FILE [POOL-PATTERN...]")
        name, role, token_file, patterns = words[0], words[1], words[2], tuple(words[3:])
        if role not in ROLES:
            raise AuthzError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        if role == "pools" and not patterns:
            raise AuthzError(f"{where}: a pools token needs at least one pool name pattern")
        if role == "admin" and patterns:
            raise AuthzError(f"{where}: an admin token may use every pool; give it no patterns")
        try:
            tokens = read_tokens(token_file)
        except TokenError as exc:
            raise AuthzError(f"{where}: {exc.reason}") from None
        try:
            book.add(tokens, Grant(name, role == "admin", patterns))
        except AuthzError as exc:
            raise AuthzError(f"{where}: {exc}") from None
