#!/usr/bin/env bash
# Installs rpmemfs with its test tools and runs the whole test suite (real FUSE mounts: needs
# root or a user allowed to mount FUSE filesystems, and /dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
.venv/bin/ruff check rpmemfs tests native
exec .venv/bin/python -m pytest -q "$@"
