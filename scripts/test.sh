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
    exec .venv/bin/python -m pytest -q tests/e2e
fi
exec .venv/bin/python -m pytest -q "$@"
