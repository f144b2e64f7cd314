"""Mount options: what `-o` (and fstab, and mount(8)'s helper) may say, checked once.

Each option is written once, in OPTIONS, with the help text that `rpmemfs mount --help` (and
so `mount.rpmemfs --help`) prints: the list cannot fall behind what is accepted.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from rpmemfs.durability.backlog import DEFAULT_MAX_LAG
from rpmemfs.durability.commit import DEFAULT_COMMIT, MAX_COMMIT
from rpmemfs.metrics_endpoint import MetricsEndpoint, metrics_endpoint
from rpmemfs.mountd.errors import MountError
from rpmemfs.pmem import PMEM_MODES
from rpmemfs.poller import DEFAULT_POLL_US, MAX_POLL_US
from rpmemfs.units import human, parse_size

# Options mount(8) and fstab hand every helper; they mean nothing to us.
IGNORED = {"rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto", "user",
           "nouser", "async", "defaults", "_netdev", "nofail", "atime", "noatime", "relatime"}
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class MountOptions:
    pmem: str = "auto"
    log_level: str = "warning"
    log_file: str | None = None
    xattrs: bool = True
    min_replicas: int | None = None  # None: all recorded replicas
    replica_timeout: float = 10.0
    commit: float = DEFAULT_COMMIT  # seconds between periodic commits; 0: none
    replication: str = "sync"  # or "async": fsync is local, replicas follow (docs/replication.md)
    max_lag: int | None = None  # async: bytes the required replicas may lag (None: DEFAULT_MAX_LAG)
    token_file: str | None = None
    writeback_cache: bool = False
    poll_us: int = DEFAULT_POLL_US
    allow_other: bool = field(default_factory=lambda: os.geteuid() == 0)
    takeover: bool = False  # claim the replicas even from a newer owner (fencing it)
    metrics_address: str | None = None  # metrics=[HOST:]PORT
    metrics_cert: str | None = None  # metrics over TLS: certificate, key, CA of client certificates
    metrics_key: str | None = None
    metrics_client_ca: str | None = None
    metrics: MetricsEndpoint | None = None  # where and how to serve them: made from the four above
    wire_protection: str | None = None  # None: the command's --wire-protection, else aead
    extra: list[str] = field(default_factory=list)


def _pmem(mo: MountOptions, value: str) -> None:
    if value not in PMEM_MODES:
        raise MountError(f"pmem= must be one of {', '.join(PMEM_MODES)}, not {value!r}")
    mo.pmem = value


def _log_level(mo: MountOptions, value: str) -> None:
    if value not in LOG_LEVELS:
        raise MountError(f"log_level= must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
    mo.log_level = value


def _min_replicas(mo: MountOptions, value: str) -> None:
    if not value.isdigit():
        raise MountError(f"min_replicas= needs a number, not {value!r}")
    mo.min_replicas = int(value)


def _seconds(value: str, name: str, low: float, high: float, low_ok: bool) -> float:
    try:
        s = float(value)
    except ValueError:
        raise MountError(f"{name}= needs seconds, not {value!r}") from None
    if not ((low <= s) if low_ok else (low < s)) or s > high:
        raise MountError(f"{name}= must be between {low:g}{' (off)' if low_ok else ''} and {high:g} seconds")
    return s


def _replica_timeout(mo: MountOptions, value: str) -> None:
    mo.replica_timeout = _seconds(value, "replica_timeout", 0, 3600, False)


def _commit(mo: MountOptions, value: str) -> None:
    mo.commit = _seconds(value, "commit", 0, MAX_COMMIT, True)


REPLICATION_MODES = ("sync", "async")
MAX_MAX_LAG = 1 << 40  # the copies are held in memory: a TiB is surely a typo


def _replication(mo: MountOptions, value: str) -> None:
    if value not in REPLICATION_MODES:
        raise MountError(f"replication= must be sync or async, not {value!r}")
    mo.replication = value


def _max_lag(mo: MountOptions, value: str) -> None:
    try:
        size = parse_size(value)
    except ValueError:
        raise MountError(f"max_lag= needs a size like 64M (bytes, or with K, M, G), not {value!r}") from None
    if not 0 < size < MAX_MAX_LAG:
        raise MountError(f"max_lag= must be above 0 and below {human(MAX_MAX_LAG)}, not {value!r}")
    mo.max_lag = size


def _poll_us(mo: MountOptions, value: str) -> None:
    # How long the daemon keeps polling /dev/fuse after a request (rpmemfs/poller.py).
    if not value.isdigit() or int(value) > MAX_POLL_US:
        raise MountError(f"poll_us= needs microseconds from 0 to {MAX_POLL_US}, not {value!r}")
    mo.poll_us = int(value)


def _metrics(mo: MountOptions) -> None:
    tls = {"metrics_cert": mo.metrics_cert, "metrics_key": mo.metrics_key,
           "metrics_client_ca": mo.metrics_client_ca}
    if mo.metrics_address is None:
        if any(tls.values()):
            raise MountError(f"{', '.join(k + '=' for k, v in tls.items() if v)} apply only with metrics=")
        return
    try:
        mo.metrics = metrics_endpoint(mo.metrics_address, mo.metrics_cert, mo.metrics_key,
                                      mo.metrics_client_ca)
    except ValueError as exc:
        raise MountError(f"metrics=: {exc}") from None


def _wire_protection(mo: MountOptions, value: str) -> None:
    if value not in ("aead", "none"):
        raise MountError(f"wire_protection= must be aead or none, not {value!r}")
    mo.wire_protection = value


def _set(attr: str, value: object) -> Callable[[MountOptions, str], None]:
    def apply(mo: MountOptions, _: str) -> None:
        setattr(mo, attr, value)
    return apply


def _text(attr: str) -> Callable[[MountOptions, str], None]:
    def apply(mo: MountOptions, value: str) -> None:
        if not value:
            raise MountError(f"{attr}= needs a value")
        setattr(mo, attr, value)
    return apply


# name -> (takes a value, how to show it, what it does, how it is applied)
OPTIONS: dict[str, tuple[bool, str, str, Callable[[MountOptions, str], None]]] = {
    "pmem": (True, "pmem=auto|force|msync", "how stores are made durable: auto = cache flushes on a "
             "DAX mapping (MAP_SYNC), else msync; force = flushes on any mapping (emulated pmem)", _pmem),
    "min_replicas": (True, "min_replicas=K", "replicas in sync that fsync requires (default: all)",
                     _min_replicas),
    "replica_timeout": (True, "replica_timeout=S", "deadline of every network wait (default 10)",
                        _replica_timeout),
    "replication": (True, "replication=sync|async", "sync (default): fsync returns once the "
                    "replicas acknowledged; async: once persistent locally, the replicas following "
                    "in order in the background (docs/replication.md)", _replication),
    "max_lag": (True, "max_lag=SIZE", f"async: writers wait while the replicas min_replicas "
                f"requires lag by more than SIZE (default {DEFAULT_MAX_LAG >> 20}M)", _max_lag),
    "commit": (True, "commit=S", f"a durability point every S seconds when something changed "
               f"(default {DEFAULT_COMMIT:g}, 0: off)", _commit),
    "token_file": (True, "token_file=F", "token for the target daemons (default: the one recorded "
                   "in the pool)", _text("token_file")),
    "wire_protection": (True, "wire_protection=aead|none", "aead (default): traffic to the targets "
                        "over TCP is encrypted and authenticated; none: plaintext, for a trusted "
                        "link to targets started with --wire-protection none", _wire_protection),
    "takeover": (False, "takeover", "claim the replicas even from a newer primary, fencing it "
                 "(docs/failover.md)", _set("takeover", True)),
    "noxattr": (False, "noxattr", "no extended attributes: saves the GETXATTR before each write "
                "that kernels without FUSE_HANDLE_KILLPRIV_V2 (before 5.11) send",
                _set("xattrs", False)),
    "writeback_cache": (False, "writeback_cache", "let the kernel cache writes (off by default, by "
                        "measurement: docs/benchmarks.md)", _set("writeback_cache", True)),
    "poll_us": (True, "poll_us=US", f"poll /dev/fuse this long after a request instead of sleeping "
                f"at once (default {DEFAULT_POLL_US}, 0: off)", _poll_us),
    "allow_other": (False, "allow_other", "let other users in (the default when mounted by root)",
                    _set("allow_other", True)),
    "metrics": (True, "metrics=[HOST:]PORT", "serve Prometheus metrics at http://HOST:PORT/metrics "
                "(PORT alone: on 127.0.0.1); they name the pool and mount point, so see "
                "docs/operations.md before exposing them", _text("metrics_address")),
    "metrics_cert": (True, "metrics_cert=F", "serve metrics over TLS with this certificate (PEM)",
                     _text("metrics_cert")),
    "metrics_key": (True, "metrics_key=F", "... and its private key (mode 0600)", _text("metrics_key")),
    "metrics_client_ca": (True, "metrics_client_ca=F", "... and serve only scrapers whose client "
                          "certificate this CA signed", _text("metrics_client_ca")),
    "log": (True, "log=FILE", "log to FILE (default: stderr in the foreground, else syslog, or "
            "without one a file `rpmemfs status` names)", _text("log_file")),
    "log_level": (True, "log_level=LEVEL", f"{'|'.join(LOG_LEVELS)} (default warning)", _log_level),
    "debug": (False, "debug", "the same as log_level=debug", _set("log_level", "debug")),
}


def options_help() -> str:
    """Every option, one per line, as `rpmemfs mount --help` prints them."""
    width = max(len(shown) for _, shown, _, _ in OPTIONS.values())
    lines = ["mount options (-o OPT,OPT...; also in fstab):"]
    for _, shown, text, _ in OPTIONS.values():
        lines.append(textwrap.fill(text, 96, initial_indent=f"  {shown.ljust(width)}  ",
                                   subsequent_indent=" " * (width + 4)))
    lines.append(textwrap.fill(f"ignored, as mount(8) passes them to every helper: "
                               f"{', '.join(sorted(IGNORED))}, x-*", 96, initial_indent="  ",
                               subsequent_indent="  "))
    return "\n".join(lines)


def parse_options(opts: list[str]) -> MountOptions:
    mo = MountOptions()
    for group in opts:
        for opt in group.split(","):
            opt = opt.strip()
            if not opt or opt in IGNORED or opt.startswith("x-"):
                continue
            key, eq, value = opt.partition("=")
            known = OPTIONS.get(key)
            if known is None:
                raise MountError(f"unknown mount option {opt!r} (rpmemfs mount --help lists them)")
            takes_value, shown, _, apply = known
            if takes_value != bool(eq):
                raise MountError(f"mount option {opt!r}: write it as {shown}")
            apply(mo, value)
    if mo.max_lag is not None and mo.replication != "async":
        raise MountError("max_lag= applies only with replication=async")
    _metrics(mo)
    return mo
