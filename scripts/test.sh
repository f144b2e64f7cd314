#!/usr/bin/env bash
# Installs rpmemfs with its test tools and runs the whole test suite (real FUSE mounts: needs
# root or a user allowed to mount FUSE filesystems, and /dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
.venv/bin/ruff check rpmemfs tests native
.venv/bin/mypy
if [ $# -eq 0 ]; then
    # The fast tier first (no FUSE, no root, no other process: seconds), then end to end.
    .venv/bin/python -m pytest -q tests/unit
    if [ "$(id -u)" -eq 0 ]; then
        # ...and it needs no privilege: again as nobody where nobody may run this venv's
        # interpreter, else as root stripped of every capability and of setuid (so neither a
        # FUSE mount nor fusermount3 could work).
        if runuser -u nobody -- .venv/bin/python -c '' 2>/dev/null; then
            runuser -u nobody -- env HOME=/tmp .venv/bin/python -B -m pytest -q -p no:cacheprovider tests/unit
        else
            setpriv --bounding-set=-all --inh-caps=-all --no-new-privs \
                .venv/bin/python -B -m pytest -q -p no:cacheprovider tests/unit
        fi
    fi
    exec .venv/bin/python -m pytest -q tests/e2e
fi
exec .venv/bin/python -m pytest -q "$@"
