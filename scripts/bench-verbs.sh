#!/usr/bin/env bash
# The verbs benchmark (rpmemfs/bench/verbs.py): barriers over Soft-RoCE inside the VM, beside
# perftest's ib_write_lat / ib_read_lat / ib_write_bw on the same rxe pair, as ratios.
# Sets up what scripts/test-verbs.sh sets up; arguments go to the benchmark, e.g.
#   scripts/bench-verbs.sh --iterations 500 --json /tmp/verbs.json
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/test-verbs.sh --setup-only || exit $?
env -u PYTHONDONTWRITEBYTECODE VM_TIMEOUT="${VM_TIMEOUT:-1800}" vm/run.sh vm/venv/bin/python -m rpmemfs.bench.verbs "$@"
