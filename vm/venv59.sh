#!/usr/bin/env bash
# Builds vm/venv59: a venv of Debian's /usr/bin/python3 (WITHOUT --system-site-packages, so
# Debian's python3-pyverbs of rdma-core 44 stays out) with PyPI's pyverbs 59, for the verbs
# tests that need rdma-core >= 45 (native RDMA FLUSH: tests/verbs/test_verbs_flush.py) on a
# kernel whose rxe has FLUSH (Linux >= 6.2: VM_KERNEL_PKG=linux-image-6.12.*+deb12-amd64).
# Safe to run again: does nothing when the venv is complete.
#
# PyPI's pyverbs is an sdist that compiles all of rdma-core 59 (about 4.5 min on 2 cores) but
# its wheel carries only the pyverbs package: its modules need libibverbs.so.1 with
# IBVERBS_PRIVATE_59, and without more they bind the system's rdma-core 44 and fail to import
# ("version `IBVERBS_PRIVATE_59' not found"); libibverbs 59 would also look for its providers
# and its config in the (deleted) build tree. So the build keeps its tree, and this script
# copies libibverbs, librdmacm and the rxe provider of that build into vm/venv59/rdma-core/,
# with rdma-core configured (VERBS_PROVIDER_DIR, CMAKE_INSTALL_SYSCONFDIR) to look there and
# the pyverbs modules given that directory as their RUNPATH.
#
# Cython is held below 3.1 (pyverbs 59 does not build with 3.1); PIP_CONSTRAINT applies the
# constraint to the isolated build environment too.
set -euo pipefail
VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$VM_DIR")
V=$VM_DIR/venv59
RC=$V/rdma-core
say() { echo "vm/venv59.sh: $*" >&2; }
die() { say "$*"; exit 1; }

py=$V/bin/python
if [ -x "$py" ] && "$py" -c 'import pyverbs.libibverbs_enums, pyverbs.qp, pytest, pytest_timeout, trio, cffi, pyfuse3; assert hasattr(pyfuse3.Operations, "lseek")' 2>/dev/null; then
    # Complete, but its pyfuse3 may be of an older patch: rebuilt when the patch changed.
    exec "$REPO/scripts/build-pyfuse3.sh" "$py"
fi

BUILD_DEPS=(build-essential cmake ninja-build pkg-config python3-dev python3-venv libnl-3-dev
            libnl-route-3-dev libudev-dev)
missing=()
for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x "$py" ] || /usr/bin/python3 -m venv "$V"
mkdir -p "$RC/lib" "$RC/etc/libibverbs.d"
echo 'cython<3.1' > "$V/constraints.txt"
if ! "$py" -c 'import pyverbs.libibverbs_enums' 2>/dev/null; then
    build=$RC/build
    rm -rf "$build"
    say "building pyverbs 59 (all of rdma-core 59; minutes)"
    start=$SECONDS
    PIP_CONSTRAINT=$V/constraints.txt "$py" -m pip install -q --disable-pip-version-check --no-cache-dir \
        --no-binary pyverbs \
        --config-settings=build-dir="$build" \
        --config-settings=cmake.define.VERBS_PROVIDER_DIR="$RC/lib" \
        --config-settings=cmake.define.CMAKE_INSTALL_SYSCONFDIR="$RC/etc" \
        --config-settings=cmake.define.CMAKE_INSTALL_RPATH="$RC/lib" \
        'pyverbs==59.0' || die "pip install pyverbs==59.0 failed"
    # The install step put the providers in VERBS_PROVIDER_DIR and the .driver files in
    # $RC/etc (absolute paths), but the libraries only in the wheel's staging area, which the
    # wheel then leaves out.
    cp -a "$build"/lib/libibverbs.so.1* "$build"/lib/librdmacm.so.1* "$RC/lib/"
    [ -e "$RC/lib/librxe-rdmav59.so" ] || cp "$build/lib/librxe-rdmav59.so" "$RC/lib/"
    # Only rxe: some other providers are links into the deleted staging area, and libibverbs
    # would warn about each one it cannot load.
    find "$RC/lib" -name 'lib*-rdmav59.so' ! -name 'librxe-rdmav59.so' -delete
    rm -f "$RC"/etc/libibverbs.d/*.driver
    echo 'driver rxe' > "$RC/etc/libibverbs.d/rxe.driver"
    rm -rf "$build"
    say "pyverbs 59 built in $((SECONDS - start)) s"
fi
# The repository on the path (as `pip install -e .` does for vm/venv, without rebuilding the
# cffi module in the tree: its abi3 build fits every Python 3).
echo "$REPO" > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rpmemfs-repo.pth"
"$py" -m pip install -q --disable-pip-version-check pytest pytest-timeout trio cffi cryptography
"$REPO/scripts/build-pyfuse3.sh" "$py" || die "cannot build the patched pyfuse3"
"$py" -c 'import pyverbs.libibverbs_enums, pyverbs.qp' || die "pyverbs 59 does not import"
