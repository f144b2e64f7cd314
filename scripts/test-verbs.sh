#!/usr/bin/env bash
# Runs the verbs tests (tests/verbs) on real verbs: Soft-RoCE devices inside a QEMU VM (vm/),
# because this machine's kernel has no RDMA. Installs what that needs first:
#   - the VM: vm/setup.sh (Debian packages, the Debian kernel, the initramfs);
#   - vm/venv: a venv of Debian's /usr/bin/python3, the one interpreter python3-pyverbs is
#     built for (--system-site-packages, so pyverbs imports), with pytest and trio from PyPI.
# Arguments go to pytest (--setup-only: prepare the VM and vm/venv, run nothing). Exit status: pytest's, or 125 when the VM could not start.
#
# VERBS_STACK picks the kernel and user space the tests run on:
#   debian (default)  Debian 12's kernel (6.1) and python3-pyverbs (rdma-core 44) in vm/venv;
#                     native RDMA FLUSH is absent there, and its test skips;
#   flush             Debian 12's 6.12 kernel (linux-image-6.12-amd64, from bookworm-security)
#                     and PyPI's pyverbs 59 built with its own rdma-core in vm/venv59
#                     (vm/venv59.sh, ~5 min the first time): rxe with FLUSH;
#   both              one after the other (the status is the first failure's).
set -uo pipefail
cd "$(dirname "$0")/.."

cannot_start() {
    echo "verbs tests: the VM could not start${1:+ ($1)}" >&2
    exit 125
}

STACK=${VERBS_STACK:-debian}
case "$STACK" in
    debian|flush|both) ;;
    *) echo "verbs tests: VERBS_STACK must be debian, flush or both, not $STACK" >&2; exit 2 ;;
esac
kernel612=
if [ "$STACK" != debian ]; then
    # The metapackage names the current 6.12 ABI, e.g. linux-image-6.12.117+deb12-amd64.
    meta() { apt-cache depends linux-image-6.12-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-6[.]12[.]/ {print $2; exit}'; }
    pkg=$(meta)
    [ -n "$pkg" ] || { apt-get update -qq; pkg=$(meta); }
    [ -n "$pkg" ] || cannot_start "no linux-image-6.12-amd64 in apt (bookworm-security)"
    VM_KERNEL_PKG=$pkg vm/setup.sh || cannot_start "vm/setup.sh failed for $pkg"
    kernel612=${pkg#linux-image-}
    vm/venv59.sh || { echo "verbs tests: cannot build vm/venv59 (see above)" >&2; exit 1; }
fi
# Last, so that vm/kernel/default (what a bare vm/run.sh boots) stays Debian's default kernel.
vm/setup.sh || cannot_start "vm/setup.sh failed"

if ! dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q 'install ok installed'; then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv >/dev/null \
        || { echo "verbs tests: cannot install python3-venv" >&2; exit 1; }
fi
if [ ! -x vm/venv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages vm/venv || { echo "verbs tests: cannot create vm/venv" >&2; exit 1; }
fi
py=vm/venv/bin/python
# cryptography: the handshake's X25519 and HKDF (rpmemfs/transport/auth.py); Debian's
# python3-cryptography (38) serves, through --system-site-packages, where it is installed.
if ! "$py" -c 'import pytest, pytest_timeout, trio, cryptography' 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check pytest pytest-timeout trio cryptography \
        || { echo "verbs tests: cannot install pytest, trio and cryptography into vm/venv" >&2; exit 1; }
fi
# The patched pyfuse3 the mount needs (as scripts/install.sh builds it for .venv).
scripts/build-pyfuse3.sh "$py" || { echo "verbs tests: cannot build pyfuse3 for vm/venv" >&2; exit 1; }
# The project itself, for the tests that will drive rpmemfs over verbs. Its cffi extension is
# compiled here, for Debian's Python; the transport-level tests do not need it.
if ! "$py" -m pip show -q rpmemfs >/dev/null 2>&1; then
    mkdir -p vm/logs
    if ! "$py" -m pip install -q --disable-pip-version-check -e . > vm/logs/pip-install-rpmemfs.log 2>&1; then
        echo "verbs tests: rpmemfs does not install into vm/venv (see vm/logs/pip-install-rpmemfs.log);" \
             "going on without it" >&2
    fi
fi

# Byte-compile on the host, where it is quick: under TCG, compiling a module costs seconds.
for p in "$py" ${kernel612:+vm/venv59/bin/python}; do
    "$p" -m compileall -q rpmemfs tests/verbs tests/e2e/test_lanes.py tests/e2e/conftest.py tests/e2e/helpers.py >/dev/null
done

[ "${1:-}" = --setup-only ] && exit 0

# tests/verbs: raw pyverbs between two processes, one mount replicated over verbs, and pools
# on the emulated NVDIMM, laid out as fsdax (ext4 -o dax) beside two device DAX namespaces;
# tests/e2e/test_lanes.py: the transport-level cases shared with TCP, their rdma half.
run_tests() {  # KERNEL (empty: the default) PYTHON PYTEST-ARGS...
    local kernel=$1 python=$2
    shift 2
    echo "verbs tests: kernel ${kernel:-$(cat vm/kernel/default)}, $python" >&2
    env -u PYTHONDONTWRITEBYTECODE VM_KERNEL="$kernel" VM_NVDIMM="${VM_NVDIMM:-256}" \
        VM_NVDIMM_MODE="${VM_NVDIMM_MODE:-both}" vm/run.sh "$python" -m pytest -q -p no:cacheprovider \
        tests/verbs tests/e2e/test_lanes.py -k "rdma or not test_lanes" "$@"
}
rc=0
if [ "$STACK" != flush ]; then
    run_tests "" "$py" "$@"
    rc=$?
fi
if [ "$STACK" != debian ] && [ "$rc" = 0 ]; then
    run_tests "$kernel612" vm/venv59/bin/python "$@"
    rc=$?
fi
[ "$rc" = 125 ] && cannot_start
exit "$rc"
