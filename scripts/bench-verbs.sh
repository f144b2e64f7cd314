#!/usr/bin/env bash
# The verbs benchmark (rpmemfs/tools/bench/verbs.py): barriers over Soft-RoCE inside the VM, beside
# perftest's ib_write_lat / ib_read_lat / ib_write_bw on the same rxe pair, as ratios.
# Sets up what scripts/test-verbs.sh sets up; arguments go to the benchmark, e.g.
#   scripts/bench-verbs.sh --iterations 500 --json /tmp/verbs.json
# VERBS_STACK=flush runs it on Linux 6.12 with PyPI's pyverbs 59 (vm/venv59), where rxe has
# native RDMA FLUSH, which is then measured too; the default is Debian's 6.1 and pyverbs 44.
set -uo pipefail
cd "$(dirname "$0")/.."
STACK=${VERBS_STACK:-debian}
case "$STACK" in
    debian) py=vm/venv/bin/python; kernel= ;;
    flush) py=vm/venv59/bin/python
           kernel=$(find vm/kernel -maxdepth 1 -name '6.12.*' -printf '%f\n' | sort -V | tail -n 1) ;;
    *) echo "bench-verbs: VERBS_STACK must be debian or flush, not $STACK" >&2; exit 2 ;;
esac
VERBS_STACK=$STACK scripts/test-verbs.sh --setup-only || exit $?
# An emulated NVDIMM laid out as device DAX: the barriers to a pool in persistent memory.
env -u PYTHONDONTWRITEBYTECODE VM_KERNEL="$kernel" VM_TIMEOUT="${VM_TIMEOUT:-1800}" \
    VM_NVDIMM="${VM_NVDIMM:-256}" VM_NVDIMM_MODE="${VM_NVDIMM_MODE:-devdax}" \
    vm/run.sh "$py" -m rpmemfs.tools.bench.verbs "$@"
