"""Mount options: what `-o` (and fstab, and mount(8)'s helper) may say, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rpmemfs.durability.commit import DEFAULT_COMMIT, MAX_COMMIT
from rpmemfs.mountd.errors import MountError
from rpmemfs.pmem import PMEM_MODES
from rpmemfs.poller import DEFAULT_POLL_US, MAX_POLL_US
from rpmemfs.transport.address import parse_address

# Options mount(8) and fstab hand every helper; they mean nothing to us.
IGNORED = {"rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto", "user",
           "nouser", "async", "defaults", "_netdev", "nofail", "atime", "noatime", "relatime"}


@dataclass
class MountOptions:
    pmem: str = "auto"
    log_level: str = "warning"
    log_file: str | None = None
    xattrs: bool = True
    min_replicas: int | None = None  # None: all recorded replicas
    replica_timeout: float = 10.0
    commit: float = DEFAULT_COMMIT  # seconds between periodic commits; 0: none
    token_file: str | None = None
    writeback_cache: bool = False
    poll_us: int = DEFAULT_POLL_US
    allow_other: bool = field(default_factory=lambda: os.geteuid() == 0)
    takeover: bool = False  # claim the replicas even from a newer owner (fencing it)
    metrics: str | None = None  # HOST:PORT to serve Prometheus metrics on
    extra: list[str] = field(default_factory=list)


def parse_options(opts: list[str]) -> MountOptions:
    mo = MountOptions()
    for group in opts:
        for opt in group.split(","):
            opt = opt.strip()
            if not opt or opt in IGNORED or opt.startswith("x-"):
                continue
            key, _, value = opt.partition("=")
            if key == "pmem":
                if value not in PMEM_MODES:
                    raise MountError(f"pmem= must be one of {', '.join(PMEM_MODES)}, not {value!r}")
                mo.pmem = value
            elif key == "debug":
                mo.log_level = "debug"
            elif key == "log_level":
                mo.log_level = value
            elif key == "log":
                mo.log_file = value
            elif key == "writeback_cache":
                # Off by default, by measurement: see docs/benchmarks.md.
                mo.writeback_cache = True
            elif key == "noxattr":
                mo.xattrs = False
            elif key == "takeover":
                mo.takeover = True
            elif key == "allow_other":
                mo.allow_other = True
            elif key == "min_replicas":
                if not value.isdigit():
                    raise MountError(f"min_replicas= needs a number, not {value!r}")
                mo.min_replicas = int(value)
            elif key == "replica_timeout":
                try:
                    mo.replica_timeout = float(value)
                except ValueError:
                    raise MountError(f"replica_timeout= needs seconds, not {value!r}") from None
                if not 0 < mo.replica_timeout <= 3600:
                    raise MountError("replica_timeout= must be between 0 and 3600 seconds")
            elif key == "commit":
                try:
                    mo.commit = float(value)
                except ValueError:
                    raise MountError(f"commit= needs seconds, not {value!r}") from None
                if not 0 <= mo.commit <= MAX_COMMIT:
                    raise MountError(f"commit= must be between 0 (off) and {MAX_COMMIT:g} seconds")
            elif key == "poll_us":
                # How long the daemon keeps polling /dev/fuse after a request (rpmemfs/poller.py).
                if not value.isdigit() or int(value) > MAX_POLL_US:
                    raise MountError(f"poll_us= needs microseconds from 0 to {MAX_POLL_US}, not {value!r}")
                mo.poll_us = int(value)
            elif key == "token_file":
                mo.token_file = value
            elif key == "metrics":
                try:
                    parse_address(value, 0)
                except ValueError as exc:
                    raise MountError(f"metrics= needs HOST:PORT: {exc}") from None
                mo.metrics = value
            else:
                raise MountError(f"unknown mount option {opt!r}")
    return mo
