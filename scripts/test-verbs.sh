#!/usr/bin/env bash
# Runs the verbs tests (tests/verbs) on real verbs: Soft-RoCE devices inside a QEMU VM (vm/),
# because this machine's kernel has no RDMA. Installs what that needs first:
#   - the VM: vm/setup.sh (Debian packages, the Debian kernel, the initramfs);
#   - vm/venv: a venv of Debian's /usr/bin/python3, the one interpreter python3-pyverbs is
#     built for (--system-site-packages, so pyverbs imports), with pytest and trio from PyPI.
# Arguments go to pytest (--setup-only: prepare the VM and vm/venv, run nothing). Exit status: pytest's, or 125 when the VM could not start.
set -uo pipefail
cd "$(dirname "$0")/.."

cannot_start() {
    echo "verbs tests: the VM could not start${1:+ ($1)}" >&2
    exit 125
}

vm/setup.sh || cannot_start "vm/setup.sh failed"

if ! dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q 'install ok installed'; then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv >/dev/null \
        || { echo "verbs tests: cannot install python3-venv" >&2; exit 1; }
fi
if [ ! -x vm/venv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages vm/venv || { echo "verbs tests: cannot create vm/venv" >&2; exit 1; }
fi
py=vm/venv/bin/python
if ! "$py" -c 'import pytest, pytest_timeout, trio' 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check pytest pytest-timeout trio \
        || { echo "verbs tests: cannot install pytest and trio into vm/venv" >&2; exit 1; }
fi
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
"$py" -m compileall -q rpmemfs tests/verbs tests/test_lanes.py tests/conftest.py tests/helpers.py >/dev/null

[ "${1:-}" = --setup-only ] && exit 0

# tests/verbs: raw pyverbs between two processes, and one mount replicated over verbs;
# tests/test_lanes.py: the transport-level cases shared with TCP, their rdma half.
env -u PYTHONDONTWRITEBYTECODE vm/run.sh "$py" -m pytest -q -p no:cacheprovider \
    tests/verbs "tests/test_lanes.py" -k "rdma or not test_lanes" "$@"
rc=$?
[ "$rc" = 125 ] && cannot_start
exit "$rc"
