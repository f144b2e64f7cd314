"""Where replicas live, as people write it: ``HOST:PORT/NAME`` and pool-set files.

A pool-set file, in the spirit of PMDK's, names the local pool and its replicas:

    PMEMPOOLSET
    256M /path/app.pool
    REPLICA 127.0.0.1:7420 app

Errors name the line and say what is wrong, because a pool-set file is typed by hand.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from rpmemfs.poolname import PoolNameError, check_name
from rpmemfs.replica.errors import ReplicationError
from rpmemfs.transport.address import format_address, parse_address
from rpmemfs.units import parse_size

POOLSET_MAGIC = "PMEMPOOLSET"
TRANSPORTS = ("auto", "tcp", "rdma")


def split_scheme(text: str) -> tuple[str, str]:
    """("tcp" | "rdma" | "auto", the rest) of ``[SCHEME://]REST``; ValueError for others."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return "auto", text
    if scheme.lower() not in ("tcp", "rdma"):
        raise ValueError(f"unknown transport {scheme!r}: use tcp:// or rdma:// (or neither)")
    return scheme.lower(), rest


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: the target's ``HOST:PORT`` (normalised), the pool's name there, and the
    transport: ``rdma`` (verbs), ``tcp`` (the software transport) or ``auto`` (verbs when
    this node has an RDMA device, else TCP). Two specs name the same replica when address
    and name match, whatever the transport."""

    address: str
    name: str
    transport: str = field(default="auto", compare=False)

    def __str__(self) -> str:
        return f"{self.address}/{self.name}"

    @property
    def url(self) -> str:
        """As typed: with the scheme when the transport was chosen."""
        return str(self) if self.transport == "auto" else f"{self.transport}://{self}"

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """From ``[tcp://|rdma://]HOST:PORT/NAME`` (``[V6ADDR]:PORT`` for IPv6)."""
        try:
            transport, body = split_scheme(text.strip())
        except ValueError as exc:
            raise ValueError(f"bad replica {text!r}: {exc}") from None
        address, sep, name = body.rpartition("/")
        if not sep:
            raise ValueError(f"bad replica {text!r}: expected [tcp://|rdma://]HOST:PORT/NAME")
        return cls.make(address, name, text, transport)

    @classmethod
    def make(cls, address: str, name: str, shown: str | None = None,
             transport: str = "auto") -> ReplicaSpec:
        """From the parts; ValueError names ``shown`` (or the parts) and the reason."""
        shown = shown if shown is not None else f"{address}/{name}"
        if transport not in TRANSPORTS:
            raise ValueError(f"bad replica {shown!r}: unknown transport {transport!r}")
        try:
            host, port = parse_address(address)
        except ValueError as exc:
            raise ValueError(f"bad replica {shown!r}: {exc}") from None
        # Port 0 means "any port" to a listener; an initiator cannot connect to it.
        if port == 0:
            raise ValueError(f"bad replica {shown!r}: port 0 is not a target's port")
        try:
            check_name(name)
        except PoolNameError as exc:
            raise ValueError(f"bad replica {shown!r}: {exc}") from None
        return cls(format_address(host, port), name, transport)

    def to_json(self) -> dict[str, str]:
        out = {"address": self.address, "name": self.name}
        if self.transport != "auto":
            out["transport"] = self.transport
        return out


@dataclass
class PoolSet:
    """The local pool (size and absolute path) and its replicas. ``size`` is None for PMDK's
    ``AUTO``: the whole device DAX the path names (mkfs looks the device up)."""

    size: int | None
    path: str
    replicas: list[ReplicaSpec] = field(default_factory=list)


class PoolSetError(ReplicationError, ValueError):
    """A pool-set file is malformed; the message names the file, the line and the problem."""


def _content_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines that mean something: no comments, no blanks."""
    out: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append((number, line))
    return out


def parse_poolset(text: str, source: str = "pool set") -> PoolSet:
    """The pool set described by ``text``; PoolSetError for the first malformed line."""

    def fail(number: int, what: str) -> PoolSetError:
        return PoolSetError(f"{source}, line {number}: {what}")

    lines = _content_lines(text)
    if not lines or lines[0][1] != POOLSET_MAGIC:
        number = lines[0][0] if lines else 1
        raise fail(number, f"missing header: the first line must be {POOLSET_MAGIC}")
    local: tuple[int, int | None, str] | None = None  # line number, size, path
    replicas: list[ReplicaSpec] = []
    for number, line in lines[1:]:
        fields = line.split()
        if fields[0].upper() == "REPLICA":
            replicas.append(_replica_line(fields[1:], number, fail))
            continue
        if len(fields) != 2:
            raise fail(number, "expected 'SIZE|AUTO /absolute/path' or "
                               f"'REPLICA [tcp://|rdma://]HOST:PORT NAME', got {line!r}")
        size_text, path = fields
        size: int | None = None
        if size_text.upper() != "AUTO":  # PMDK's word for "all of the device DAX"
            try:
                size = parse_size(size_text)
            except ValueError as exc:
                raise fail(number, f"{exc}, or AUTO for a whole device DAX") from None
            if size <= 0:
                raise fail(number, f"bad size {size_text!r}: the pool needs a positive size")
        if not os.path.isabs(path):
            raise fail(number, f"pool path {path!r} is relative: write it as an absolute path")
        if local is not None:
            raise fail(number, f"second local part {path!r}: a pool set has one local pool "
                               f"(the first is on line {local[0]})")
        local = (number, size, path)
    if local is None:
        raise fail(lines[-1][0], "no local part: add a line 'SIZE /absolute/path' after the header")
    return PoolSet(local[1], os.path.normpath(local[2]), replicas)


def _replica_line(args: list[str], number: int, fail: Callable[[int, str], PoolSetError]) -> ReplicaSpec:
    if len(args) == 1 and "/" in args[0]:
        address, _, name = args[0].rpartition("/")
    elif len(args) == 2:
        address, name = args
    elif not args:
        raise fail(number, "REPLICA needs an address and a pool name: REPLICA HOST:PORT NAME")
    elif len(args) == 1:
        raise fail(number, f"REPLICA {args[0]} has no pool name: REPLICA HOST:PORT NAME")
    else:
        raise fail(number, f"REPLICA takes HOST:PORT and NAME, got {len(args)} fields")
    try:
        transport, address = split_scheme(address)
        return ReplicaSpec.make(address, name, transport=transport)
    except ValueError as exc:
        raise fail(number, str(exc)) from None


def read_poolset(path: str) -> PoolSet:
    with open(path, encoding="utf-8") as f:
        return parse_poolset(f.read(), path)


def is_poolset(path: str) -> bool:
    """True when the first non-blank line of the file at ``path`` is PMEMPOOLSET.

    A pool file starts with binary header bytes, so only its first block is read; bytes that
    are not UTF-8 cannot spell the magic, so replacing them is harmless.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    for line in head.decode("utf-8", errors="replace").splitlines():
        line = line.strip()
        if line:
            return line == POOLSET_MAGIC
    return False


def poolset_at(path: str) -> PoolSet | None:
    """The pool set when ``path`` names a pool-set file; None when it names anything else (a
    pool file, or nothing yet). PoolSetError when it is a pool-set file that does not parse.

    Every command that takes "POOL or POOLSET" asks this, so they all agree on which is which.
    """
    if os.path.isfile(path) and is_poolset(path):
        return read_poolset(path)
    return None
